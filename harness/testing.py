"""The one-line check for pytest: the strategy matches the reference, or the test fails with the
diagnosis.

    @pytest.mark.distributed(nproc=2)
    def test_my_strategy(dist_ctx):
        assert_matches_reference(mlp_case(), MyStrategy(), dist_ctx)

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

import torch.distributed as dist

from reference.case import Case

from .run import RunResult, run_strategy
from .strategy import DistContextLike
from .target import Target

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
) -> RunResult:
    """Collective: train ``strategy``, compare with the reference and, on any difference, fail
    with the diagnosis (and write the HTML report). Returns the :class:`RunResult` on a pass."""
    from .diagnose import diagnose, stage_coverage_diagnosis
    from .gather import StageCoverageError
    from .probe import ProbedStrategy, collect_probe
    from .report import build_report, format_terminal, write_html

    if steps is not None:
        case = case.replace(steps=steps)
    probed = ProbedStrategy(strategy)
    result: RunResult | None = None
    findings = []
    try:
        result = run_strategy(case, probed, ctx, tolerance=tolerance, workdir=workdir, cache=cache, dst=dst)
    except StageCoverageError as exc:  # every rank raises it alike
        findings.append(stage_coverage_diagnosis(exc))
    probe = collect_probe(probed, dst)
    message = ""
    if ctx.rank == dst and (result is None or not result.passed):
        from reference.cache import cached_reference
        from reference.record import Record

        reference = cached_reference(case, cache=cache)
        actual = Record.load(result.record_path) if result is not None else None
        trace = None
        if result is not None and getattr(result, "trace_path", None):
            try:
                from .tracing import RunTrace

                trace = RunTrace.load(result.trace_path)
            except (ImportError, OSError, ValueError):
                trace = None
        if result is not None and actual is not None:
            findings = diagnose(result.comparison, reference, actual, trace=trace, findings=findings, probe=probe, case=case)
        target = Target(name=_current_test() or f"{strategy.name}-{case.name}", case=case, strategy=strategy)
        report = build_report(target=target, case=case, nproc=ctx.world_size, comparison=result.comparison if result else None,
                              reference=reference, actual=actual, trace=trace, diagnoses=findings)
        path = write_html(report, report_path_for(_current_test(), f"{strategy.name}-{case.name}"))
        message = format_terminal(report) + f"\n  html report: {path}"
        if result is not None:
            message += f"\n  records: {result.record_path} vs {result.reference_path}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [message]
        dist.broadcast_object_list(box, src=dst)
        message = box[0]
    if message:
        raise AssertionError(message)
    assert result is not None
    return result
