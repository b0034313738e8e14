"""One diagnosed run: reference -> train -> compare -> diagnose -> report, for every front end.

What trains is a :class:`~harness.targets.target.Target`'s strategy or its custom loop
(``train(ctx, run)``); where it trains is an argument: real ranks started here
(:func:`diagnose_target`, the engine of ``python -m harness diagnose``), ranks that already run
(:func:`diagnose_on_ranks`, collective: pytest's :func:`~harness.testing.assert_matches_reference`
on the plugin's ranks or under torchrun) or simulated ranks in this process
(:func:`diagnose_simulated`). The steps override and the training seed are applied here once;
a run that fails or hangs on real ranks is reported through
:func:`harness.analysis.failed_run.failure_report`, the path pytest uses too.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference.case import Case

from harness import settings
from harness.codes import Diagnosis
from harness.context import broadcast_object
from harness.launch.remote import RankRunner, RanksFailed, RanksHung
from harness.report.model import DiagnosisReport
from harness.run import RunResult
from harness.strategy import DistContextLike
from harness.targets.target import Target, TargetError

__all__ = [
    "DiagnosedRun",
    "diagnose_on_ranks",
    "diagnose_simulated",
    "diagnose_target",
    "diagnosis_report",
    "run_and_diagnose",
    "simulate_target",
]


@dataclass
class DiagnosedRun:
    """What :func:`diagnose_on_ranks` returns on every rank. ``result`` is None when the run
    could not be compared (a pipeline split that lost a layer: ``findings`` names it);
    ``report`` is set on ``dst`` only, and there only when asked for or the run failed."""

    result: RunResult | None
    report: DiagnosisReport | None = None
    findings: list[Diagnosis] = field(default_factory=list)
    error: str = ""
    # A resumed run (a CheckpointPlan with resume=True): the load gate and the continuation
    # (harness.analysis.resume.ResumeCheck), on dst; it is then the verdict.
    resume: Any = None

    @property
    def passed(self) -> bool:
        if self.resume is not None:
            return self.resume.passed and not self.findings
        return self.result is not None and self.result.passed and not self.findings


# -- the stages every run goes through --------------------------------------------------------
def diagnosis_report(
    target: Target,
    case: Case,
    nproc: int,
    *,
    comparison: Any,
    record_path: str | None,
    trace_path: str | None,
    cache: str | os.PathLike[str] | None,
    findings: list[Diagnosis] | None = None,
    probe: Any = None,
    error: str = "",
    elapsed_s: float | None = None,
) -> DiagnosisReport:
    """On the comparing rank (or the simulating process): load the records and trace a run
    left, run the diagnosis engine over them (``findings`` are causes already known, e.g. lost
    pipeline stages) and build the report."""
    from reference.cache import cached_reference
    from reference.record import Record

    from harness.analysis.diagnose import diagnose
    from harness.report.model import build_report
    from harness.tracing.run_trace import load_trace

    # A stepwise comparison's reference is the same-start replay of this run; the engine reads
    # the tensors the comparison was made against.
    trajectory = cached_reference(case, cache=cache)
    stepwise = Record.load(comparison.reference) if getattr(comparison, "mode", "") == "stepwise" else None
    actual = Record.load(record_path) if record_path else None
    trace = load_trace(trace_path)
    found = list(findings or [])
    if comparison is not None and actual is not None:
        found = diagnose(comparison, stepwise or trajectory, actual, trace=trace, findings=found, probe=probe, case=case)
    return build_report(
        target=target, case=case, nproc=nproc, comparison=comparison, reference=trajectory, actual=actual,
        stepwise=stepwise, trace=trace, diagnoses=found, error=error if not found else "", elapsed_s=elapsed_s,
    )


def _train_strategy(target: Target, case: Case, strategy: Any, ctx: DistContextLike, dst: int, run_options: dict[str, Any],
                    out: DiagnosedRun) -> tuple[str | None, str | None, Any]:
    """Collective: train and compare ``strategy`` with the activation probe on (filling
    ``out.result`` on every rank); (record path, trace path, probe) for the report."""
    from harness.analysis.diagnose import stage_coverage_diagnosis
    from harness.record.gather import StageCoverageError
    from harness.record.probe import ProbedStrategy, collect_probe
    from harness.run import run_strategy

    probed = ProbedStrategy(strategy)
    try:
        out.result = run_strategy(case, probed, ctx, dst=dst, **run_options)
    except StageCoverageError as exc:  # raised on every rank alike (the check is collective)
        out.findings.append(stage_coverage_diagnosis(exc))
        out.error = str(exc)
    probe = collect_probe(probed, dst)  # collective: every rank takes part, even after a failure
    result = out.result
    if result is None:
        return None, None, probe
    return result.record_path, result.trace_path or None, probe


def _train_custom(target: Target, case: Case, ctx: DistContextLike, dst: int, run_options: dict[str, Any],
                  out: DiagnosedRun) -> tuple[str | None, str | None, Any]:
    """Collective: run the target's own loop ``train(ctx, run)`` with a
    :class:`~harness.record.custom.CustomRun` recording and tracing it, then compare on
    ``dst`` (``out.result`` on every rank); (record path, trace path, probe) for the report."""
    from harness.analysis.failed_run import note_finished
    from harness.context import DefaultGroupKept
    from harness.record.custom import CustomRun
    from harness.record.probe import collect_probe
    from harness.run import compare_to_reference, trace_parts_dir
    from harness.tracing.run_trace import TRACE_FILE
    from harness.tracing.tracer import Tracer

    assert target.train is not None
    is_dst = ctx.rank == dst
    workdir = run_options.get("workdir")
    base = Path(workdir) if workdir is not None else (Path(tempfile.mkdtemp(prefix="harness-run-")) if is_dst else None)
    record_dir = base / f"custom-{case.name}-w{ctx.world_size}" if base is not None else None
    tracer = Tracer(name=f"custom-{case.name}")
    run = CustomRun(case, ctx, record_dir if is_dst else None, dst=dst, tracer=tracer, digests=run_options.get("digests", False),
                    checkpoint=run_options.get("checkpoint"), checkpoint_glue=target.checkpoint_glue)
    case.seed_training()
    group = DefaultGroupKept()
    try:
        # Active while the loop runs, so a hang dump can tell the harness's collectives apart.
        with tracer:
            try:
                with group:  # a loop may destroy the default group at its end; the harness's work needs one
                    target.train(ctx, run)
                run.check_ran_every_step(target.train)
            finally:
                run.stop_draws()  # before the tracer's own log: dispatch modes are a stack
    except BaseException:
        if run.recorder is not None:
            run.finish(complete=False)
        if record_dir is not None:
            try:  # the ranks may no longer be in step: each writes its own trace part
                tracer.save_part(trace_parts_dir(record_dir))
            except Exception:  # noqa: BLE001 - the loop's own error is what the user must see
                pass
        raise
    record = run.finish()
    run_trace = tracer.gather(dst, meta={"case": case.name, "strategy": "custom"})
    probe = collect_probe(run, dst) if run.probe is not None else None  # collective
    payload: tuple[str, Any] = ("ok", None)
    error: BaseException | None = None
    if is_dst:
        assert record is not None
        try:
            compared = compare_to_reference(case, record, cache=run_options.get("cache"),
                                            label=f"{target.name} on {ctx.world_size} ranks vs reference",
                                            tolerance=run_options.get("tolerance", "auto"),
                                            comparison=run_options.get("comparison", "stepwise"))
            trace_path = str(run_trace.save(Path(record.path) / TRACE_FILE)) if run_trace is not None else ""
            if group.note:
                compared.notes.append(group.note)
            note_finished(case=case, strategy="custom", nproc=ctx.world_size, record=str(record.path), comparison=compared)
            payload = ("ok", RunResult(case.name, "custom", ctx.world_size, compared, compared.reference, str(record.path),
                                       trace_path=trace_path))
        except Exception as exc:  # every rank must learn of it, not only dst
            error, payload = exc, ("error", f"{type(exc).__name__}: {exc}")
    status, value = broadcast_object(payload, dst)  # type: ignore[misc]
    if error is not None:
        raise error
    if status == "error":
        from harness.run import RunError

        raise RunError(f"rank {dst} could not compare {target.name!r} with the reference: {value}")
    out.result = value
    return value.record_path, value.trace_path or None, probe


def _failing_step_to_probe(comparison: Any, probe: Any, record_path: str | None) -> int | None:
    """The first failing step to probe on a second run, where it comes after step 0 and step
    0's probe cannot show it (:func:`harness.analysis.divergence.step_to_probe`); None
    otherwise (a trajectory comparison has no reference step to replay from)."""
    from harness.analysis.divergence import step_to_probe

    try:
        from reference.record import Record

        reference = Record.load(comparison.reference) if getattr(comparison, "mode", "") == "stepwise" else None
        actual = Record.load(record_path) if record_path else None
        return step_to_probe(comparison, probe, actual, reference) if reference is not None else None
    except Exception:  # noqa: BLE001 - without the decision there is no second run, the verdict stands
        return None


def _probe_failing_step(target: Target, case: Case, strategy: Any, ctx: DistContextLike, dst: int, run_options: dict[str, Any],
                        out: DiagnosedRun, probe: Any, record_path: str | None) -> Any:
    """Collective, for a failed run: where its first failing step comes after step 0 and
    step 0's probe cannot show it (:func:`harness.analysis.divergence.step_to_probe`, decided on
    ``dst``), train the target again up to that step with the probe on that step's first
    micro-batch instead; its probe on ``dst`` (None elsewhere, or when there is none). The
    second run records to a temporary folder and is not compared: it only gives the values."""
    step = _failing_step_to_probe(out.result.comparison, probe, record_path) if ctx.rank == dst else None
    step = broadcast_object(step, dst)
    if step is None:
        return None
    later_case = case.with_steps(step + 1)
    folder = Path(tempfile.mkdtemp(prefix="harness-probe-")) if ctx.rank == dst else None
    try:
        return _train_probed(target, later_case, strategy, ctx, dst, folder, step)
    except Exception as exc:  # noqa: BLE001 - the same code trained once: what fails now is evidence lost, not the verdict
        out.result.comparison.notes.append(f"the first failing step {step} was not probed: {type(exc).__name__}: {exc}")
        return None
    finally:
        if folder is not None:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)


def _train_probed(target: Target, case: Case, strategy: Any, ctx: DistContextLike, dst: int, folder: Path | None,
                  step: int) -> Any:
    """Collective: train ``target`` on ``case`` with the probe on ``step``; its probe on ``dst``."""
    from harness.record.probe import ProbedStrategy, collect_probe

    record_path = folder / "record" if folder is not None else None
    if strategy is not None:
        from harness.run import train_strategy

        probed = ProbedStrategy(strategy, at_step=step)
        train_strategy(case, probed, ctx, record_path, dst=dst, check_replicas=False, trace=False)
        return collect_probe(probed, dst)
    from harness.context import DefaultGroupKept
    from harness.record.custom import CustomRun

    assert target.train is not None
    run = CustomRun(case, ctx, record_path, dst=dst, probe_step=step)
    case.seed_training()
    with DefaultGroupKept():
        target.train(ctx, run)
    run.finish()
    return collect_probe(run, dst)


def diagnose_on_ranks(
    target: Target,
    ctx: DistContextLike,
    *,
    steps: int | None = None,
    dst: int = 0,
    report_on_pass: bool = True,
    strategy: Any = None,
    **run_options: Any,
) -> DiagnosedRun:
    """Collective: train ``target`` (its strategy, or its custom loop) on every rank, compare
    with the reference on ``dst`` and diagnose there. ``steps`` overrides the case's;
    ``report_on_pass=False`` skips building a report for a run that matched (pytest only needs
    one to fail with); ``strategy`` replaces the target's for training (a wrapper that reports
    progress) and ``run_options`` are :func:`harness.run.run_strategy`'s (``tolerance``,
    ``workdir``, ``cache``, ``comparison``)."""
    started = time.monotonic()
    case = target.case.with_steps(steps)
    out = DiagnosedRun(result=None)
    strategy = strategy if strategy is not None else target.strategy
    checkpoint = run_options.get("checkpoint")
    if strategy is not None:
        record_path, trace_path, probe = _train_strategy(target, case, strategy, ctx, dst, run_options, out)
    elif target.train is not None:
        record_path, trace_path, probe = _train_custom(target, case, ctx, dst, run_options, out)
    else:
        raise TargetError(f"{target.name} has neither a strategy nor a train(ctx, run) loop to run on ranks")
    if checkpoint is None and not run_options.get("digests") and out.result is not None and not out.result.comparison.passed:
        later = _probe_failing_step(target, case, strategy, ctx, dst, run_options, out, probe, record_path)
        if later is not None and probe is not None:
            probe.later = later
    if ctx.rank == dst and checkpoint is not None and checkpoint.resume and out.result is not None:
        from reference.record import Record

        from harness.analysis.resume import check_resume

        out.resume = check_resume(Record.load(checkpoint.saved_record), Record.load(out.result.record_path), checkpoint.path,
                                  comparison=out.result.comparison)
        out.resume.into = target.name
    if ctx.rank != dst or (out.passed and not report_on_pass):
        return out
    result = out.result
    trained = time.monotonic()
    out.report = diagnosis_report(
        target, case, ctx.world_size, comparison=result.comparison if result is not None else None,
        record_path=record_path, trace_path=trace_path, cache=run_options.get("cache"), findings=out.findings,
        probe=probe, error=out.error, elapsed_s=time.monotonic() - started,
    )
    if out.resume is not None:  # the resumed run is judged by the gate and the continuation
        from harness.codes import verdict_for

        out.report.resume = {**out.resume.to_dict(), "checkpoint": checkpoint.path, "lines": out.resume.lines()}
        out.report.verdict = verdict_for([*out.findings, *out.resume.diagnoses()], passed=out.resume.passed)
    # Where the time went: the ranks' training and recording, the comparison's phases, the
    # diagnosis and report (tests/bench/bench_long_runs.py reads these).
    compared = dict(getattr(result.comparison, "timing", {}) if result is not None else {})
    out.report.timing["phases"] = {"ranks_s": trained - started - sum(compared.values()), **compared,
                                   "diagnosis_s": time.monotonic() - trained}
    return out


def run_and_diagnose(case: Case, strategy: Any, ctx: DistContextLike, *, target: Target | None = None,
                     report_on_pass: bool = True, **run_options: Any) -> DiagnosedRun:
    """:func:`diagnose_on_ranks` of one strategy on ``case`` (``target`` names the run in the
    report; default: the strategy and case)."""
    named = dataclasses.replace(target, case=case) if target is not None else Target(f"{strategy.name}-{case.name}", case, strategy)
    return diagnose_on_ranks(named, ctx, strategy=strategy, report_on_pass=report_on_pass, **run_options)


# -- where: simulated ranks in this process ---------------------------------------------------
def diagnose_simulated(
    target: Target,
    world_size: int,
    *,
    steps: int | None = None,
    workdir: str | os.PathLike[str] | None = None,
    cache: str | os.PathLike[str] | None = None,
    tolerance: Any = "auto",
    comparison: str = "stepwise",
    echo: Callable[[str], None] | None = None,
) -> tuple[DiagnosisReport, Any, Any]:
    """(report, :class:`~harness.analysis.compare.CompareResult`,
    :class:`~harness.simulate.run.SimulatedRun`) of ``target`` on ``world_size`` simulated ranks
    (the same codes as real ranks)."""
    from reference.cache import cached_reference
    from reference.record import Record

    from harness.run import compare_to_reference
    from harness.simulate.run import simulate_strategy
    from harness.simulate.support import check_target

    say = echo or (lambda line: None)
    check_target(target)
    started = time.monotonic()
    case = target.case.with_steps(steps)
    work = str(workdir) if workdir is not None else tempfile.mkdtemp(prefix="harness-simulate-")
    os.makedirs(work, exist_ok=True)
    say(f"reference: training {case.name!r} on one device ({case.steps} steps)")
    cached_reference(case, cache=cache)
    say(f"ranks: training {target.strategy.name} on {world_size} simulated ranks (one process)")
    run = simulate_strategy(case, target.strategy, world_size, work, progress=say)
    say("diagnose: comparing and naming causes")
    compared = compare_to_reference(case, Record.load(run.record_path), cache=cache, tolerance=tolerance, comparison=comparison,
                                    label=f"{target.name} on {world_size} simulated ranks vs reference")
    step = _failing_step_to_probe(compared, run.probe, run.record_path) if not compared.passed else None
    if step is not None and run.probe is not None:
        # As on real ranks: train again up to the first failing step with the probe on it
        # (a second simulation in a temporary folder, not compared: it only gives the values).
        later = tempfile.mkdtemp(prefix="harness-probe-")
        try:
            run.probe.later = simulate_strategy(case.with_steps(step + 1), target.strategy, world_size, later,
                                                probe_step=step).probe
        except Exception as exc:  # noqa: BLE001 - the same code simulated once: what fails now is evidence lost, not the verdict
            compared.notes.append(f"the first failing step {step} was not probed: {type(exc).__name__}: {exc}")
        finally:
            shutil.rmtree(later, ignore_errors=True)
    report = diagnosis_report(target, case, world_size, comparison=compared, record_path=run.record_path,
                              trace_path=run.trace_path, cache=cache, probe=run.probe, elapsed_s=time.monotonic() - started)
    report.target["simulated"] = True
    report.workdir = work
    return report, compared, run


def simulate_target(target: Target, world_size: int, **options: Any) -> DiagnosisReport:
    """The report of :func:`diagnose_simulated` (``options`` are its own)."""
    return diagnose_simulated(target, world_size, **options)[0]


# -- where: real ranks started here (python -m harness diagnose) ------------------------------
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
                if self.done == self.steps:  # the run compares and diagnoses next
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
    digests: bool = False,
    checkpoint: dict[str, Any] | None = None,
) -> DiagnosisReport | None:
    """Rank body of :func:`diagnose_target` (collective): the target resolved on the rank, the
    reference trained first on ``dst`` (its own phase in the progress lines), then
    :func:`diagnose_on_ranks`; the report on ``dst``, None elsewhere. ``checkpoint``: a
    :class:`~harness.record.checkpoint.CheckpointPlan`'s fields (save one, or resume from one)."""
    import torch.distributed as dist

    from reference.cache import cached_reference

    from harness.record.checkpoint import CheckpointPlan
    from harness.targets.bundled import load_target

    plan = CheckpointPlan(**checkpoint) if checkpoint is not None else None

    target = load_target(target_spec)
    case = target.case.with_steps(steps)
    is_dst = ctx.rank == dst
    if is_dst:
        _progress(progress_path, f"reference: training {case.name!r} on one device ({case.steps} steps)")
        reference_started = time.monotonic()
        cached_reference(case, cache=cache)  # before the ranks start, so its time shows as its own phase
        reference_s = time.monotonic() - reference_started
        _progress(progress_path, f"ranks: training {target.strategy.name if target.strategy else 'custom loop'} on {ctx.world_size} ranks")
    dist.barrier()
    progress = None
    if target.strategy is not None:
        progress = _ProgressStrategy(target.strategy, progress_path if is_dst else None, case.steps)
        if plan is not None and plan.resume:
            progress.done = plan.at  # the steps before came from the checkpoint
    run = diagnose_on_ranks(target, ctx, steps=steps, dst=dst, strategy=progress, workdir=workdir, cache=cache,
                            tolerance=tolerance, comparison=comparison, digests=digests,
                            **({"checkpoint": plan} if plan is not None else {}))
    if run.report is not None:
        run.report.timing["phases"] = {"reference_s": reference_s, **run.report.timing.get("phases", {})}
    return run.report


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
    repeat: int | None = None,
    resume_at: int | None = None,
    resume_into: str | None = None,
    resume_nproc: int | None = None,
) -> DiagnosisReport:
    """Diagnose ``target`` (see :mod:`harness.targets.target`) on ``nproc`` ranks (default: the
    target's NPROC, else 2) and return the report. ``timeout`` defaults to the target's
    TIMEOUT, else :data:`harness.settings.RUN_TIMEOUT_S`; ``stall_window`` to the target's
    STALL_WINDOW, else the runner's (see :meth:`~harness.launch.remote.RankRunner.run`). ``echo``
    receives progress lines. ``tolerance`` and ``comparison`` as
    :func:`harness.run.compare_to_reference` takes them. ``repeat`` (default: the target's
    REPEAT, else 1): the number of runs, each on fresh ranks, compared bitwise with the first
    (:mod:`harness.analysis.determinism`); the first run's report carries the outcome.
    ``resume_at`` K: the run saves a checkpoint after step K-1 and goes on to the end; fresh
    ranks then load it into ``resume_into`` (default: the same target) on ``resume_nproc``
    ranks (default: that target's NPROC, else the same number) and train steps K..end; the
    load gate and the continuation (:mod:`harness.analysis.resume`) join the first run's report."""
    from harness.targets.bundled import load_target

    resolved: Target = load_target(target)  # fail fast, in this process, on a bad target
    if resolved.layout is not None:
        raise TargetError(f"{resolved.name} is a layout check on simulated ranks, not a run on real ones: "
                          f"python -m harness diagnose {resolved.name} (or harness.simulate.layout.check_layout)")
    runs = repeat if repeat is not None else (resolved.repeat or 1)
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise TargetError(f"repeat must be an int >= 1 (the runs compared bitwise), got {runs!r}")
    options = dict(nproc=nproc, steps=steps, timeout=timeout, cache=cache, echo=echo, tolerance=tolerance,
                   comparison=comparison, stall_window=stall_window)
    if resume_at is None and resolved.resume_at is not None:
        resume_at, resume_into, resume_nproc = resolved.resume_at, resume_into or resolved.resume_into, resume_nproc or resolved.resume_nproc
    if resume_at is not None:
        if runs > 1:
            raise TargetError("repeat and resume_at check one thing each: run them one at a time")
        return _diagnose_resume(target, resolved, at=resume_at, into=resume_into, into_nproc=resume_nproc, runner=runner,
                                workdir=workdir, **options)
    if resume_into is not None or resume_nproc is not None:
        raise TargetError("resume_into / resume_nproc need resume_at (the step the checkpoint is taken before)")
    if runs == 1:
        return _diagnose_once(target, resolved, runner=runner, workdir=workdir, **options)
    work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="harness-diagnose-"))
    say = echo or (lambda line: None)
    base = runner or RankRunner()
    reports: list[DiagnosisReport] = []
    try:
        for i in range(runs):
            say(f"repeat: run {i + 1} of {runs} on fresh ranks")
            fresh = base.fresh()
            try:
                reports.append(_diagnose_once(target, resolved, runner=fresh, workdir=work / f"run-{i + 1}", digests=True,
                                              **options))
            finally:
                fresh.close()
            if reports[-1].verdict.verdict in ("hang", "error"):
                break  # nothing to repeat: the run itself did not finish
    finally:
        if runner is None:
            base.close()
    report = _with_repeat(reports, runs)
    report.workdir = str(work)
    return report


