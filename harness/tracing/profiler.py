"""Profiled steps on the ranks: step 5 of the debugging method, the profile of a run whose
numbers already agree with one device.

Collective: the target's strategy is set up afresh, trains ``warmup`` steps unprofiled (first
calls allocate, build groups and warm caches), then ``steps`` steps under ``torch.profiler``,
each inside a ``harness.step#k`` annotation. Each rank exports its own Chrome trace (which
:func:`harness.analysis.profile.summarize_rank` reads); the harness's own collective trace of
the same steps (:class:`~harness.tracing.tracer.Tracer`) travels beside it, so the profiler's
collective counts and bytes are checked against what the hooks saw.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reference.case import Case, tensors_in

from harness.strategy import DistContextLike

__all__ = ["STAGE_MARK", "STEP_MARK", "profile_loop", "profile_strategy"]

STEP_MARK = "harness.step#"  # the annotation of each profiled step: harness.step#<step>
STAGE_MARK = "harness.stage#"  # a pipeline stage's work: harness.stage#<index>.forward / .backward


def _train_step(case: Case, strategy: Any, setup: Any, step: int, tracer: Any) -> int:
    """One unrecorded training step; returns the tokens (integer input elements) it read on this rank."""
    tracer.begin_step(step)
    batches = strategy.local_batches(case, setup, step)
    strategy.forward_backward(case, setup, batches)
    if case.grad_clip is not None:
        strategy.clip_gradients(case, setup)
    strategy.optimizer_step(case, setup)
    setup.step_lr_scheduler()
    setup.optimizer.zero_grad(set_to_none=True)
    return sum(t.numel() for b in batches for t in tensors_in(b.inputs) if not t.is_floating_point())


def profile_strategy(case: Case, strategy: Any, ctx: DistContextLike, *, steps: int, warmup: int,
                     trace_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Collective: profile ``steps`` steps after ``warmup`` (see the module docstring); this
    rank's Chrome trace is written to ``trace_dir/rank<r>.json``. Returns what the trace does
    not hold: its path, the hooks' collectives of those steps, the tokens read, the state's bytes."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from harness.tracing.tracer import Tracer

    case = case.with_steps(warmup + steps)
    tracer = Tracer(name=f"profile-{strategy.name}-{case.name}")
    setup = strategy.setup(case, ctx)
    setup.start_lr_scheduler(case)
    tracer.describe(layout=setup.layout, model=setup.model, state=setup.state)
    case.seed_training()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    tokens = 0
    with tracer:
        for step in range(warmup):
            _train_step(case, strategy, setup, step, tracer)
        tracer.set_phase("harness")
        dist.barrier()  # every rank starts its profiled steps together: the slowest rank is the slowest at work
        tracer.set_phase("train")
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        _annotate_stages(setup.state)
        with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
            for step in range(warmup, warmup + steps):
                with record_function(f"{STEP_MARK}{step}"):
                    tokens += _train_step(case, strategy, setup, step, tracer)
        tracer.set_phase("harness")
    return _recorded(prof, tracer, ctx, setup.layout, [setup.model] if isinstance(setup.model, torch.nn.Module) else list(setup.model),
                     setup.optimizer, warmup=warmup, tokens=tokens, trace_dir=trace_dir)


def _annotate_stages(state: Any) -> None:
    """``torch.distributed.pipelining``'s schedules mark no stage work (2.13): wrap each
    stage's ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` on
    the instance in a ``harness.stage#<i>.forward`` / ``.backward`` annotation, so the profile
    reads each stage's busy time as the schedule ran it (p2p waits are outside these calls)."""
    from torch.profiler import record_function

    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # pragma: no cover - pipelining ships with torch 2.13
        return
    values = list(state.values()) if isinstance(state, dict) else []
    stages = [v for v in values if isinstance(v, _PipelineStageBase)]
    stages += [x for v in values if isinstance(v, (list, tuple)) for x in v if isinstance(x, _PipelineStageBase)]
    for stage in stages:
        for method, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                              ("backward_weight_one_chunk", "backward")):
            inner = getattr(stage, method, None)
            if inner is None or getattr(inner, "_harness_annotated", False):
                continue

            def annotated(*args: Any, _inner: Any = inner, _name: str = f"{STAGE_MARK}{stage.stage_index}.{phase}",
                          **kwargs: Any) -> Any:
                with record_function(_name):
                    return _inner(*args, **kwargs)

            annotated._harness_annotated = True  # type: ignore[attr-defined]
            setattr(stage, method, annotated)


