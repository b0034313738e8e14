"""Run a target on N ranks and diagnose it: the engine behind ``python -m harness diagnose``.

The launching process resolves the target, starts (or reuses) warm ranks through
:class:`~harness.launch.remote.RankRunner` and waits; every rank trains the strategy (or the custom
loop) with recording, tracing and the activation probe on; the destination rank compares with
the reference, runs the diagnosis engine and returns a :class:`~harness.report.DiagnosisReport`.
A hang comes back as the launcher's timeout dumps and is diagnosed from the collective traces.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.codes import Diagnosis
from harness.launch.remote import RankRunner, RanksFailed, RanksHung
from harness.record.left_behind import left_behind, recorded_lines
from harness.launch.failure_text import own_exception
from harness.report.model import DiagnosisReport, build_report
from harness.targets.bundled import load_target
from harness.targets.target import Target

__all__ = ["diagnose_on_rank", "diagnose_target"]


class _ProgressStrategy:
    """Delegates to a strategy; appends "step k/K" to a file after each optimizer step so the
    launching process can show progress while the ranks run."""

    def __init__(self, inner: Any, path: str | None, steps: int):
        self.inner = inner
        self.name = inner.name
        self.path = path
        self.steps = steps
        self.done = 0

    def setup(self, case: Any, ctx: Any) -> Any:
        return self.inner.setup(case, ctx)

    def local_batches(self, case: Any, setup: Any, step: int) -> Any:
        return self.inner.local_batches(case, setup, step)

    def forward_backward(self, case: Any, setup: Any, micro_batches: Any) -> Any:
        return self.inner.forward_backward(case, setup, micro_batches)

    def optimizer_step(self, case: Any, setup: Any) -> None:
        self.inner.optimizer_step(case, setup)
        self.done += 1
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(f"step {self.done}/{self.steps} trained\n")
                if self.done == self.steps:  # run_and_diagnose compares and diagnoses next
                    fh.write("diagnose: comparing and naming causes\n")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _progress(path: str | None, message: str) -> None:
    if path:
        with open(path, "a") as fh:
            fh.write(message + "\n")


def diagnose_on_rank(
    ctx: Any,
    target_spec: str,
    steps: int | None,
    workdir: str,
    cache: str | None,
    progress_path: str | None = None,
    dst: int = 0,
    tolerance: str = "auto",
    comparison: str = "stepwise",
) -> DiagnosisReport | None:
    """Rank body (collective): train the target, compare and diagnose on ``dst``; returns the
    report there and None on the other ranks. ``tolerance`` / ``comparison``: see
    :func:`harness.run.compare_to_reference`."""
    import torch
    import torch.distributed as dist

    from reference.cache import cached_reference

    from harness.record.custom import CustomRun
    from harness.analysis.diagnosed_run import diagnosis_report, run_and_diagnose
    from harness.record.probe import collect_probe
    from harness.run import compare_to_reference, trace_parts_dir

    started = time.monotonic()
    target = load_target(target_spec)
    case = target.case if steps is None else target.case.replace(steps=steps)
    is_dst = ctx.rank == dst
    if is_dst:
        _progress(progress_path, f"reference: training {case.name!r} on one device ({case.steps} steps)")
        cached_reference(case, cache=cache)  # before the ranks start, so its time shows as its own phase
        _progress(progress_path, f"ranks: training {target.strategy.name if target.strategy else 'custom loop'} on {ctx.world_size} ranks")
    dist.barrier()
    if target.strategy is not None:
        progress = _ProgressStrategy(target.strategy, progress_path if is_dst else None, case.steps)
        run = run_and_diagnose(case, progress, ctx, target=target, workdir=workdir, cache=cache, dst=dst,
                               tolerance=tolerance, comparison=comparison)
        return run.report
    assert target.train is not None
    record_dir = Path(workdir) / f"custom-{case.name}-w{ctx.world_size}"
    from harness.tracing.run_trace import TRACE_FILE
    from harness.tracing.tracer import Tracer

    tracer = Tracer(name=f"custom-{case.name}")
    run = CustomRun(case, ctx, record_dir if is_dst else None, dst=dst, tracer=tracer)
    torch.manual_seed(case.seed)  # the training RNG starts where the reference's does
    try:
        # Active while the loop runs, so a hang dump can tell the harness's collectives apart.
        with tracer:
            try:
                target.train(ctx, run)
                run.check_ran_every_step(target.train)
            finally:
                run.stop_draws()  # before the tracer's own log: dispatch modes are a stack
    except BaseException:
        if run.recorder is not None:
            run.finish(complete=False)
        try:  # the ranks may no longer be in step: each writes its own trace part
            tracer.save_part(trace_parts_dir(record_dir))
        except Exception:  # noqa: BLE001 - the loop's own error is what the user must see
            pass
        raise
    record = run.finish()
    run_trace = tracer.gather(dst, meta={"case": case.name, "strategy": "custom"})
    probe = collect_probe(run, dst) if run.probe is not None else None  # collective
    if not is_dst:
        return None
    assert record is not None
    _progress(progress_path, "diagnose: comparing and naming causes")
    compared = compare_to_reference(case, record, cache=cache, label=f"{target.name} on {ctx.world_size} ranks vs reference",
                                    tolerance=tolerance, comparison=comparison)
    trace_path = str(run_trace.save(Path(record.path) / TRACE_FILE)) if run_trace is not None else None
    return diagnosis_report(
        target, case, ctx.world_size, comparison=compared, record_path=str(record.path), trace_path=trace_path,
        cache=cache, probe=probe, elapsed_s=time.monotonic() - started,
    )


def _tail(path: str, stop: threading.Event, echo: Callable[[str], None]) -> None:
    """Echo the progress file's new lines every 0.2 s until ``stop``, then once more: the
    ranks' last lines (the final step) are written just before they return."""
    pos = 0
    while True:
        stopping = stop.is_set()
        try:
            with open(path) as fh:
                fh.seek(pos)
                chunk = fh.read()
                pos = fh.tell()
        except FileNotFoundError:
            chunk = ""
        for line in chunk.splitlines():
            echo(f"  {line}")
        if stopping:
            return
        stop.wait(0.2)