def _diagnose_resume(target: str, resolved: Target, *, at: int, into: str | None, into_nproc: int | None,
                     runner: RankRunner | None, workdir: str | os.PathLike[str] | None, **options: Any) -> DiagnosisReport:
    """The resume check of :func:`diagnose_target`: the saving run, then the resumed run on
    fresh ranks; the first run's report with the resumed run's ``resume`` section and codes."""
    from harness.codes import verdict_for
    from harness.record.checkpoint import MANIFEST
    from harness.targets.bundled import load_target

    say = options.get("echo") or (lambda line: None)
    into_target = resolved if into is None else load_target(into)
    case = resolved.case.with_steps(options.get("steps"))
    for t in (resolved, into_target):
        if t.strategy is None and t.train is None:
            raise TargetError(f"{t.name} trains nothing on ranks (a layout plan): the resume check saves and loads a "
                              "strategy's or a custom loop's state")
    if resolved.checkpoint_glue is not None and (into_target.source, into_target.name) != (resolved.source, resolved.name):
        raise TargetError(f"{resolved.name} saves its checkpoint with its own save(ctx, run, path): only its own "
                          f"load(ctx, run, path) reads it, so it resumes into itself, not into {into_target.name}")
    into_case = into_target.case.with_steps(options.get("steps")).describe()
    differs = {k: (v, into_case.get(k)) for k, v in case.describe().items() if into_case.get(k) != v}
    if differs:
        fields = [k for k in differs if k != "name"]
        shown = ", ".join(f"{k} {differs[k][0]!r} against {differs[k][1]!r}" for k in fields[:3])
        shown += f" and {len(fields) - 3} more" if len(fields) > 3 else ""
        raise TargetError(f"{into_target.name} trains case {into_target.case.name!r}, {resolved.name} case {case.name!r}, "
                          f"which differ in {shown}: a checkpoint resumes the same training problem; pick a target of "
                          "the same case")
    if isinstance(at, bool) or not isinstance(at, int) or not 0 < at < case.steps:
        raise TargetError(f"resume at step {at!r}: allowed 1..{case.steps - 1} for a {case.steps}-step run "
                          "(the checkpoint is saved after step at-1; the resumed run trains at..end)")
    world = options.get("nproc") or resolved.nproc or 2
    world_into = into_nproc or (into_target.nproc if into is not None else None) or world
    work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="harness-resume-"))
    checkpoint = work / "checkpoint"
    base = runner or RankRunner()
    try:
        say(f"resume: run 1 trains {resolved.name} to the end on {world} ranks, saving a checkpoint after step {at - 1}")
        first = _diagnose_once(target, resolved, runner=base, workdir=work / "saved",
                               checkpoint={"path": str(checkpoint), "at": at}, **options)
        saved = (first.comparison or {}).get("actual")
        if first.verdict.verdict in ("hang", "error") or not saved or not (checkpoint / MANIFEST).is_file():
            reason = f"the saving run left no {'checkpoint' if saved else 'record'} (verdict {first.verdict.verdict})"
            first.resume = {"at": at, "skipped": reason}
            first.workdir = str(work)
            if first.verdict.verdict == "pass":
                # The check asked for did not run: never a PASS.
                from harness.codes import verdict_for

                first.verdict = verdict_for(first.verdict.diagnoses, passed=False,
                                            error=f"the resume check at step {at} could not run: {reason}")
            return first
        say(f"resume: run 2 loads it into {into_target.name} on {world_into} fresh ranks and trains steps {at}..{case.steps - 1}")
        fresh = base.fresh()
        try:
            second = _diagnose_once(into or target, into_target, runner=fresh, workdir=work / "resumed",
                                    checkpoint={"path": str(checkpoint), "at": at, "resume": True, "saved_record": saved},
                                    **{**options, "nproc": world_into})
        finally:
            fresh.close()
    finally:
        if runner is None:
            base.close()
    v = first.verdict
    if second.resume:
        first.resume = second.resume
        # Both runs' losses per step, for the report's picture of the continuation.
        first.resume["losses"] = {"uninterrupted": list(first.losses.get("parallel") or []),
                                  "resumed": list(second.losses.get("parallel") or [])}
        first.verdict = verdict_for([*v.diagnoses, *second.verdict.diagnoses], passed=v.verdict == "pass" and second.resume["passed"],
                                    error=v.error)
    else:  # the resumed run itself failed: a checkpoint that does not load is the finding, shown as it failed
        # The error's first line is its cause (a rank's own exception, or the launcher's account);
        # the lines after it name traces and folders.
        reason = [line for line in (second.verdict.error or "").strip().splitlines() if line.strip()]
        first.resume = {"at": at, "skipped": f"the resumed run ended {second.verdict.verdict}"
                                             + (f": {reason[0].strip()}" if reason else ""), "resumed_workdir": second.workdir}
        first.verdict = verdict_for([*v.diagnoses, *second.verdict.diagnoses], passed=False,
                                    hang=second.verdict.verdict == "hang", error=second.verdict.error or v.error)
    first.workdir = str(work)
    return first


