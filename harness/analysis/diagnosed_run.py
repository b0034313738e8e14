"""Rank side of a diagnosed run: train with the activation probe on, compare, diagnose, report.

One collective function serves both front ends - :func:`harness.testing.assert_matches_reference`
(pytest) and :func:`harness.targets.drive.diagnose_on_rank` (``python -m harness diagnose``) - so
the two can never disagree on what a run is called. Data flow: probe-wrapped strategy ->
:func:`~harness.run.run_strategy` (record, trace, comparison on ``dst``) -> the probe gathered to
``dst`` -> :func:`~harness.analysis.diagnose.diagnose` -> :func:`~harness.report.model.build_report`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from reference.case import Case

from harness.codes import Diagnosis
from harness.report.model import DiagnosisReport, build_report
from harness.run import RunResult
from harness.strategy import DistContextLike
from harness.targets.target import Target

__all__ = ["DiagnosedRun", "diagnosis_report", "run_and_diagnose"]


@dataclass
class DiagnosedRun:
    """What :func:`run_and_diagnose` returns on every rank. ``result`` is None when the run
    could not be compared (a pipeline split that lost a layer: ``findings`` names it);
    ``report`` is set on ``dst`` only, and there only when asked for or the run failed."""

    result: RunResult | None
    report: DiagnosisReport | None = None
    findings: list[Diagnosis] = field(default_factory=list)
    error: str = ""

    @property
    def passed(self) -> bool:
        return self.result is not None and self.result.passed and not self.findings


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
    """On the comparing rank: load the records and trace a run left, run the diagnosis engine
    over them (``findings`` are causes already known, e.g. lost pipeline stages) and build the
    report. Also the tail of a custom loop's diagnosis, which has no strategy object."""
    from reference.cache import cached_reference
    from reference.record import Record

    from harness.analysis.diagnose import diagnose, load_trace

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
        stepwise=stepwise,
        trace=trace, diagnoses=found, error=error if not found else "", elapsed_s=elapsed_s,
    )


def run_and_diagnose(
    case: Case,
    strategy: Any,
    ctx: DistContextLike,
    *,
    target: Target | None = None,
    report_on_pass: bool = True,
    **run_options: Any,
) -> DiagnosedRun:
    """Collective: train ``strategy`` on every rank with the activation probe on, compare with
    the reference on ``dst`` and diagnose there. ``target`` names the run in the report
    (default: the strategy and case); ``report_on_pass=False`` skips building a report for a
    run that matched (pytest only needs one to fail with). ``run_options`` are
    :func:`harness.run.run_strategy`'s (``tolerance``, ``workdir``, ``cache``, ``dst``,
    ``comparison``), passed on as given."""
    from harness.analysis.diagnose import stage_coverage_diagnosis
    from harness.record.gather import StageCoverageError
    from harness.record.probe import ProbedStrategy, collect_probe
    from harness.run import run_strategy

    started = time.monotonic()
    dst, cache = run_options.get("dst", 0), run_options.get("cache")
    probed = ProbedStrategy(strategy)
    out = DiagnosedRun(result=None)
    try:
        out.result = run_strategy(case, probed, ctx, **run_options)
    except StageCoverageError as exc:  # raised on every rank alike (the check is collective)
        out.findings.append(stage_coverage_diagnosis(exc))
        out.error = str(exc)
    probe = collect_probe(probed, dst)  # collective: every rank takes part, even after a failure
    if ctx.rank != dst or (out.passed and not report_on_pass):
        return out
    result = out.result
    out.report = diagnosis_report(
        target or Target(name=f"{strategy.name}-{case.name}", case=case, strategy=strategy), case, ctx.world_size,
        comparison=result.comparison if result is not None else None,
        record_path=result.record_path if result is not None else None,
        trace_path=getattr(result, "trace_path", None) if result is not None else None,
        cache=cache, findings=out.findings, probe=probe, error=out.error, elapsed_s=time.monotonic() - started,
    )
    return out
