"""Name the cause of a hang from what the ranks said when the launcher's deadline passed.

On a timeout the launcher asks every live rank for its stack and its last collectives (FR's
entries merged with the Python hooks' p2p ops, :func:`harness.tracing.dump.read_entries`).
:func:`diagnose_hang` lines those up per process group and p2p channel, like the check of a
finished run, and words the first divergence as the user needs it::

    collective-mismatch: collective #17 on default_pg [0, 1] differs between ranks:
      rank 0 is in broadcast #17 [[8]] float32 at train.py:88 in step;
      rank 1 is in all_reduce #17 [[8]] float32 sum at model.py:42 in forward
    collective-missing: collective #2 on default_pg [0, 1]: rank 0 waits in all_reduce #2
      at test_x.py:45; rank 1 never issued it (finished its test body; ...)
"""

from __future__ import annotations

from typing import Any

from harness.codes import Diagnosis
from harness.tracing.collective_order import RankStatus, compare_ranks
from harness.tracing.fr import short_site
from harness.tracing.records import CollectiveRecord, from_entry

__all__ = ["diagnose_hang", "hang_lines", "outcome_trace", "rank_statuses"]


def rank_statuses(outcome: Any) -> dict[int, RankStatus]:
    """Each rank's state at the deadline, from the launcher's :class:`RunOutcome`."""
    out: dict[int, RankStatus] = {}
    for rank in range(outcome.nproc):
        if rank in outcome.deaths:
            out[rank] = RankStatus("died", f"died ({outcome.deaths[rank]})")
        elif rank in outcome.aborted:
            dump = outcome.aborted[rank]
            if dump is None or dump.state == "unresponsive":
                out[rank] = RankStatus("unknown", "did not answer")
            elif dump.waiting_in:
                site = short_site(dump.user_site)
                out[rank] = RankStatus("waiting", f"waiting in {dump.waiting_in}" + (f" at {site}" if site else ""), dump.waiting_in)
            else:
                site = short_site(dump.user_site)
                out[rank] = RankStatus("running", "running outside any collective" + (f" at {site}" if site else ""))
        elif rank in outcome.results:
            result = outcome.results[rank]
            if result.outcome == "failed":
                out[rank] = RankStatus("failed", f"failed with {result.exc_type}")
            else:
                out[rank] = RankStatus("finished", "finished its test body")
        else:
            out[rank] = RankStatus("unknown", "no answer")
    return out


def _records(outcome: Any) -> dict[int, list[CollectiveRecord]]:
    dumps = {**(outcome.finished or {}), **(outcome.aborted or {})}
    by_rank: dict[int, list[CollectiveRecord]] = {}
    for rank, dump in dumps.items():
        if dump is None or dump.state == "unresponsive":
            continue
        by_rank[rank] = [from_entry(e, rank, i) for i, e in enumerate(dump.collectives)]
    # Ranks that could not be asked (dead, or failed) left their journal: the collectives
    # they issued from Python. On a group where an asked rank ran collectives issued from C++
    # (Flight Recorder's alone: DDP's reducer, DTensor), the journal lacks those and would
    # number the group's collectives differently, so it is not used for that group.
    cpp_groups = {r.group for records in by_rank.values() for r in records if r.source == "fr"}
    for rank, entries in (getattr(outcome, "journals", None) or {}).items():
        if rank in by_rank:
            continue
        records = [from_entry(e, rank, i) for i, e in enumerate(entries)]
        by_rank[rank] = [r for r in records if r.group not in cpp_groups]
    return by_rank


def outcome_trace(outcome: Any) -> Any:
    """The collectives a stopped or failed run's ranks said they issued (the launcher's dumps
    of the ranks it asked, the journals of those it could not) as a :class:`RunTrace` marked
    incomplete, for the report of a run that never saved its own trace; None when there are
    none."""
    from harness.tracing.run_trace import RankTrace, RunTrace

    by_rank = _records(outcome)
    if not any(by_rank.values()):
        return None
    world = int(getattr(outcome, "nproc", 0) or len(by_rank))
    ranks = {rank: RankTrace(rank=rank, world_size=world, collectives=records, complete=False,
                             notes=["from the launcher's dump when the run was stopped"])
             for rank, records in sorted(by_rank.items())}
    return RunTrace(ranks=ranks, meta={"world_size": world, "from": "launcher dumps"})


def diagnose_hang(outcome: Any) -> list[Diagnosis]:
    """``collective-mismatch`` / ``collective-missing`` diagnoses of a hung run, from the
    launcher's :class:`~harness.launch.pool.RunOutcome` (its per-rank dumps)."""
    status = rank_statuses(outcome)
    by_rank = _records(outcome)
    # A finished rank whose dump is missing still counts: it issued nothing more.
    for rank, st in status.items():
        if st.state == "finished" and rank not in by_rank:
            by_rank[rank] = []
    # Hung: the launcher stopped ranks that were still running. Otherwise a rank died or
    # raised and the others failed with it (gloo aborting on a size mismatch, say).
    hang = bool(getattr(outcome, "aborted", None)) or bool(getattr(outcome, "timed_out", False))
    found = compare_ranks(by_rank, status, hang=hang)
    if found:
        return found
    waiting = [r for r, st in status.items() if st.state == "waiting"]
    gone = [r for r, st in status.items() if st.state in ("finished", "failed", "died")]
    if waiting and gone:
        # No collective trace to line up (Flight Recorder off?): the stacks still say who waits.
        dumps = outcome.aborted
        sites = {str(r): short_site(dumps[r].user_site) if dumps.get(r) else "" for r in waiting}
        return [Diagnosis(
            "collective-missing",
            "; ".join(f"rank {r} {status[r].where}" for r in waiting)
            + "; " + "; ".join(f"rank {r} never joined ({status[r].where})" for r in gone),
            {
                "waiting_ranks": waiting, "absent_ranks": gone, "ranks": waiting,
                "per_rank": {str(r): {"waiting_in": status[r].waiting_in, "call_site": sites[str(r)]} for r in waiting},
                "absent": {str(r): status[r].where for r in gone}, "hang": True,
                "note": "no collective records to line up; from the ranks' stacks only",
            },
        )]
    return []


def hang_lines(outcome: Any) -> list[str]:
    """The diagnosis lines the timeout report leads with (empty when nothing is named)."""
    try:
        found = diagnose_hang(outcome)
    except Exception as exc:  # noqa: BLE001 - the report must come out regardless
        return [f"(hang diagnosis failed: {type(exc).__name__}: {exc})"]
    return [f"{d.code}: {d.summary}" for d in found]
