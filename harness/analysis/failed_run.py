"""A failed or hung run's report: the one path from what the run left to a
:class:`~harness.report.model.DiagnosisReport`, for ``python -m harness diagnose`` and pytest.

A run that fails or hangs still leaves things behind: the parallel record it published
incomplete (the steps done before the failure; :meth:`reference.record.RecordWriter.checkpoint`
publishes each step), the record folder being written when the ranks were killed, each rank's
own trace part, and the launcher's outcome (every rank's exception or death, its stack and
collectives). :func:`failure_report` turns them into the report: the codes a collective bug
earns (:func:`failure_diagnoses`, :func:`hang_diagnoses`), a rank's own exception shown as
its own, and the folders named. Under pytest the test's run folder holds a manifest
(``runs.jsonl``, :func:`note_run`) saying which case and strategy ran there, read back by
:func:`manifest_failure_report`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from harness.codes import Diagnosis

__all__ = [
    "MANIFEST",
    "RunFolderReport",
    "SavedComparison",
    "failure_diagnoses",
    "failure_report",
    "hang_diagnoses",
    "left_behind",
    "manifest_failure_report",
    "note_finished",
    "note_run",
    "recorded_lines",
]

MANIFEST = "runs.jsonl"


def note_run(run_dir: str | os.PathLike[str], *, test: str, case: Any, strategy: str, nproc: int,
             record: str = "", comparison: Any = None) -> None:
    """Say in ``run_dir`` which run starts there, or (``record``: its folder, wherever the test
    put it; ``comparison``: its :class:`CompareResult`) which one finished (read back by
    :func:`failure_report`). The comparison is saved beside the record."""
    entry: dict[str, Any] = {"test": test, "case": case.name, "steps": case.steps, "strategy": strategy, "nproc": nproc}
    if record:
        entry["record"] = record
    if comparison is not None:
        from reference.files import write_atomic

        saved = {"passed": comparison.passed, "summary": comparison.summary(), "data": comparison.to_dict()}
        entry["comparison"] = str(write_atomic(f"{record}.comparison.json", json.dumps(saved, default=str)))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(run_dir) / MANIFEST, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")


def note_finished(*, case: Any, strategy: str, nproc: int, record: str, comparison: Any) -> None:
    """On a rank of the pytest plugin: a run finished and was compared. Should the test fail
    after this (its own check), its report names this record, wherever the test put it, and
    shows this comparison. Nothing outside a plugin test with a run folder."""
    from harness.launch.rank_state import current_test

    current = current_test()
    if current is not None and current.run_dir:
        note_run(current.run_dir, test=current.nodeid, case=case, strategy=strategy, nproc=nproc, record=record,
                 comparison=comparison)


class SavedComparison:
    """A finished run's comparison as :func:`note_run` saved it: what a report shows of it."""

    def __init__(self, path: str):
        saved = json.loads(Path(path).read_text(encoding="utf-8"))
        self.passed: bool = bool(saved["passed"])
        self._summary: str = saved["summary"]
        self._data: dict[str, Any] = saved["data"]

    def summary(self) -> str:
        return self._summary

    def to_dict(self) -> dict[str, Any]:
        return self._data


def left_behind(work: str, outcome: Any = None) -> tuple[Any, Any, dict[str, Any]]:
    """What a failed or hung run left in ``work``: the parallel record it published incomplete
    (steps done before the failure), the ranks' trace parts, and record folders still being
    written when the ranks were killed (their steps never published). Returns (record or None,
    trace or None, a JSON-able summary naming each folder). Where the ranks saved no trace, the
    collectives they reported to the launcher (``outcome``'s dumps and journals) are the trace."""
    from reference.record import Record, RecordError

    from harness.tracing.run_trace import load_trace

    records, parts, unfinished = [], [], []
    chosen = trace = None
    for entry in sorted(Path(work).iterdir()) if os.path.isdir(work) else []:
        if not entry.is_dir():
            continue
        if ".partial-" in entry.name:
            unfinished.append(str(entry))
            if (entry / "meta.json").is_file() and chosen is None:  # checkpointed steps of a killed run
                try:
                    chosen = Record.load(entry)
                except RecordError:
                    pass
        elif entry.name.endswith(".trace"):
            parts.append(str(entry))
        elif (entry / "meta.json").is_file() and ".replay" not in entry.name:  # the harness's replays: not the run's
            try:
                record = Record.load(entry)
            except RecordError:
                continue
            records.append({"path": str(entry), "complete": record.complete, "steps": record.num_steps})
            chosen = chosen or record
    if chosen is not None and ".partial-" not in Path(chosen.path).name:
        trace = load_trace(str(Path(str(chosen.path) + ".trace"))) or load_trace(str(Path(chosen.path) / "trace.json"))
    if trace is None and parts:
        trace = load_trace(parts[0])
    if trace is None and outcome is not None:
        from harness.tracing.hang import outcome_trace

        trace = outcome_trace(outcome)
    recorded = {"records": records, "trace_parts": parts, "unfinished": unfinished} if (records or parts or unfinished) else {}
    return chosen, trace, recorded


