"""Turn what happened on each rank into the text a person reads in a failed test.

The root cause leads (the rank that failed or died first) with its full traceback; every
other rank follows as one line; on a hang each rank says where it was waiting and what its
last collectives were.
"""

from __future__ import annotations


from harness import flight_recorder
from harness.launcher import RunOutcome
from harness.protocol import CollectiveEntry, RankDump

MAX_COLLECTIVES_SHOWN = 8


def _number(entry: CollectiveEntry) -> str:
    """'#3' for a collective, 'p2p#2 from rank 0' for a point-to-point op."""
    if not getattr(entry, "is_p2p", False) and entry.seq_id:
        return f"#{entry.seq_id}"
    peer = getattr(entry, "peer", None)
    if peer is None:
        return f"p2p#{entry.p2p_seq_id}"
    arrow = "to" if entry.op.startswith(("send", "isend")) else "from"
    return f"p2p#{entry.p2p_seq_id} {arrow} rank {peer}"


def where(dump: RankDump | None) -> str:
    """'in all_reduce #3 on pg 0:default_pg ranks=[0, 1] at test_x.py:12 in test_hang'."""
    if dump is None:
        return "did not answer"
    if dump.state == "unresponsive":
        return "did not answer (faulthandler stack below)"
    last = dump.collectives[-1] if dump.collectives else None
    op = dump.waiting_in
    detail = ""
    if last is not None and (not op or last.op == op or op in ("wait", "barrier")):
        op = op or last.op
        ranks = f" ranks={last.group_ranks}" if last.group_ranks is not None else ""
        detail = f" {_number(last)} on pg {last.process_group}{ranks}"
    site = flight_recorder.short_site(dump.user_site or (last.call_site if last else ""))
    if op:
        return f"in {op}{detail} at {site}" if site else f"in {op}{detail}"
    if dump.state.startswith("running"):
        return f"running, not in a collective, at {site}" if site else "running"
    return dump.state


def _root_cause(outcome: RunOutcome) -> tuple[int, str] | None:
    """(rank, 'died'|'failed') of the first failure: a death first, it usually causes the rest."""
    if outcome.deaths:
        rank = min(outcome.deaths, key=lambda r: outcome.death_times.get(r, 0.0))
        return rank, "died"
    failed = [r for r in outcome.results.values() if r.outcome == "failed"]
    if failed:
        return min(failed, key=lambda r: r.finished_at).rank, "failed"
    return None


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:200]
    return ""


def _rank_line(outcome: RunOutcome, rank: int) -> str:
    if rank in outcome.deaths:
        return f"rank {rank}: died ({outcome.deaths[rank]})"
    if rank in outcome.aborted:
        return f"rank {rank}: aborted while waiting: {where(outcome.aborted[rank])}"
    result = outcome.results.get(rank)
    if result is None:
        return f"rank {rank}: no result"
    if result.outcome == "failed":
        return f"rank {rank}: also failed: {result.exc_type}: {_first_line(result.message)}"
    line = f"rank {rank}: {result.outcome}"
    finished = outcome.finished.get(rank)
    if finished is not None and outcome.aborted:
        if finished.collectives:
            last = finished.collectives[-1]
            line += (
                f", finished its test body; its last collective was {last.op} {_number(last)} "
                f"at {flight_recorder.short_site(last.call_site)}"
            )
        else:
            line += ", finished its test body without issuing a collective"
    return line


def _collectives_block(dump: RankDump) -> list[str]:
    if not dump.collectives:
        return ["    (no collectives recorded in this test)"]
    shown = dump.collectives[-MAX_COLLECTIVES_SHOWN:]
    lines = [f"    {flight_recorder.format_entry(e)}" for e in shown]
    if len(dump.collectives) > len(shown):
        lines.insert(0, f"    ... {len(dump.collectives) - len(shown)} earlier")
    return lines


def _dump_details(dumps: dict[int, RankDump | None]) -> list[str]:
    lines: list[str] = []
    for rank in sorted(dumps):
        dump = dumps[rank]
        if dump is None:
            continue
        lines.append(f"---- rank {rank} (pid {dump.pid}) last collectives, oldest first ----")
        lines.extend(_collectives_block(dump))
        lines.append(f"---- rank {rank} Python stack ----")
        lines.append(dump.stack.rstrip() or "    (empty)")
        if dump.stdout_tail.strip():
            lines.append(f"---- rank {rank} output so far ----")
            lines.append(dump.stdout_tail.rstrip())
    return lines


def _hang_diagnosis(outcome: RunOutcome) -> list[str]:
    """The named cause, from the ranks' collective traces (harness.tracing.diagnose_hang):
    'rank 1 is in all_reduce #17 at model.py:42; rank 0 is in broadcast #17 at train.py:88'."""
    try:
        from harness.tracing import hang_lines
    except Exception as exc:  # noqa: BLE001 - the stacks below must still be reported
        return [f"(hang diagnosis unavailable: {type(exc).__name__}: {exc})"]
    found = hang_lines(outcome)
    return [f"DIAGNOSIS {line}" for line in found]


def format_failure(outcome: RunOutcome) -> str:
    n = outcome.nproc
    lines: list[str] = []
    if outcome.timed_out:
        if outcome.stalled_s:
            lines.append(
                f"HANG: no rank still running made progress for {outcome.stalled_s:g} s (the stall window: "
                "a rank blocked in a collective, sleeping or waiting uses no CPU), so the test was stopped "
                f"before its {outcome.timeout_s:g} s deadline. Each rank's stack and last collectives were "
                "collected, then the ranks' process trees were killed."
            )
        else:
            lines.append(
                f"TIMEOUT: the test did not finish on all {n} ranks within {outcome.timeout_s:g} s "
                "(--dist-timeout, or timeout= on the distributed marker). Each rank's stack and last "
                "collectives were collected, then the ranks' process trees were killed."
            )
        lines.extend(_hang_diagnosis(outcome))
        for rank in range(n):
            if rank in outcome.aborted:
                lines.append(f"rank {rank}: {where(outcome.aborted[rank])}")
            else:
                lines.append(_rank_line(outcome, rank))
        lines.append("")
        lines.extend(_dump_details({**outcome.finished, **outcome.aborted}))
        return "\n".join(lines)

    root = _root_cause(outcome)
    if root is None:
        return "\n".join(_rank_line(outcome, r) for r in range(n))
    rank, kind = root
    if kind == "died":
        lines.append(
            f"rank {rank} died first ({outcome.deaths[rank]}), of {n} ranks. Its last output:"
        )
        lines.append(outcome.death_logs.get(rank, "").rstrip() or "    (no output)")
    else:
        result = outcome.results[rank]
        lines.append(f"rank {rank} failed first, of {n} ranks:")
        lines.append("")
        lines.append(result.longrepr.rstrip())
    lines.append("")
    others = [r for r in range(n) if r != rank]
    if others:
        lines.append("other ranks:")
        lines.extend(f"  {_rank_line(outcome, r)}" for r in others)
    if outcome.aborted:
        lines.append("")
        lines.extend(_dump_details(outcome.aborted))
    return "\n".join(lines)