def _with_repeat(reports: list[DiagnosisReport], runs: int) -> DiagnosisReport:
    """The first run's report with the determinism gate's outcome: every later run compared
    with it bitwise; ``nondeterministic-run`` added on the first that differs."""
    from reference.record import Record

    from harness.analysis.determinism import compare_repeats
    from harness.codes import verdict_for
    from harness.tracing.run_trace import TRACE_FILE, load_trace

    first = reports[0]
    def record_of(report: DiagnosisReport) -> str | None:
        return (report.comparison or {}).get("actual") or None

    if len(reports) < runs or any(record_of(r) is None for r in reports):
        stopped = next((r for r in reports if r.verdict.verdict in ("hang", "error") or record_of(r) is None), first)
        first.repeat = {"runs": runs, "skipped": f"run {reports.index(stopped) + 1} left no record to compare "
                                                 f"(verdict {stopped.verdict.verdict})"}
        return first
    base = Record.load(record_of(first))  # type: ignore[arg-type]
    base_trace = load_trace(Path(base.path) / TRACE_FILE)
    outcome = None
    for other in reports[1:]:
        record = Record.load(record_of(other))  # type: ignore[arg-type]
        outcome = compare_repeats(base, record, base_trace, load_trace(Path(record.path) / TRACE_FILE))
        if not outcome.identical:
            break
    assert outcome is not None
    first.repeat = {"runs": runs, "workdirs": [r.workdir for r in reports], **outcome.to_dict(),
                    "first_line": outcome.first.line() if outcome.first else "",
                    "losses": [list(r.losses.get("parallel") or []) for r in reports]}  # each run's, for the picture
    found = outcome.diagnosis(runs)
    if found is not None:
        v = first.verdict
        first.verdict = verdict_for([*v.diagnoses, found], passed=False, hang=v.verdict == "hang", error=v.error)
    return first