def recorded_lines(recorded: dict[str, Any]) -> str:
    lines = [f"recorded before the failure: {r['path']} ({r['steps']} steps, {'complete' if r['complete'] else 'incomplete'})"
             for r in recorded.get("records", [])]
    lines += [f"trace parts of the ranks: {p}" for p in recorded.get("trace_parts", [])]
    lines += [f"unfinished record (the ranks were stopped while writing; steps done so far are in it): {p}"
              for p in recorded.get("unfinished", [])]
    return ("\n\n" + "\n".join(lines)) if lines else ""


def failure_report(outcome: Any, folder: str | os.PathLike[str], *, target: Any, case: Any, nproc: int, error: str,
                   comparison: Any = None, elapsed_s: float | None = None) -> Any:
    """The report of a run that failed or hung (``outcome``: the launcher's
    :class:`~harness.launch.pool.RunOutcome`) before it could report itself, from what it left
    in ``folder``. ``error`` is the launcher's account of the failure. A hang is diagnosed from
    the ranks' collectives; a failure only when the first one was the backend's (a rank's own
    exception is the cause, shown first, with no code)."""
    from harness.launch.failure_text import own_exception, rank_states
    from harness.report.model import build_report

    hang = bool(getattr(outcome, "timed_out", False))
    raised = "" if hang else own_exception(outcome)
    if hang:
        diagnoses = hang_diagnoses(outcome)
    else:
        # A rank's own exception (the user's code, or a check of the case) is the cause: the
        # others waiting in a collective are its consequence, not a missing collective.
        diagnoses = [] if raised else failure_diagnoses(outcome)
    record, trace, recorded = left_behind(str(folder), outcome)
    text = f"{raised}\n\n{error}" if raised else error
    report = build_report(target=target, case=case, nproc=nproc, diagnoses=diagnoses, hang=hang, comparison=comparison,
                          actual=record, trace=trace, error=text + recorded_lines(recorded), elapsed_s=elapsed_s,
                          recorded=recorded)
    try:
        report.ranks = rank_states(outcome)
    except Exception:  # noqa: BLE001 - the table is a view of the outcome; the report stands without it
        report.ranks = []
    return report


def manifest_failure_report(run_dir: str | os.PathLike[str], outcome: Any, *, name: str, error: str) -> Any:
    """:func:`failure_report` of the run a test started in ``run_dir`` (its manifest says which
    case and strategy; the comparison it saved, if it got that far, is shown); None when no
    run started there."""
    try:
        lines = (Path(run_dir) / MANIFEST).read_text(encoding="utf-8").splitlines()
        runs = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError):
        return None
    if not runs:
        return None
    run = runs[-1]  # the one that was running when the test failed, or its last finished one
    folder = str(Path(run["record"]).parent) if run.get("record") else str(run_dir)
    comparison = None
    if run.get("comparison"):
        try:
            comparison = SavedComparison(run["comparison"])
        except (OSError, ValueError, KeyError):
            comparison = None
    target = SimpleNamespace(name=name, source="", description=f"{run['strategy']} on {run['nproc']} ranks, case {run['case']!r}",
                             strategy=SimpleNamespace(name=run["strategy"]), expected_code=None)
    case = SimpleNamespace(name=run["case"], steps=run["steps"])
    return failure_report(outcome, folder, target=target, case=case, nproc=run["nproc"], error=error, comparison=comparison)


class RunFolderReport:
    """The plugin's account of a failed or interrupted test's run folder (see
    :class:`harness.launch.runners.RunFolderLines`): HTML reports go to ``report_dir``."""

    def __init__(self, report_dir: str):
        self.report_dir = report_dir

    def failed(self, run_dir: str, nodeid: str, text: str, outcome: Any) -> str:
        """A test that failed or hung inside ``assert_matches_reference`` (which records in the
        test's run folder): the HTML report built from what it recorded before the failure, and
        the folders that hold it. The folder is kept; empty when the test recorded nothing."""
        import shutil

        from harness.report.html import report_path, write_html

        try:
            report = manifest_failure_report(run_dir, outcome, name=nodeid, error=text)
        except Exception as exc:  # noqa: BLE001 - the failure itself must still be reported
            return f"\n\n(could not build a report from {run_dir}: {type(exc).__name__}: {exc})"
        if report is None:
            shutil.rmtree(run_dir, ignore_errors=True)
            return ""
        recorded = report.recorded
        if recorded.get("records") and all(r["complete"] and r["path"] in text for r in recorded["records"]) \
                and not recorded.get("unfinished"):
            return ""  # the run finished and its own failure message names its report and records
        path = write_html(report, report_path(self.report_dir, nodeid, "report"))
        lines = ["recorded before the failure:"]
        for r in recorded.get("records", []):
            lines.append(f"  parallel record: {r['path']} ({r['steps']} steps, {'complete' if r['complete'] else 'incomplete'})")
        lines += [f"  trace parts of the ranks: {p}" for p in recorded.get("trace_parts", [])]
        done = len(report.losses.get("parallel", []))
        lines += [f"  unfinished record, {done} step{'s' if done != 1 else ''} done before the ranks were stopped: {p}"
                  for p in recorded.get("unfinished", [])]
        lines.append(f"  html report: {path}")
        return "\n\n" + "\n".join(lines)

    def interrupted(self, run_dir: str) -> str:
        """The folders an interrupted test had recorded in (empty when none)."""
        return recorded_lines(left_behind(run_dir)[2])


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
    """Codes for a run that hung (or whose backend aborted), from the ranks' collectives."""
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
