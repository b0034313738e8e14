"""What a failed or hung run left on disk, named for the person reading its report.

A run that fails or hangs still leaves things behind: the parallel record it published
incomplete (the steps done before the failure; :meth:`reference.record.RecordWriter.checkpoint`
publishes each step), the record folder being written when the ranks were killed, and each
rank's own trace part. Both front ends name them: ``python -m harness diagnose`` in its
report, pytest (:func:`harness.testing.assert_matches_reference`, which writes into the
test's run folder) in the failure message and an HTML report, built here from the run's
manifest (``runs.jsonl``: which case and strategy the test ran).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["MANIFEST", "SavedComparison", "failure_report", "left_behind", "note_run", "recorded_lines"]

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

    from harness.analysis.diagnose import load_trace

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


def failure_report(run_dir: str | os.PathLike[str], *, name: str, error: str, hang: bool, diagnoses: list[Any] | None = None,
                   outcome: Any = None) -> Any:
    """The report of a run in ``run_dir`` that failed or hung before it could report itself,
    from its manifest and what it left; None when no run started there."""
    from harness.report.model import build_report

    try:
        lines = (Path(run_dir) / MANIFEST).read_text(encoding="utf-8").splitlines()
        runs = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError):
        return None
    if not runs:
        return None
    run = runs[-1]  # the one that was running when the test failed, or its last finished one
    folder = str(Path(run["record"]).parent) if run.get("record") else str(run_dir)
    record, trace, recorded = left_behind(folder, outcome)
    comparison = None
    if run.get("comparison"):
        try:
            comparison = SavedComparison(run["comparison"])
        except (OSError, ValueError, KeyError):
            comparison = None
    target = SimpleNamespace(name=name, source="", description=f"{run['strategy']} on {run['nproc']} ranks, case {run['case']!r}",
                             strategy=SimpleNamespace(name=run["strategy"]), expected_code=None)
    case = SimpleNamespace(name=run["case"], steps=run["steps"])
    return build_report(target=target, case=case, nproc=run["nproc"], diagnoses=list(diagnoses or []), hang=hang,
                        comparison=comparison, actual=record, trace=trace, error=error + recorded_lines(recorded),
                        recorded=recorded)