def _diagnose_once(
    target: str,
    resolved: Target,
    *,
    nproc: int | None,
    steps: int | None,
    runner: RankRunner | None,
    timeout: float | None,
    workdir: str | os.PathLike[str] | None,
    cache: str | os.PathLike[str] | None,
    echo: Callable[[str], None] | None,
    tolerance: str,
    comparison: str,
    stall_window: float | None,
    digests: bool = False,
    checkpoint: dict[str, Any] | None = None,
) -> DiagnosisReport:
    """One run of :func:`diagnose_target` (``digests``: record each rank's state bitwise;
    ``checkpoint``: save or resume from one, :func:`diagnose_on_rank`)."""
    from harness.analysis.failed_run import failure_report, left_behind, recorded_lines

    say = echo or (lambda line: None)
    world = nproc or resolved.nproc or 2
    case = resolved.case.with_steps(steps)
    work = str(workdir) if workdir is not None else tempfile.mkdtemp(prefix="harness-diagnose-")
    os.makedirs(work, exist_ok=True)
    progress_path = os.path.join(work, f"progress-{os.getpid()}-{time.monotonic_ns()}.log")
    say(f"target {resolved.name}: case {case.name!r}, {world} ranks, {case.steps} steps")
    own = runner is None
    runner = runner or RankRunner()
    stop = threading.Event()
    tail = threading.Thread(target=_tail, args=(progress_path, stop, say), daemon=True)
    tail.start()
    started = time.monotonic()
    try:
        result = runner.run(
            diagnose_on_rank, nproc=world, timeout=timeout or resolved.timeout or settings.RUN_TIMEOUT_S,
            stall_window=stall_window if stall_window is not None else resolved.stall_window,
            kwargs={"target_spec": target, "steps": steps, "workdir": work, "tolerance": tolerance, "comparison": comparison,
                    "digests": digests, "checkpoint": checkpoint,
                    "cache": str(cache) if cache is not None else None, "progress_path": progress_path},
        )
        report = result.values.get(0)
        if not isinstance(report, DiagnosisReport):
            raise RanksFailed(f"rank 0 returned {type(report).__name__}, not a report", result.outcome)  # type: ignore[arg-type]
    except KeyboardInterrupt as exc:
        # Ctrl-C / SIGTERM: the ranks are gone (the pool killed them); what they recorded stays.
        exc.left_behind = recorded_lines(left_behind(work)[2]) or f"\n\nnothing recorded yet (run folder {work})"  # type: ignore[attr-defined]
        raise
    except (RanksHung, RanksFailed) as exc:
        report = failure_report(exc.outcome, work, target=resolved, case=case, nproc=world, error=exc.report,
                                elapsed_s=time.monotonic() - started)
    finally:
        stop.set()
        tail.join(timeout=1)
        if own:
            runner.close()
    report.workdir = work
    return report


