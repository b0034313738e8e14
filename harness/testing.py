"""The one-line check for pytest: the strategy matches the reference, or the test fails with the
diagnosis.

    @pytest.mark.distributed(nproc=2)
    def test_my_strategy(dist_ctx):
        assert_matches_reference(mlp_case(), MyStrategy(), dist_ctx)

With ``sim_ranks`` (``@pytest.mark.simulate(nproc=8)``) in place of ``dist_ctx`` the same call
trains on 8 simulated ranks in the pytest process (:mod:`harness.simulate`).

On a mismatch every rank raises ``AssertionError`` whose message is the terminal report (verdict,
codes, evidence) and names the self-contained HTML report written under
``$HARNESS_REPORT_DIR`` (the plugin sets it: ``--harness-report-dir``, else next to
``--junitxml``, else ``<rootdir>/harness-reports``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from reference.case import Case

from harness.context import broadcast_object

from harness.run import RunResult
from harness.strategy import DistContextLike
from harness.targets.target import Target

__all__ = ["assert_matches_reference", "report_path_for"]


def report_path_for(nodeid: str | None, name: str) -> Path:
    base = Path(os.environ.get("HARNESS_REPORT_DIR") or "harness-reports")
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid or name).strip("_")[:180] or "report"
    return base / f"{stem}.html"


def _current_test() -> str | None:
    nodeid = os.environ.get("HARNESS_CURRENT_TEST")
    if nodeid:
        return nodeid
    current = os.environ.get("PYTEST_CURRENT_TEST")  # "path::test (call)" under torchrun
    return current.rsplit(" ", 1)[0] if current else None


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
    """Collective: train ``strategy``, compare with the reference and, on any difference, fail
    with the diagnosis (and write the HTML report). Returns the :class:`RunResult` on a pass.
    ``ctx`` may be :class:`harness.simulate.SimulatedRanks` (the ``sim_ranks`` fixture): the
    run is then simulated in this process."""
    from harness.analysis.diagnosed_run import run_and_diagnose
    from harness.report import format_terminal, write_html
    from harness.simulate.run import SimulatedRanks

    if isinstance(ctx, SimulatedRanks):
        return _assert_simulated(case, strategy, ctx.world_size, steps=steps, tolerance=tolerance, workdir=workdir,
                                 cache=cache, comparison=comparison)

    if steps is not None:
        case = case.replace(steps=steps)
    name = f"{strategy.name}-{case.name}"
    if workdir is None and os.environ.get("HARNESS_RUN_DIR"):
        # The plugin's folder for this test: kept and named when the test fails or hangs
        # (with an HTML report built from what the run left), removed when it passes.
        workdir = os.environ["HARNESS_RUN_DIR"]
        if ctx.rank == dst:
            from harness.record.left_behind import note_run

            note_run(workdir, test=_current_test() or name, case=case, strategy=strategy.name, nproc=ctx.world_size)
    target = Target(name=_current_test() or name, case=case, strategy=strategy)
    run = run_and_diagnose(case, strategy, ctx, target=target, tolerance=tolerance, workdir=workdir, cache=cache,
                           dst=dst, report_on_pass=False, comparison=comparison)
    message = ""
    if run.report is not None:  # dst, and the run failed
        path = write_html(run.report, report_path_for(_current_test(), name))
        message = format_terminal(run.report) + f"\n  html report: {path}"
        if run.result is not None:
            message += f"\n  records: {run.result.record_path} vs {run.result.reference_path}"
    message = broadcast_object(message, dst)
    if message:
        raise AssertionError(message)
    assert run.result is not None
    return run.result


def _assert_simulated(case: Case, strategy: Any, world_size: int, **options: Any) -> RunResult:
    from harness.report import format_terminal, write_html
    from harness.simulate.run import diagnose_simulated

    name = f"{strategy.name}-{case.name}"
    target = Target(name=_current_test() or name, case=case, strategy=strategy)
    report, compared, run = diagnose_simulated(target, world_size, **options)
    if report.verdict.verdict != "pass":
        path = write_html(report, report_path_for(_current_test(), name))
        raise AssertionError(format_terminal(report) + f"\n  html report: {path}\n  run folder: {report.workdir}")
    return RunResult(case=case.name, strategy=strategy.name, world_size=world_size, comparison=compared,
                     reference_path=compared.reference, record_path=run.record_path, trace_path=run.trace_path)
