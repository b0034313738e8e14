"""The collective timeline as Chrome-trace JSON (opens in chrome://tracing and Perfetto): one
process per rank, one thread per process group, one complete ("X") event per collective with
its op, shapes, sequence number and call site; the first divergence as an instant event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.report.model import DiagnosisReport
from harness.report.summary import divergence_positions

__all__ = ["chrome_trace", "write_chrome_trace"]

_SLOT_US = 10.0  # width of one collective when the trace has no timestamps


def chrome_trace(report: DiagnosisReport) -> dict[str, Any]:
    events = (report.collectives or {}).get("events") or {}
    out: list[dict[str, Any]] = []
    marks = divergence_positions(report)
    threads: dict[tuple[int, str], int] = {}
    for rank_key in sorted(events, key=int):
        rank = int(rank_key)
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for i, ev in enumerate(events[rank_key]):
            group = str(ev.get("group", "default"))
            if (rank, group) not in threads:
                threads[(rank, group)] = tid = 1 + sum(1 for k in threads if k[0] == rank)
                ranks = ev.get("group_ranks")
                out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                            "args": {"name": f"group {group}" + (f" {ranks}" if ranks else "")}})
            tid = threads[(rank, group)]
            start = ev.get("start_us")
            end = ev.get("end_us")
            ts = float(start) if isinstance(start, (int, float)) else i * _SLOT_US
            dur = max(float(end) - ts, 1.0) if isinstance(end, (int, float)) and isinstance(start, (int, float)) else _SLOT_US * 0.9
            out.append({
                "ph": "X", "name": ev.get("op", "?"), "cat": "collective", "pid": rank, "tid": tid, "ts": ts, "dur": dur,
                "args": {k: ev.get(k) for k in ("seq", "step", "shapes", "dtypes", "reduce_op", "peer", "group_ranks", "call_site") if ev.get(k) is not None},
            })
            if marks.get(rank_key) == i:
                out.append({"ph": "i", "s": "p", "name": "first divergence", "pid": rank, "tid": tid, "ts": ts,
                            "args": {"codes": report.codes}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"verdict": report.verdict.verdict, "codes": report.codes, "target": report.target.get("name")}}


def write_chrome_trace(report: DiagnosisReport, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from reference.files import write_atomic

    return write_atomic(path, json.dumps(chrome_trace(report)))