# -- step 5 of the method: the profile of a correct run ---------------------------------------
def profile_on_ranks(case: Case, strategy: Any, ctx: DistContextLike, *, steps: int = 3, warmup: int = 1,
                     trace_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Collective: ``steps`` profiled steps of ``strategy`` after ``warmup``
    (:func:`harness.tracing.profiler.profile_strategy`), each rank's trace read into figures on
    the rank that wrote it (:func:`harness.analysis.profile.rank_profile`); the run's profile
    (:func:`harness.analysis.profile.build_profile`) on every rank."""
    import torch.distributed as dist

    from harness.analysis.profile import build_profile, rank_profile
    from harness.targets.target import is_train_fn
    from harness.tracing.profiler import profile_loop, profile_strategy

    if is_train_fn(strategy):  # a train(ctx, run) loop
        recorded = profile_loop(case, strategy, ctx, steps=steps, warmup=warmup, trace_dir=trace_dir)
    else:
        recorded = profile_strategy(case, strategy, ctx, steps=steps, warmup=warmup, trace_dir=trace_dir)
    mine = rank_profile(recorded)
    every: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    profile = build_profile({"ranks": every, "global_batch_size": case.global_batch_size, "micro_batches": case.micro_batches},
                            steps=steps, warmup=warmup)
    profile.update({"strategy": "custom" if is_train_fn(strategy) else strategy.name, "case": case.name, "nproc": ctx.world_size,
                    "trace_dir": str(trace_dir)})
    return profile


def profile_on_rank(ctx: Any, target_spec: str, steps: int, warmup: int, trace_dir: str) -> dict[str, Any] | None:
    """Rank body of :func:`profile_target` (collective): the profile on rank 0, None elsewhere."""
    from harness.targets.bundled import load_target

    target = load_target(target_spec)
    profile = profile_on_ranks(target.case, target.strategy or target.train, ctx, steps=steps, warmup=warmup, trace_dir=trace_dir)
    return {**profile, "target": target.name} if ctx.rank == 0 else None


def check_profilable(target: Target) -> Target:
    """``target`` itself when it trains steps the profiler can mark (a strategy or a
    ``train(ctx, run)`` loop); a :class:`TargetError` saying why not otherwise."""
    if target.layout is not None or (target.strategy is None and target.train is None):
        raise TargetError(f"{target.name}: profile runs a strategy's or a train(ctx, run) loop's steps; a layout plan "
                          "trains nothing")
    return target


def profile_target(
    target: str,
    *,
    nproc: int | None = None,
    steps: int = 3,
    warmup: int = 1,
    trace_dir: str | os.PathLike[str],
    runner: RankRunner | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """The profile (:func:`harness.analysis.profile.build_profile`) of ``steps`` steps of
    ``target``'s strategy after ``warmup`` on ``nproc`` ranks (default: the target's NPROC,
    else 2); each rank's Chrome trace in ``trace_dir``."""
    from harness.targets.bundled import load_target

    resolved = check_profilable(load_target(target))
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or not isinstance(warmup, int) or warmup < 0:
        raise TargetError(f"profile needs steps >= 1 and warmup >= 0, got steps={steps!r}, warmup={warmup!r}")
    world = nproc or resolved.nproc or 2
    own = runner is None
    runner = runner or RankRunner()
    try:
        result = runner.run(profile_on_rank, nproc=world, timeout=timeout or resolved.timeout or settings.RUN_TIMEOUT_S,
                            kwargs={"target_spec": target, "steps": steps, "warmup": warmup, "trace_dir": str(trace_dir)})
    finally:
        if own:
            runner.close()
    return result.values[0]