def diagnose_target(
    target: str,
    *,
    nproc: int | None = None,
    steps: int | None = None,
    runner: RankRunner | None = None,
    timeout: float | None = None,
    workdir: str | os.PathLike[str] | None = None,
    cache: str | os.PathLike[str] | None = None,
    echo: Callable[[str], None] | None = None,
    tolerance: str = "auto",
    comparison: str = "stepwise",
    stall_window: float | None = None,
) -> DiagnosisReport:
    """Diagnose ``target`` (see :mod:`harness.targets.target`) on ``nproc`` ranks (default: the
    target's NPROC, else 2) and return the report. ``timeout`` defaults to the target's
    TIMEOUT, else 300 s; ``stall_window`` to the target's STALL_WINDOW, else the runner's
    (see :meth:`~harness.launch.remote.RankRunner.run`). ``echo`` receives progress lines. ``tolerance`` and ``comparison``
    as :func:`harness.run.compare_to_reference` takes them."""
    say = echo or (lambda line: None)
    resolved: Target = load_target(target)  # fail fast, in this process, on a bad target
    if resolved.layout is not None:
        from harness.targets.target import TargetError

        raise TargetError(f"{resolved.name} is a layout check on simulated ranks, not a run on real ones: "
                          f"python -m harness diagnose {resolved.name} (or harness.simulate.layout.check_layout)")
    world = nproc or resolved.nproc or 2
    work = str(workdir) if workdir is not None else tempfile.mkdtemp(prefix="harness-diagnose-")
    os.makedirs(work, exist_ok=True)
    progress_path = os.path.join(work, f"progress-{os.getpid()}-{time.monotonic_ns()}.log")
    say(f"target {resolved.name}: case {resolved.case.name!r}, {world} ranks, {steps or resolved.case.steps} steps")
    own = runner is None
    runner = runner or RankRunner()
    stop = threading.Event()
    tail = threading.Thread(target=_tail, args=(progress_path, stop, say), daemon=True)
    tail.start()
    started = time.monotonic()
    try:
        result = runner.run(
            diagnose_on_rank, nproc=world, timeout=timeout or resolved.timeout or 300.0,
            stall_window=stall_window if stall_window is not None else resolved.stall_window,
            kwargs={"target_spec": target, "steps": steps, "workdir": work, "tolerance": tolerance, "comparison": comparison,
                    "cache": str(cache) if cache is not None else None, "progress_path": progress_path},
        )
        report = result.values.get(0)
        if not isinstance(report, DiagnosisReport):
            raise RanksFailed(f"rank 0 returned {type(report).__name__}, not a report", result.outcome)  # type: ignore[arg-type]
    except KeyboardInterrupt as exc:
        # Ctrl-C / SIGTERM: the ranks are gone (the pool killed them); what they recorded stays.
        exc.left_behind = recorded_lines(left_behind(work)[2]) or f"\n\nnothing recorded yet (run folder {work})"  # type: ignore[attr-defined]
        raise
    except RanksHung as exc:
        report = _hang_report(resolved, world, steps, exc, work)
    except RanksFailed as exc:
        case = resolved.case if steps is None else resolved.case.replace(steps=steps)
        record, trace, recorded = left_behind(work, exc.outcome)
        raised = own_exception(exc.outcome)
        # A rank's own exception (the user's code, or a check of the case) is the cause: the
        # others waiting in a collective are its consequence, not a missing collective.
        diagnoses = [] if raised else failure_diagnoses(exc.outcome)
        error = f"{raised}\n\n{exc.report}" if raised else exc.report
        report = build_report(target=resolved, case=case, nproc=world, diagnoses=diagnoses, actual=record, trace=trace,
                              error=error + recorded_lines(recorded), elapsed_s=time.monotonic() - started, recorded=recorded)
    finally:
        stop.set()
        tail.join(timeout=1)
        if own:
            runner.close()
    report.workdir = work
    return report


