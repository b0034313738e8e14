"""Train a strategy on N simulated ranks in this process, record and trace it as a real run,
then compare with the reference and diagnose with the same engine.

Data flow, as on real ranks: case -> reference (cached) -> the strategy set up once for all
ranks -> per step, each rank's micro-batches (the strategy's ``local_batches`` called rank by
rank, stacked into LocalTensors) -> one SPMD forward/backward and optimizer step -> the record
(:class:`~harness.simulate.recorder.SimulatedRecorder`) and the trace
(:func:`~harness.simulate.trace.build_trace`) -> :func:`harness.run.compare_to_reference` ->
:func:`harness.pipeline.diagnosis_report` (:func:`harness.pipeline.diagnose_simulated` runs the whole).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from reference.case import Batch, Case, check_dataset
from reference.schedule import global_batch_indices

from harness.parallel_dims import ParallelConfigError
from harness.simulate.recorder import SimulatedRecorder
from harness.simulate.support import DDP_REASON, REAL_RANKS, check_setup
from harness.simulate.trace import CollectiveLog, MeshGroups, build_trace, collective_records
from harness.simulate.world import SimulatedWorld, SimulationError, rank_values

__all__ = ["SimulatedRanks", "SimulatedRun", "simulate_strategy"]


@dataclasses.dataclass(frozen=True)
class SimulatedRanks:
    """The context that asks :func:`harness.testing.assert_matches_reference` for a run on
    ``world_size`` simulated ranks (the ``sim_ranks`` fixture of ``@pytest.mark.simulate``)."""

    world_size: int


@dataclasses.dataclass
class SimulatedRun:
    """What a simulated run left: its record and trace files."""

    record_path: str
    trace_path: str
    world_size: int
    # The activation probe's captures split per rank (harness.record.probe.ProbeData): the
    # same evidence as real ranks collect (tp-partial-sum, rng-desync, where it departs).
    probe: Any = None


def _stack_batches(world: SimulatedWorld, per_rank: dict[int, list[Batch]]) -> list[Batch]:
    """Each rank's micro-batches as one list whose tensors hold every rank's data."""
    counts = {r: len(b) for r, b in per_rank.items()}
    if len(set(counts.values())) != 1:
        raise SimulationError(
            f"ranks read different numbers of micro-batches ({counts}); simulated ranks run one program, so "
            "every rank must run the same number of forward/backward passes"
        )
    out = []
    for i in range(counts[0]):
        first = per_rank[0][i]

        def stack(values: dict[int, Any]) -> Any:
            sample = values[0]
            if isinstance(sample, torch.Tensor):
                shapes = {r: tuple(v.shape) for r, v in values.items()}
                if len(set(shapes.values())) != 1:
                    raise SimulationError(f"ranks' micro-batch {i} tensors differ in shape ({shapes}); simulated ranks need equal shapes")
                return world.local(values)
            if isinstance(sample, dict):
                return {k: stack({r: v[k] for r, v in values.items()}) for k in sample}
            if isinstance(sample, (list, tuple)):
                return type(sample)(stack({r: v[j] for r, v in values.items()}) for j in range(len(sample)))
            return sample

        out.append(dataclasses.replace(
            first,
            inputs=stack({r: b[i].inputs for r, b in per_rank.items()}),
            targets=stack({r: b[i].targets for r, b in per_rank.items()}),
        ))
    return out


def simulate_strategy(
    case: Case,
    strategy: Any,
    world_size: int,
    workdir: str | os.PathLike[str],
    *,
    steps: int | None = None,
    progress: Callable[[str], None] | None = None,
    probe_step: int = 0,
) -> SimulatedRun:
    """Train ``strategy`` on ``world_size`` simulated ranks, writing the record and trace
    under ``workdir``, the activation probe on the first micro-batch of ``probe_step``.
    Raises :class:`SimulationError` for what cannot be simulated."""
    from harness.tracing.run_trace import TRACE_FILE
    from harness.tracing.mesh import describe_model

    say = progress or (lambda line: None)
    case = case.with_steps(steps)
    case.validate()
    check_dataset(case.dataset, sorted({i for s in range(case.steps) for i in global_batch_indices(case, s)}))
    from harness.record.probe import ProbedStrategy

    record_path = Path(workdir) / f"simulated-{strategy.name}-{case.name}-w{world_size}"
    strategy = ProbedStrategy(strategy, at_step=probe_step)
    log = CollectiveLog()
    with SimulatedWorld(world_size) as world:
        with log:
            try:
                setup = strategy.setup(case, world.ctx)
            except ParallelConfigError:
                raise
            except Exception as exc:
                failed = _setup_failed(strategy.name, exc)
                if failed is None:
                    raise  # the user's own error, shown as theirs
                raise failed from exc
            check_setup(strategy.name, setup)
            setup.start_lr_scheduler(case)
            dims = setup.state["dims"]
            dims.check_world(world_size)
            layouts = {r: dims.layout(r) for r in world.ranks}
            groups = MeshGroups(setup.state.get("mesh") or _param_mesh(setup.model), world_size)
            params, _, _ = describe_model(setup.model)
            recorder = SimulatedRecorder(record_path, case, setup.model, setup.optimizer, layouts, groups,
                                         source=f"strategy:{strategy.name} (simulated)")
            samples: dict[int, dict[int, list[list[int]]]] = {r: {} for r in world.ranks}
            case.seed_training()
            try:
                for step in range(case.steps):
                    log.step, log.phase = step, "train"
                    per_rank = world.per_rank(lambda r: strategy.local_batches(case, dataclasses.replace(setup, layout=layouts[r]), step))
                    for r, batches in per_rank.items():
                        samples[r][step] = [list(b.ids) for b in batches]
                    batches = _stack_batches(world, per_rank)
                    losses = strategy.forward_backward(case, setup, batches)
                    if len(losses) != len(batches):
                        raise SimulationError(f"strategy {strategy.name!r}: forward_backward returned {len(losses)} losses for "
                                              f"{len(batches)} micro-batches at step {step}")
                    for i, loss in enumerate(losses):
                        recorder.micro_batch(step, loss, {r: per_rank[r][i].ids for r in world.ranks})
                    if case.grad_clip is not None:
                        strategy.clip_gradients(case, setup)
                    log.phase = "harness"
                    recorder.grads(step)
                    log.phase = "train"
                    strategy.optimizer_step(case, setup)
                    setup.step_lr_scheduler()
                    log.phase = "harness"
                    recorder.after_step(step)
                    setup.optimizer.zero_grad(set_to_none=True)
                    say(f"step {step + 1}/{case.steps} trained on {world_size} simulated ranks")
            except BaseException:
                recorder.finish(complete=False)  # keep the steps recorded so far
                raise
        record = recorder.finish()
        probe = _probe_per_rank(strategy, layouts, world, probe_step)
    trace = build_trace(world_size, groups, layouts, params, samples, collective_records(log.calls, groups),
                        {"case": case.name, "strategy": strategy.name}, random_draws=log.random_draws)
    trace_path = str(trace.save(Path(record.path) / TRACE_FILE))
    return SimulatedRun(str(record.path), trace_path, world_size, probe)


def _probe_per_rank(probed: Any, layouts: dict[int, Any], world: SimulatedWorld, step: int = 0) -> Any:
    """The probe of one SPMD forward (each capture a LocalTensor holding every rank's value)
    as the per-rank captures real ranks would have collected."""
    from harness.record.probe import ProbeData, probe_entry

    ranks = []
    for r in world.ranks:
        entry = probe_entry(probed.probe, r, layouts[r], lambda v, r=r: rank_values(v, world.ranks)[r])
        # every rank's ids differ; a simulated strategy reads its batches through the harness
        entry.update(ids=None, expected_input=None)
        ranks.append(entry)
    return ProbeData(ranks, step=step)


def _setup_failed(name: str, exc: Exception) -> SimulationError | None:
    """A setup that raised under simulation. Raised inside PyTorch (DDP's parameter check, an
    op the simulated tensors do not support): a SimulationError saying where and what to run
    instead. Raised in the user's own code: None, the error is theirs and stays as it is."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if any(f.filename.endswith(os.path.join("nn", "parallel", "distributed.py")) for f in frames):
        return SimulationError(f"cannot simulate {name} (DistributedDataParallel): {DDP_REASON}; {REAL_RANKS}")
    last = frames[-1] if frames else None
    if last is None or os.sep + "torch" + os.sep not in last.filename:
        return None
    where = next((f for f in reversed(frames) if "site-packages" not in f.filename and "/torch/" not in f.filename), None)
    at = f" at {last.filename}:{last.lineno} in {last.name}" if last else ""
    called = f" (called from {where.filename}:{where.lineno})" if where and where is not last else ""
    return SimulationError(
        f"setting up {name} on simulated ranks failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        f"{at}{called}. If it sets up on real ranks, it uses something simulated ranks do not support; {REAL_RANKS}"
    )


def _param_mesh(model: Any) -> Any:
    return next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