def _recorded(prof: Any, tracer: Any, ctx: DistContextLike, layout: Any, models: list[Any], optimizer: Any, *, warmup: int,
              tokens: int, trace_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Export this rank's trace; what it does not hold (the hooks' collectives of the profiled
    steps, tokens, state bytes, the layout) beside its path."""
    from harness.record.memory import expected_state_bytes, state_bytes
    from harness.tracing.records import record_bytes

    path = Path(trace_dir) / f"rank{ctx.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    rank_trace = tracer.finish()
    hooks_saw = [
        {"op": c.op, "group": c.group_desc or c.group, "group_ranks": c.group_ranks, "bytes": record_bytes(c), "is_p2p": c.is_p2p}
        for c in rank_trace.collectives if c.step is not None and c.step >= warmup and c.phase != "harness"
    ]
    param_b, grad_b, optim_b = state_bytes(models, optimizer)
    element = next((p.element_size() for m in models for p in m.parameters()), 4)
    arithmetic = expected_state_bytes(models, element)
    summary: dict[str, Any] = {
        "rank": ctx.rank, "trace": str(path), "hooks_saw": hooks_saw, "tokens": tokens,
        "state_bytes": {"params": param_b, "grads": grad_b, "optimizer": optim_b},
        # the arithmetic (parameters over their shard counts; gradients as many; Adam's two
        # moments), beside what the rank held after its last step (gradients freed by zero_grad)
        "state_arithmetic": {"params": arithmetic["params"], "grads": arithmetic["grads"], "optimizer": arithmetic["optim"]},
        "stages": list(layout.stages) if layout is not None and layout.stages is not None else None,
        "mesh": dict(layout.mesh) if layout is not None else {},
    }
    if ctx.device.type == "cuda":
        summary["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(ctx.device))
    return summary


def profile_loop(case: Case, train: Any, ctx: DistContextLike, *, steps: int, warmup: int,
                 trace_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Collective: :func:`profile_strategy` for a ``train(ctx, run)`` loop. The loop runs
    ``warmup + steps`` steps recorded by a :class:`~harness.record.custom.CustomRun` (it needs
    one to run at all); a step ends where its ``run.after_step`` does, so step ``k``'s
    annotation spans from the end of ``after_step(k - 1)`` to the end of ``after_step(k)``, and
    the harness's own recording inside it is annotated ``harness.recording`` and left out of
    the figures (:func:`harness.analysis.profile.summarize_rank`)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    from harness.context import DefaultGroupKept
    from harness.record.custom import CustomRun
    from harness.tracing.tracer import Tracer

    case = case.with_steps(warmup + steps)
    tracer = Tracer(name=f"profile-custom-{case.name}")
    record_dir = Path(tempfile.mkdtemp(prefix="harness-profile-loop-")) / "record" if ctx.rank == 0 else None
    run = CustomRun(case, ctx, record_dir, dst=0, tracer=tracer)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    prof = profile(activities=activities, record_shapes=True, profile_memory=True)
    state: dict[str, Any] = {"span": None, "running": False}

    def begin(step: int) -> None:
        if warmup <= step < warmup + steps:
            state["span"] = record_function(f"{STEP_MARK}{step}")
            state["span"].__enter__()

    def on_step_end(step: int) -> None:
        if state["span"] is not None:
            state["span"].__exit__(None, None, None)
            state["span"] = None
        following = step + 1
        tracer.begin_step(following)  # what the loop issues from here on is the next step's
        run._traced_step = following
        if following == warmup + steps and state["running"]:
            prof.stop()
            state["running"] = False
            return
        if following == warmup and not state["running"]:
            prof.start()
            state["running"] = True
        begin(following)

    run.on_step_end = on_step_end
    case.seed_training()
    if warmup == 0:
        prof.start()
        state["running"] = True
        begin(0)
    with tracer:
        try:
            with DefaultGroupKept():  # a loop may destroy the default group at its end; the figures need one
                train(ctx, run)
            run.check_ran_every_step(train)
        finally:
            run.stop_draws()
            if state["running"]:
                prof.stop()
    run.finish()
    return _recorded(prof, tracer, ctx, run.layout, [run.model] if isinstance(run.model, torch.nn.Module) else list(run.model),
                     run.optimizer, warmup=warmup, tokens=0, trace_dir=trace_dir)
