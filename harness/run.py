"""Glue: train a strategy on every rank, then compare its record with the cached reference.

``run_strategy(case, DDPStrategy(), dist_ctx)`` is collective and returns the same
:class:`RunResult` on every rank, so a test is ``assert result.passed, result.summary()``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reference.cache import cached_reference
from reference.case import Case, check_dataset
from reference.record import Record
from reference.replay import replay_reference
from reference.trainer import ReferenceVariant
from reference.schedule import global_batch_indices

from harness.context import broadcast_object
from harness.settings import COMPARISON_MODES, TOLERANCE_MODES
from harness.analysis.failed_run import note_finished
from harness.analysis.compare import CompareResult, compare, proposed_renaming, trajectory_view
from harness.record.checkpoint import CheckpointPlan, load_checkpoint, save_checkpoint
from harness.record.recorder import RankRecorder
from harness.strategy import DistContextLike, Strategy
from harness.analysis.tolerance import DefaultTolerances, TolerancePolicy, calibrate
from harness.tracing import Tracer
from harness.tracing.run_trace import TRACE_FILE

__all__ = [
    "COMPARISON_MODES",
    "RunError",
    "RunResult",
    "compare_to_reference",
    "replay_path",
    "resolve_tolerance",
    "run_strategy",
    "train_strategy",
]



class RunError(RuntimeError):
    """The strategy could not be trained or compared (the message says why)."""


@dataclass
class RunResult:
    case: str
    strategy: str
    world_size: int
    comparison: CompareResult
    reference_path: str
    record_path: str
    trace_path: str = ""  # <record_path>/trace.json: every rank's collectives, groups, samples

    @property
    def passed(self) -> bool:
        return self.comparison.passed

    def summary(self) -> str:
        trace = f"\n  trace:            {self.trace_path}" if self.trace_path else ""
        return (
            f"{self.comparison.summary()}\n  reference record: {self.reference_path}\n"
            f"  parallel record:  {self.record_path}{trace}"
        )


def trace_parts_dir(record_path: str | os.PathLike[str]) -> Path:
    """Where ranks of a failed run write their own trace (``rank<N>.json``), beside the record."""
    path = Path(record_path)
    return path.with_name(path.name + ".trace")


def train_strategy(
    case: Case,
    strategy: Strategy,
    ctx: DistContextLike,
    record_path: str | os.PathLike[str] | None,
    *,
    dst: int = 0,
    check_replicas: bool = True,
    trace: bool = True,
    digests: bool = False,
    checkpoint: CheckpointPlan | None = None,
) -> Record | None:
    """Collective: train ``case`` with ``strategy`` on every rank, recording each step.
    Returns the record on ``dst`` (which needs ``record_path``), None elsewhere.

    ``checkpoint`` (:class:`~harness.record.checkpoint.CheckpointPlan`): save a checkpoint after
    step ``at - 1``, or resume from one: load it right after setup (the RNG comes from it, not
    from the case seed), record the loaded state as step ``at - 1`` and train ``at`` .. end.

    With ``trace`` (default) every rank's collectives, groups, parameter shapes and samples
    are traced (:mod:`harness.tracing`) and written to ``<record>/trace.json``; when training
    fails, each rank that knows ``record_path`` writes its own part to
    ``<record_path>.trace/rank<N>.json`` instead (``RunTrace.load`` reads either)."""
    case.validate()
    case.check_model_factory()
    check_dataset(case.dataset, sorted({i for s in range(case.steps) for i in global_batch_indices(case, s)}))
    tracer = Tracer(name=f"{strategy.name}-{case.name}") if trace else None
    setup = strategy.setup(case, ctx)
    setup.start_lr_scheduler(case)
    if tracer is not None:
        tracer.describe(layout=setup.layout, model=setup.model, state=setup.state)
        tracer.set_phase("harness")
    if checkpoint is not None and not 0 < checkpoint.at < case.steps:
        raise RunError(f"a checkpoint at step {checkpoint.at} of a {case.steps}-step run: allowed 1..{case.steps - 1} "
                       "(saved after step at-1, the run goes on from step at)")
    loaded = None
    if checkpoint is not None and checkpoint.resume:
        loaded = load_checkpoint(checkpoint.path, case, strategy, setup)
    recorder = RankRecorder(
        record_path if ctx.rank == dst else None, case, setup.model, setup.optimizer, setup.layout,
        source=f"strategy:{strategy.name}", dst=dst, check_replicas=check_replicas, overwrite=True, digests=digests,
        meta={"checkpoint": checkpoint.to_json()} if checkpoint is not None else None,
    )
    start = 0
    if loaded is not None:
        assert checkpoint is not None
        start = checkpoint.at
        recorder.resumed(Record.load(checkpoint.saved_record) if ctx.rank == dst and checkpoint.saved_record else None,
                         start, loaded)
    else:
        case.seed_training()
    try:
        # Active while training, so a hang dump can tell the harness's own collectives apart.
        with tracer if tracer is not None else contextlib.nullcontext():
            for step in range(start, case.steps):
                _train_step(case, strategy, setup, recorder, tracer, step)
                if checkpoint is not None and not checkpoint.resume and step + 1 == checkpoint.at:
                    with tracer.phase("harness") if tracer is not None else contextlib.nullcontext():
                        save_checkpoint(checkpoint.path, case, strategy, setup, at=checkpoint.at)
    except BaseException:
        recorder.finish(complete=False)  # keep what was recorded
        if tracer is not None and record_path is not None:
            try:  # the ranks may no longer be in step: each writes its own part
                tracer.save_part(trace_parts_dir(record_path))
            except Exception:  # noqa: BLE001 - the training error is what the user must see
                pass
        raise
    record = recorder.finish()
    if tracer is not None:
        run_trace = tracer.gather(dst, meta={"case": case.name, "strategy": strategy.name})
        if run_trace is not None and record is not None:
            run_trace.save(Path(record.path) / TRACE_FILE)
    return record


def check_comparison_mode(comparison: str) -> str:
    if comparison not in COMPARISON_MODES:
        raise RunError(f"unknown comparison mode {comparison!r}; allowed: {', '.join(COMPARISON_MODES)}")
    return comparison


def _train_step(case: Case, strategy: Strategy, setup: Any, recorder: RankRecorder, tracer: Tracer | None, step: int) -> None:
    """One recorded step of ``strategy``: its batches, forward/backward, the gradients, the
    optimizer step, then parameters and optimizer state (the harness's parts traced as such)."""

    def harness_phase() -> Any:
        return tracer.phase("harness") if tracer is not None else contextlib.nullcontext()

    if tracer is not None:
        tracer.begin_step(step)
        tracer.set_phase("train")
    batches = strategy.local_batches(case, setup, step)
    if tracer is not None and step == 0:
        tracer.log_random_ops(True)  # the first step's random draws, for the rng-desync check
    recorder.start_draws()  # every step's draws, for the reference to replay (inside the tracer's log)
    try:
        losses = strategy.forward_backward(case, setup, batches)
    finally:
        recorder.stop_draws()
        if tracer is not None:
            tracer.log_random_ops(False)
    if len(losses) != len(batches):
        raise RunError(
            f"strategy {strategy.name!r}: forward_backward returned {len(losses)} losses "
            f"for {len(batches)} micro-batches at step {step}"
        )
    for batch, loss in zip(batches, losses):
        recorder.micro_batch(step, loss, batch.ids, case.normaliser(batch))
        if tracer is not None:
            tracer.record_samples(step, batch.ids)
    if case.grad_clip is not None:
        clip = getattr(strategy, "clip_gradients", None)
        if clip is None:
            raise RunError(f"strategy {strategy.name!r} has no clip_gradients(case, setup), but case "
                           f"{case.name!r} sets grad_clip={case.grad_clip}")
        clip(case, setup)
    with harness_phase():
        recorder.grads(step)
    strategy.optimizer_step(case, setup)
    setup.step_lr_scheduler()
    with harness_phase():
        recorder.after_step(step)
    setup.optimizer.zero_grad(set_to_none=True)


def resolve_tolerance(
    tolerance: str | TolerancePolicy,
    case: Case,
    reference: Record,
    *,
    cache: str | os.PathLike[str] | None = None,
    stepwise: bool = True,
) -> TolerancePolicy:
    """``"auto"``: calibrated from the reference's own one-step noise for every dtype in the
    stepwise comparison; in the trajectory comparison calibrated for 16-bit dtypes and per-dtype
    defaults otherwise (its compounded noise is only measured where it is large)."""
    if not isinstance(tolerance, str):
        return tolerance
    if tolerance not in TOLERANCE_MODES:
        raise RunError(f"unknown tolerance mode {tolerance!r}; allowed: {', '.join(TOLERANCE_MODES)} or a TolerancePolicy")
    if tolerance == "default":
        return DefaultTolerances()
    if tolerance == "calibrated" or stepwise or case.dtype in (torch.bfloat16, torch.float16):
        return calibrate(case, reference, cache=cache, stepwise=stepwise)
    return DefaultTolerances()


def replay_path(record_path: str | os.PathLike[str]) -> Path:
    """Where the stepwise reference of a parallel record is written: beside it."""
    path = Path(record_path)
    return path.with_name(path.name + ".replay")


def compare_to_reference(
    case: Case,
    record: Record,
    *,
    tolerance: str | TolerancePolicy = "auto",
    cache: str | os.PathLike[str] | None = None,
    label: str | None = None,
    comparison: str = "stepwise",
) -> CompareResult:
    """Local: compare a parallel run's ``record`` of ``case`` with the reference. For custom
    training loops that recorded with :class:`RankRecorder` themselves.

    ``comparison="stepwise"`` (default): every step is checked from the parallel run's own
    state (:mod:`reference.replay`: loss and gradients from its parameters, the update from its
    parameters, optimizer state and gradients), so rounding noise never compounds; the whole
    trajectory against the cached reference is kept as a secondary view
    (``CompareResult.trajectory``), outside the verdict. ``"trajectory"``: the parallel
    trajectory against the reference's, step by step, as the verdict."""
    check_comparison_mode(comparison)
    reference = cached_reference(case, cache=cache)
    notes: list[str] = []
    clock = _PhaseClock()

    def policy_for(stepwise: bool) -> TolerancePolicy:
        try:
            return resolve_tolerance(tolerance, case, reference, cache=cache, stepwise=stepwise)
        except RunError:
            raise
        except Exception as exc:  # noqa: BLE001 - the harness's own replay: never the user's error
            notes.append(f"harness: the calibration replays failed ({type(exc).__name__}: {str(exc)[:300]}); "
                         "the per-dtype default tolerances were used instead")
            return DefaultTolerances()

    if comparison == "trajectory":
        with clock("calibration_s"):
            policy = policy_for(False)
        with clock("comparison_s"):
            result = compare(reference, record, policy, label=label)
        result.notes += notes
        _read_reported_loss(result, record, reference, case)
        result.timing = clock.seconds
        return result
    with clock("calibration_s"):
        policy = policy_for(True)
    replicas = dp_size(record)
    # The replay starts each step from the run's state by name: under the reference's names
    # where the run's differ by a renaming the shapes propose (the comparison reports the names).
    renaming = proposed_renaming(reference, record)
    source = record.renamed(renaming) if renaming else record
    if case.per_replica and replicas > 1:
        # The case says these statistics are per replica on purpose: that reference is the contract.
        with clock("replay_s"):
            stepwise = replay_reference(case, source, replay_path(record.path), variant=ReferenceVariant(replicas=replicas))
        with clock("comparison_s"):
            result = compare(stepwise, record, policy, label=label)
        result.per_replica = {"contract": True, "replicas": replicas, "declared": list(case.per_replica)}
        notes.append(f"compared with the per-replica reference: each of the {replicas} replicas' micro-batches computed on "
                     f"their own (the case declares per-replica statistics: {', '.join(case.per_replica)})")
    else:
        with clock("replay_s"):
            stepwise = replay_reference(case, source, replay_path(record.path))
        with clock("comparison_s"):
            result = compare(stepwise, record, policy, label=label)
        _read_reported_loss(result, record, stepwise, case)
        if result.failures() and replicas > 1:  # values that need explaining, not names alone
            with clock("per_replica_s"):
                result.per_replica = _per_replica_view(case, source, stepwise, policy, replicas)
    result.notes += notes
    result.mode = "stepwise"
    # The same tolerances as the verdict's: the view says where the trajectory leaves one
    # step's noise, which a correct run may well do.
    with clock("trajectory_view_s"):
        result.trajectory = trajectory_view(compare(reference, record, policy))
    result.timing = clock.seconds
    return result


def _read_reported_loss(result: CompareResult, record: Record, reference: Record, case: Case) -> None:
    """Where only the reported loss departs: the readings of the loop's numbers, said in a
    note, and the training's verdict (:mod:`harness.analysis.loss_reading`)."""
    from harness.analysis.loss_reading import read_reported_loss

    reading = read_reported_loss(result, record, reference, case)
    if reading is not None:
        result.reported_loss = reading.to_dict()
        result.notes.append(reading.sentence())


class _PhaseClock:
    """Seconds per named phase, summed over its ``with clock(name):`` blocks."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Any:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


def dp_size(record: Record) -> int:
    """The data-parallel size a parallel record's ranks declared (1 without layouts)."""
    return max((int(r.get("dp_size", 1)) for r in record.meta.get("ranks", [])), default=1)


def _per_replica_view(case: Case, record: Record, one_device: Record, policy: TolerancePolicy, replicas: int) -> dict[str, Any]:
    """Whether a run that failed against the one-device reference matches the per-replica one
    (the program computes a batch statistic per replica), and how far the two references are
    apart; evidence for ``per-replica-statistic``."""
    from harness.analysis.tolerance import grad_distance

    path = Path(str(replay_path(record.path)) + "-per-replica")
    per = replay_reference(case, record, path, variant=ReferenceVariant(replicas=replicas))
    compared = compare(per, record, policy)
    div = compared.first_divergence
    return {
        "contract": False, "replicas": replicas, "reference": str(per.path), "passed": compared.passed,
        "first_divergence": {"step": div.step, "entries": [list(e) for e in div.entries[:10]]} if div else None,
        "references_differ_by": grad_distance(one_device, per),
    }


def run_strategy(
    case: Case,
    strategy: Strategy,
    ctx: DistContextLike,
    *,
    tolerance: str | TolerancePolicy = "auto",
    workdir: str | os.PathLike[str] | None = None,
    cache: str | os.PathLike[str] | None = None,
    steps: int | None = None,
    dst: int = 0,
    trace: bool = True,
    comparison: str = "stepwise",
    digests: bool = False,
    checkpoint: CheckpointPlan | None = None,
) -> RunResult:
    """Collective: train ``strategy`` on every rank, train (or load) the reference on ``dst``,
    compare them there (``comparison``: see :func:`compare_to_reference`), and return the
    result on every rank.

    ``workdir`` receives the parallel record (default: a new temporary directory); ``cache``
    holds reference records (default ``$HARNESS_CACHE_DIR`` or ``./.harness_cache``);
    ``trace`` writes every rank's trace beside the record (``RunResult.trace_path``);
    ``digests`` records each rank's local state bitwise (the determinism gate's evidence);
    ``checkpoint`` saves or resumes from a checkpoint (:func:`train_strategy`)."""
    case = case.with_steps(steps)
    check_comparison_mode(comparison)
    if not isinstance(strategy, Strategy):
        missing = [m for m in ("name", "setup", "local_batches", "forward_backward", "optimizer_step") if not hasattr(strategy, m)]
        raise RunError(
            f"{strategy!r} is not a harness.strategy.Strategy: it lacks {', '.join(missing)} "
            "(subclass harness.strategy.StrategyBase and implement setup and forward_backward)"
        )
    record_path = None
    if ctx.rank == dst or workdir is not None:  # every rank that knows it can save its trace part
        base = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="harness-run-"))
        record_path = base / f"{strategy.name}-{case.name}-w{ctx.world_size}"
    record = train_strategy(case, strategy, ctx, record_path, dst=dst, trace=trace, digests=digests, checkpoint=checkpoint)
    payload: tuple[str, object] = ("ok", None)
    error: BaseException | None = None
    if ctx.rank == dst:
        assert record is not None
        try:
            label = f"{strategy.name} on {ctx.world_size} ranks vs reference, case {case.name!r}"
            compared = compare_to_reference(
                case, record, tolerance=tolerance, cache=cache, label=label, comparison=comparison
            )
            trace_file = Path(record.path) / TRACE_FILE
            note_finished(case=case, strategy=strategy.name, nproc=ctx.world_size, record=str(record.path), comparison=compared)
            payload = ("ok", RunResult(
                case.name, strategy.name, ctx.world_size, compared, compared.reference, str(record.path),
                trace_path=str(trace_file) if trace_file.is_file() else "",
            ))
        except Exception as exc:  # every rank must learn of it, not only dst
            error = exc
            payload = ("error", f"{type(exc).__name__}: {exc}")
    status, value = broadcast_object(payload, dst)  # type: ignore[misc]
    if error is not None:
        raise error
    if status == "error":
        raise RunError(f"rank {dst} could not compare {strategy.name!r} with the reference: {value}")
    assert isinstance(value, RunResult)
    return value
