"""The one-line check for pytest: the strategy matches the reference, or the test fails with the
diagnosis.

    @pytest.mark.distributed(nproc=2)
    def test_my_strategy(dist_ctx):
        assert_matches_reference(mlp_case(), MyStrategy(), dist_ctx)

With ``sim_ranks`` (``@pytest.mark.simulate(nproc=8)``) in place of ``dist_ctx`` the same call
trains on 8 simulated ranks in the pytest process (:mod:`harness.simulate`).

A custom training loop is checked the same way: pass ``train(ctx, run)`` (see
:mod:`harness.record.custom`) where the strategy goes.

On a mismatch every rank raises ``AssertionError`` whose message is the terminal report (verdict,
codes, evidence) and names the self-contained HTML report written to the test's report folder
(the plugin's ``--harness-report-dir``, else next to ``--junitxml``, else
``<rootdir>/harness-reports``; outside the plugin ``$HARNESS_REPORT_DIR``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reference.case import Case

from harness.context import broadcast_object
from harness.launch.protocol import CurrentTest
from harness.run import RunResult
from harness.strategy import DistContextLike
from harness.targets.target import Target, is_train_fn

__all__ = ["assert_matches_reference", "assert_resumes", "profile_run", "report_path_for"]


def report_path_for(nodeid: str | None, name: str, report_dir: str = "") -> Path:
    """Where the HTML report of a failing check goes: the test's report folder (``report_dir``,
    else the rank's current test's, else ``$HARNESS_REPORT_DIR``, else ``harness-reports``)."""
    from harness.report.html import report_path

    current = _current()
    return report_path(report_dir or (current.report_dir if current else "") or os.environ.get("HARNESS_REPORT_DIR"), nodeid, name)


def _current() -> CurrentTest | None:
    """The test this rank runs (the plugin's ranks, or torchrun in place), None outside one."""
    from harness.launch.rank_state import current_test

    return current_test()


def _current_test() -> str | None:
    current = _current()
    if current is not None:
        return current.nodeid
    running = os.environ.get("PYTEST_CURRENT_TEST")  # "path::test (call)": a test in this process
    return running.rsplit(" ", 1)[0] if running else None


def _shared_folder(ctx: DistContextLike, dst: int, given: str | os.PathLike[str] | None, *, prefix: str,
                   within_run_dir: str = "") -> Path:
    """Collective: one folder for every rank, as ``dst`` chooses it: ``given``, else the
    plugin's folder for this test (kept when it fails; ``within_run_dir`` a subfolder of it),
    else a new temporary folder."""
    import tempfile

    chosen = None
    if ctx.rank == dst:
        current = _current()
        if given is not None:
            chosen = str(given)
        elif current is not None and current.run_dir:
            chosen = str(Path(current.run_dir) / within_run_dir) if within_run_dir else current.run_dir
        else:
            chosen = tempfile.mkdtemp(prefix=prefix)
    return Path(broadcast_object(chosen, dst))


def _target(case: Case, trains: Any, glue: tuple[Any, Any] | None = None) -> Target:
    """The run a check names: the test, else the strategy (or loop) and the case; ``glue``: a
    loop's own checkpoint ``(save, load)``."""
    if is_train_fn(trains):
        name = f"{getattr(trains, '__name__', 'train')}-{case.name}"
        return Target(name=_current_test() or name, case=case, train=trains, checkpoint_glue=glue)
    return Target(name=_current_test() or f"{trains.name}-{case.name}", case=case, strategy=trains)


def _trains_name(trains: Any) -> str:
    return getattr(trains, "__name__", "train") if is_train_fn(trains) else trains.name


def assert_matches_reference(
    case: Case,
    strategy: Any,
    ctx: DistContextLike,
    *,
    steps: int | None = None,
    tolerance: Any = "auto",
    workdir: str | os.PathLike[str] | None = None,
    cache: str | os.PathLike[str] | None = None,
    dst: int = 0,
    comparison: str = "stepwise",
) -> RunResult:
    """Collective: train ``strategy`` (a :class:`~harness.strategy.Strategy`, or a custom loop
    ``train(ctx, run)``), compare with the reference and, on any difference, fail with the
    diagnosis (and write the HTML report). Returns the :class:`RunResult` on a pass. ``ctx``
    may be :class:`harness.simulate.SimulatedRanks` (the ``sim_ranks`` fixture): the run is
    then simulated in this process."""
    from harness.pipeline import diagnose_on_ranks, diagnose_simulated
    from harness.report import format_terminal, write_html
    from harness.simulate.run import SimulatedRanks

    target = _target(case, strategy)
    trains = target.strategy.name if target.strategy is not None else "custom"
    name = f"{trains}-{case.name}"
    if isinstance(ctx, SimulatedRanks):
        report, compared, run = diagnose_simulated(target, ctx.world_size, steps=steps, tolerance=tolerance,
                                                   workdir=workdir, cache=cache, comparison=comparison)
        if report.verdict.verdict != "pass":
            path = write_html(report, report_path_for(_current_test(), name))
            raise AssertionError(format_terminal(report) + f"\n  html report: {path}\n  run folder: {report.workdir}")
        return RunResult(case=case.name, strategy=trains, world_size=ctx.world_size,
                         comparison=compared, reference_path=compared.reference, record_path=run.record_path,
                         trace_path=run.trace_path)
    current = _current()
    if workdir is None and current is not None and current.run_dir:
        # The plugin's folder for this test: kept and named when the test fails or hangs
        # (with an HTML report built from what the run left), removed when it passes.
        workdir = current.run_dir
        if ctx.rank == dst:
            from harness.analysis.failed_run import note_run

            note_run(workdir, test=current.nodeid, case=case.with_steps(steps), strategy=trains, nproc=ctx.world_size)
    run = diagnose_on_ranks(target, ctx, steps=steps, dst=dst, report_on_pass=False, tolerance=tolerance, workdir=workdir,
                            cache=cache, comparison=comparison)
    _fail_if_reported(run, name, dst)
    assert run.result is not None
    return run.result


def _fail_if_reported(run: Any, name: str, dst: int, *, prefix: str = "") -> None:
    """Collective: every rank raises the failed run's terminal report (the HTML written on ``dst``)."""
    from harness.report import format_terminal, write_html

    message = ""
    if run.report is not None:  # dst, and the run failed
        path = write_html(run.report, report_path_for(_current_test(), name))
        message = prefix + format_terminal(run.report) + f"\n  html report: {path}"
        if run.result is not None:
            message += f"\n  records: {run.result.record_path} vs {run.result.reference_path}"
    message = broadcast_object(message, dst)
    if message:
        raise AssertionError(message)


def assert_resumes(
    case: Case,
    strategy: Any,
    ctx: DistContextLike,
    *,
    at: int,
    into: Any = None,
    steps: int | None = None,
    tolerance: Any = "auto",
    workdir: str | os.PathLike[str] | None = None,
    cache: str | os.PathLike[str] | None = None,
    dst: int = 0,
    save: Callable[[Any, Any, str], Any] | None = None,
    load: Callable[[Any, Any, str], Any] | None = None,
) -> Any:
    """Collective: the resume check next to :func:`assert_matches_reference`. Train ``strategy``
    (or a ``train(ctx, run)`` loop, with its own ``save(ctx, run, path)`` / ``load(ctx, run, path)``
    or, without them, the harness's save of what it watched)
    to the end, saving a checkpoint after step ``at - 1`` (the run must match the reference);
    then set up ``into`` (another strategy on these ranks; default ``strategy``) afresh, load the
    checkpoint and train ``at`` .. end. Fails with the diagnosis unless the load is bitwise what
    was saved and the continuation agrees with the uninterrupted run
    (:mod:`harness.analysis.resume`). Returns the
    :class:`~harness.analysis.resume.ResumeCheck` on every rank."""
    from harness.pipeline import diagnose_on_ranks
    from harness.record.checkpoint import CheckpointPlan

    if (save is None) != (load is None) or (save is not None and not is_train_fn(strategy)):
        raise TypeError("assert_resumes: save= and load= come together, with a train(ctx, run) loop (a strategy "
                        "saves through checkpoint_state / load_checkpoint_state)")
    if save is not None and into is not None and into is not strategy:
        raise TypeError("assert_resumes: a loop with its own save/load resumes into itself (only its load reads its files)")
    glue = (save, load) if save is not None else None
    into = into if into is not None else strategy
    base = _shared_folder(ctx, dst, workdir, prefix="harness-resume-")
    checkpoint = str(base / "checkpoint")
    saving = _target(case, strategy, glue)
    run = diagnose_on_ranks(saving, ctx, steps=steps, dst=dst, report_on_pass=False, tolerance=tolerance,
                            workdir=base / "saved", cache=cache, checkpoint=CheckpointPlan(checkpoint, at))
    _fail_if_reported(run, f"{_trains_name(strategy)}-{case.name}", dst, prefix="the run that saves the checkpoint fails on its own:\n")
    assert run.result is not None
    resuming = _target(case, into, glue)
    resumed = diagnose_on_ranks(resuming, ctx, steps=steps, dst=dst, report_on_pass=False, tolerance=tolerance,
                                workdir=base / "resumed", cache=cache,
                                checkpoint=CheckpointPlan(checkpoint, at, resume=True, saved_record=run.result.record_path))
    _fail_if_reported(resumed, f"{_trains_name(into)}-{case.name}-resumed", dst)
    return broadcast_object(resumed.resume, dst)


def profile_run(
    case: Case,
    strategy: Any,
    ctx: DistContextLike,
    *,
    steps: int = 3,
    warmup: int = 1,
    trace_dir: str | os.PathLike[str] | None = None,
    dst: int = 0,
) -> dict[str, Any]:
    """Collective: the profile of ``steps`` steps of ``strategy`` after ``warmup``, as
    ``python -m harness profile`` reports it (:func:`harness.pipeline.profile_on_ranks`), on
    every rank. Each rank's Chrome trace goes to ``trace_dir`` (default: the test's run folder,
    else a new temporary one). Check the run with :func:`assert_matches_reference` first; the
    figures are timings, so assert on counts, bytes and identities, not on seconds."""
    from harness.pipeline import profile_on_ranks

    trace_dir = _shared_folder(ctx, dst, trace_dir, prefix="harness-profile-", within_run_dir="profile")
    return profile_on_ranks(case, strategy, ctx, steps=steps, warmup=warmup, trace_dir=trace_dir)