def failure_diagnoses(outcome: Any) -> list[Diagnosis]:
    """A rank died or raised. Only when the first failure is the backend's (gloo ends a rank on
    a size mismatch; a collective times out) is the cause a collective bug: named from the
    ranks' collectives (the dead rank's journal included), else from the backend's own
    mismatch message. A rank killed by a signal or raising its own error is the cause itself,
    reported as such, with no code."""
    from harness.launch.failure_text import BACKEND_MISMATCH, backend_failure

    failure = backend_failure(outcome)
    if failure is None:
        return []
    found = hang_diagnoses(outcome)
    rank, line = failure
    if found or not any(m in line for m in BACKEND_MISMATCH):
        return found
    return [Diagnosis(
        "collective-mismatch",
        f"rank {rank} aborted in the backend on a collective whose size differs between ranks: {line[-200:]}",
        {"rank": rank, "backend_message": line[-500:], "death": getattr(outcome, "deaths", {}).get(rank, ""),
         "likely_source": "ranks issued collectives in different orders or with different shapes at the same position"},
    )]


def hang_diagnoses(outcome: Any) -> list[Diagnosis]:
    from harness.tracing.hang import diagnose_hang

    try:
        found = list(diagnose_hang(outcome))
    except Exception as err:  # noqa: BLE001 - the report itself must still come out
        print(f"harness: hang diagnosis failed: {type(err).__name__}: {err}", file=sys.stderr)
        return []
    # One finding per code: later ones are consequences of the first (the rank that never
    # came is blocked elsewhere); keep them as related evidence.
    out: list[Diagnosis] = []
    for d in found:
        first = next((o for o in out if o.code == d.code), None)
        if first is None:
            out.append(d)
        else:
            first.evidence.setdefault("related", []).append(d.summary)
    return out


def _hang_report(target: Target, world: int, steps: int | None, exc: RanksHung, work: str) -> DiagnosisReport:
    case = target.case if steps is None else target.case.replace(steps=steps)
    record, trace, recorded = left_behind(work, exc.outcome)
    return build_report(target=target, case=case, nproc=world, diagnoses=hang_diagnoses(exc.outcome), hang=True,
                        actual=record, trace=trace, error=exc.report + recorded_lines(recorded), recorded=recorded)
