"""The collective timeline as Chrome-trace JSON (opens in chrome://tracing and Perfetto): one
process per rank, one thread per process group, one complete ("X") event per collective with
its op, shapes, sequence number and call site; the first divergence as an instant event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.report.model import DiagnosisReport
from harness.report.summary import divergence_positions, waits_in

__all__ = ["chrome_trace", "write_chrome_trace"]

_SLOT_US = 10.0  # width of one collective when the trace has no timestamps


def chrome_trace(report: DiagnosisReport) -> dict[str, Any]:
    events = (report.collectives or {}).get("events") or {}
    out: list[dict[str, Any]] = []
    marks = divergence_positions(report)
    threads: dict[tuple[int, str], int] = {}
    flows: dict[tuple[str, str, Any], list[tuple[int, int, float, float]]] = {}
    # Each rank's steps as spans over its collectives' times; a hung rank's wait as a slice.
    steps_of: dict[str, dict[int, tuple[float, float]]] = {}
    end_of_trace = 0.0
    for rank_key, evs in events.items():
        for i, ev in enumerate(evs):
            start, end = ev.get("start_us"), ev.get("end_us")
            ts = float(start) if isinstance(start, (int, float)) else i * _SLOT_US
            te = float(end) if isinstance(end, (int, float)) else ts + _SLOT_US * 0.9
            end_of_trace = max(end_of_trace, te)
            if isinstance(ev.get("step"), int):
                lo, hi = steps_of.setdefault(rank_key, {}).get(ev["step"], (ts, te))
                steps_of[rank_key][ev["step"]] = (min(lo, ts), max(hi, te))
    waiting = {r["rank"]: waits_in(r) or "a collective" for r in (report.ranks or []) if r.get("state") == "waiting"}
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
            # One collective across its ranks: a flow from the first rank's slice to each other's
            # (Perfetto and chrome://tracing draw it as an arrow), keyed by group and sequence number.
            seq = ev.get("seq")
            if seq is not None:  # the same group name may stand for several groups (a mesh dim): its members too
                flows.setdefault((group, str(ev.get("group_ranks")), seq), []).append((rank, tid, ts, dur))
        last = events[rank_key][-1] if events[rank_key] else None
        state = waiting.get(rank)
        if state is not None and last is not None:
            # A hung rank: what it waits in, from where its last collective began to the end.
            tid = threads.get((rank, str(last.get("group", "default"))), 0)
            begin = float(last["start_us"]) if isinstance(last.get("start_us"), (int, float)) else len(events[rank_key]) * _SLOT_US
            out.append({"ph": "X", "name": f"waiting: {state}", "cat": "hang", "pid": rank, "tid": tid, "ts": begin,
                        "dur": max(end_of_trace - begin, _SLOT_US), "args": {"state": state}})
        for step, (first_ts, last_ts) in sorted(steps_of.get(rank_key, {}).items()):
            out.append({"ph": "X", "name": f"step {step}", "cat": "step", "pid": rank, "tid": 0, "ts": first_ts,
                        "dur": max(last_ts - first_ts, 1.0)})
    for n, ((group, _, seq), slices) in enumerate(sorted(flows.items(), key=lambda kv: str(kv[0]))):
        if len(slices) < 2:
            continue
        flow_id = n + 1
        rank, tid, ts, dur = slices[0]
        out.append({"ph": "s", "id": flow_id, "name": f"{group} #{seq}", "cat": "collective", "pid": rank, "tid": tid,
                    "ts": ts + dur / 2})
        for rank, tid, ts, dur in slices[1:]:
            out.append({"ph": "f", "bp": "e", "id": flow_id, "name": f"{group} #{seq}", "cat": "collective", "pid": rank,
                        "tid": tid, "ts": ts + dur / 2})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"verdict": report.verdict.verdict, "codes": report.codes, "target": report.target.get("name")}}


def write_chrome_trace(report: DiagnosisReport, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from reference.files import write_atomic

    return write_atomic(path, json.dumps(chrome_trace(report)))
