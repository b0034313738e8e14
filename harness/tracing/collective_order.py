"""The check of collective order across ranks, shared by finished runs
(:func:`harness.tracing.checks.check_collectives`) and hangs (:func:`harness.tracing.hang.diagnose_hang`):
per process group, every member must issue the same sequence (op, and for ops whose inputs
must agree, shapes and dtypes, and the reduce op); the first position where they differ is
``collective-mismatch``, the first one some member never reached is ``collective-missing``.
Sequences are aligned, not only compared position by position, so a collective one rank
issued and another did not is named at its call site. Point-to-point traffic is matched per
(group, sender, receiver, tag): the k-th send must meet the k-th receive with the same shape
and dtype."""

from __future__ import annotations

import difflib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from harness.codes import Diagnosis
from harness.tracing.fr import short_site
from harness.tracing.records import _SHAPE_BOUND, CollectiveRecord

__all__ = ["RankStatus", "compare_ranks"]


@dataclass
class RankStatus:
    """Where a rank was when its records were taken (hangs only): ``state`` is "waiting" (still
    inside its last op), "finished" (its body returned), "died", "failed" or "unknown";
    ``where`` is a short human phrase ("finished its test body", "killed by signal 6")."""

    state: str = "unknown"
    where: str = ""
    waiting_in: str = ""


def _signature(r: CollectiveRecord) -> tuple:
    bound = r.op.startswith(_SHAPE_BOUND)
    return (r.op, tuple(map(tuple, r.shapes)) if bound else None, tuple(r.dtypes) if bound else None)


def _differs(records: Sequence[CollectiveRecord]) -> bool:
    if len({_signature(r) for r in records}) > 1:
        return True
    reduce_ops = {r.reduce_op for r in records if r.reduce_op}
    return len(reduce_ops) > 1


def _site(r: CollectiveRecord) -> str:
    return short_site(r.call_site) or "an unknown call site"


def _step(r: CollectiveRecord) -> str:
    return f" (step {r.step})" if r.step is not None else ""


def _is_last(r: CollectiveRecord, by_rank: Mapping[int, Sequence[CollectiveRecord]]) -> bool:
    mine = by_rank.get(r.rank, [])
    return bool(mine) and mine[-1] is r


def compare_ranks(
    by_rank: Mapping[int, Sequence[CollectiveRecord]],
    status: Mapping[int, RankStatus] | None = None,
    *,
    positions: Mapping[int, Mapping[int, int]] | None = None,
    hang: bool | None = None,
) -> list[Diagnosis]:
    """The first divergence of every process group (and every p2p channel) among the ranks'
    records. With ``status`` (taken when the run stopped) the wording says who waits where;
    ``hang`` (default: whether ``status`` is given) says the run hung rather than failed;
    ``positions`` maps rank -> {record index -> position in the report's event list}."""
    hang = status is not None if hang is None else hang
    status = status or {}
    out: list[tuple[int, Diagnosis]] = []
    known = set(by_rank)

    # -- collectives per group -------------------------------------------------------------
    groups: dict[tuple[str, tuple[int, ...]], dict[int, dict[int, CollectiveRecord]]] = defaultdict(lambda: defaultdict(dict))
    for rank, records in by_rank.items():
        for r in records:
            if not r.is_p2p:
                groups[r.group_key][rank].setdefault(r.seq, r)
    for key, per_rank in groups.items():
        members = list(key[1]) or sorted(per_rank)
        members = [m for m in members if m in known]
        if len(members) < 2:
            continue
        max_seq = {m: max(per_rank[m]) if per_rank.get(m) else 0 for m in members}
        for seq in sorted({s for m in members for s in per_rank.get(m, {})}):
            holders = [m for m in members if seq in per_rank.get(m, {})]
            lacking = [m for m in members if seq not in per_rank.get(m, {}) and max_seq[m] < seq]
            recs = [per_rank[m][seq] for m in holders]
            if len(recs) >= 2 and _differs(recs):
                extra = _extra_collective(members, per_rank, seq, by_rank, status, hang, positions)
                out.append((min(r.t_ns for r in recs), extra or _mismatch(recs, by_rank, status, hang, positions)))
                break
            if lacking and recs:
                out.append((min(r.t_ns for r in recs), _missing(recs, lacking, by_rank, status, hang, positions)))
                break

    # -- point-to-point channels -----------------------------------------------------------
    sends: dict[tuple, dict[int, CollectiveRecord]] = defaultdict(dict)
    recvs: dict[tuple, dict[int, CollectiveRecord]] = defaultdict(dict)
    for rank, records in by_rank.items():
        for r in records:
            if not r.is_p2p or r.peer is None:
                continue
            if r.op.startswith(("send", "isend")):
                sends[(r.group, rank, r.peer, r.tag)][r.seq] = r
            else:
                recvs[(r.group, r.peer, rank, r.tag)][r.seq] = r
    for channel in sorted(set(sends) | set(recvs), key=str):
        _, src, dst, _ = channel
        s_map, r_map = sends.get(channel, {}), recvs.get(channel, {})
        if src not in known or dst not in known:
            continue
        for seq in sorted(set(s_map) | set(r_map)):
            s, r = s_map.get(seq), r_map.get(seq)
            if s is not None and r is not None:
                if (s.shapes, s.dtypes) != (r.shapes, r.dtypes):
                    out.append((min(s.t_ns, r.t_ns), _p2p_mismatch(s, r, by_rank, status, hang, positions)))
                    break
                continue
            present = s or r
            assert present is not None
            other_max = max(r_map) if s is not None and r_map else (max(s_map) if r is not None and s_map else 0)
            if other_max >= seq:
                continue  # outside the other side's window: unknown
            absent = dst if s is not None else src
            out.append((present.t_ns, _p2p_missing(present, absent, by_rank, status, hang, positions)))
            break

    out.sort(key=lambda item: item[0])
    return [d for _, d in out]


def _aligned_signature(r: CollectiveRecord) -> tuple:
    return (_signature(r), r.reduce_op, short_site(r.call_site))


def _extra_collective(
    members: Sequence[int],
    per_rank: Mapping[int, Mapping[int, CollectiveRecord]],
    seq: int,
    by_rank: Mapping[int, Sequence[CollectiveRecord]],
    status: Mapping[int, RankStatus],
    hang: bool,
    positions: Mapping[int, Mapping[int, int]] | None,
) -> Diagnosis | None:
    """At the first position ``seq`` where a group's ranks differ, whether some ranks issued
    collectives the others never did: the ranks' whole sequences on the group are aligned (op,
    shapes, dtypes, reduce op and call site, :class:`difflib.SequenceMatcher`) rather than
    compared position by position, so the rank that issued the extra collective and its line are named, not the
    collective that happens to sit one position later. A collective the harness issued itself
    (its ``phase`` is "harness") is never the extra one: where some ranks are in the harness's
    own collective and others in theirs, theirs is the extra."""
    full = {m: [per_rank[m][s] for s in sorted(per_rank.get(m, {}))] for m in members}
    heads = {m: per_rank[m][seq] for m in members if seq in per_rank.get(m, {})}
    if len(heads) < 2:
        return None
    harness = [m for m, r in heads.items() if r.phase == "harness"]
    own = [m for m, r in heads.items() if r.phase != "harness"]
    if harness and own:
        return _extra(own, harness, [heads[m] for m in own], heads, by_rank, status, hang, positions, "the harness's own")
    # Aligned over the whole sequences: a same-shaped extra may sit positions before the first
    # position-by-position difference (only its call site tells it apart).
    base = max(full, key=lambda m: len(full[m]))
    for other in (m for m in members if m != base and full.get(m)):
        a, b = full[base], full[other]
        opcodes = difflib.SequenceMatcher(
            None, [_aligned_signature(r) for r in a], [_aligned_signature(r) for r in b], autojunk=False
        ).get_opcodes()
        first = next((i for i, op in enumerate(opcodes) if op[0] != "equal"), None)
        if first is None:
            continue
        tag, i1, i2, j1, j2 = opcodes[first]
        if tag not in ("delete", "insert") or (first + 1 < len(opcodes) and opcodes[first + 1][0] != "equal"):
            continue  # not one-sided extras followed by agreement: a real mismatch
        extra_on, lacking, extra = (base, other, a[i1:i2]) if tag == "delete" else (other, base, b[j1:j2])
        # Where each rank stood at the extra: the extra itself, and what the other did instead.
        at = {extra_on: extra[0]}
        following = (b[j1] if j1 < len(b) else None) if tag == "delete" else (a[i1] if i1 < len(a) else None)
        if following is not None:
            at[lacking] = following
        return _extra([extra_on], [lacking], extra, at, by_rank, status, hang, positions, "")
    return None


def _extra(
    issuers: Sequence[int],
    lacking: Sequence[int],
    extra: Sequence[CollectiveRecord],
    heads: Mapping[int, CollectiveRecord],
    by_rank: Mapping[int, Sequence[CollectiveRecord]],
    status: Mapping[int, RankStatus],
    hang: bool,
    positions: Mapping[int, Mapping[int, int]] | None,
    lacking_is: str,
) -> Diagnosis:
    first = extra[0]
    more = f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""
    issued = "; ".join(f"rank {m} {_verb(heads[m], by_rank, status, hang)} {heads[m].describe()} at {_site(heads[m])}{_step(heads[m])}"
                       for m in issuers if m in heads)
    went_on = "; ".join(
        f"rank {m} went on to {lacking_is + ' ' if lacking_is else ''}{heads[m].describe()} at {_site(heads[m])}"
        for m in lacking if m in heads
    )
    who = ", ".join(f"rank {m}" for m in lacking)
    summary = f"collective #{first.seq} on {first.group_label}: {issued}{more}, which {who} never issued ({went_on})"
    return Diagnosis(
        "collective-missing" if hang else "collective-mismatch",
        summary,
        {
            "group": first.group, "group_desc": first.group_desc, "group_ranks": first.group_ranks,
            "seq": first.seq, "position": first.seq, "op": first.op,
            "extra_on_ranks": list(issuers), "absent_ranks": list(lacking),
            "extra": [r.evidence() for r in extra[:5]],
            "call_site": short_site(first.call_site),
            "lacking_ranks_next": {str(m): heads[m].evidence() for m in lacking if m in heads},
            "position_per_rank": _positions([heads[m] for m in heads], positions),
            "aligned": True, "hang": hang,
        },
    )


def _positions(recs: Iterable[CollectiveRecord], positions: Mapping[int, Mapping[int, int]] | None) -> dict[str, int]:
    result = {}
    for r in recs:
        if positions is None:
            result[str(r.rank)] = r.index
        elif r.index in positions.get(r.rank, {}):
            result[str(r.rank)] = positions[r.rank][r.index]
    return result


def _verb(r: CollectiveRecord, by_rank: Mapping[int, Sequence[CollectiveRecord]], status: Mapping[int, RankStatus], hang: bool) -> str:
    if hang and _is_last(r, by_rank) and status.get(r.rank, RankStatus()).state == "waiting":
        return "is in"
    return "already went past" if hang and not _is_last(r, by_rank) else "issued"


def _mismatch(recs, by_rank, status, hang, positions) -> Diagnosis:
    first = recs[0]
    parts = [f"rank {r.rank} {_verb(r, by_rank, status, hang)} {r.describe()} at {_site(r)}{_step(r)}" for r in recs]
    summary = f"collective #{first.seq} on {first.group_label} differs between ranks: " + "; ".join(parts)
    return Diagnosis(
        "collective-mismatch",
        summary,
        {
            "group": first.group, "group_desc": first.group_desc, "group_ranks": first.group_ranks,
            "seq": first.seq, "position": first.seq, "ranks": [r.rank for r in recs],
            "per_rank": {str(r.rank): r.evidence() for r in recs},
            "position_per_rank": _positions(recs, positions),
            "hang": hang,
        },
    )


def _absent_phrase(rank: int, group_recs: Sequence[CollectiveRecord], by_rank, status: Mapping[int, RankStatus]) -> str:
    st = status.get(rank)
    mine = list(by_rank.get(rank, []))
    on_group = [r for r in mine if r.group_key == group_recs[0].group_key] if group_recs else []
    bits = []
    if st is not None and st.where:
        bits.append(st.where)
    elif st is None and mine:
        last = mine[-1]
        bits.append(f"its last op was {last.describe()} on {last.group_label} at {_site(last)}{_step(last)}")
    if on_group:
        last = on_group[-1]
        bits.append(f"its last on that group was {last.op} #{last.seq} at {_site(last)}")
    elif not mine:
        bits.append("no collective recorded")
    return "; ".join(bits)


def _missing(recs, lacking, by_rank, status, hang, positions) -> Diagnosis:
    first = recs[0]
    waiting = [r for r in recs if not hang or status.get(r.rank, RankStatus()).state == "waiting" or _is_last(r, by_rank)]
    verb = "waits in" if hang else "issued"
    held = "; ".join(f"rank {r.rank} {verb} {r.describe()} at {_site(r)}{_step(r)}" for r in recs)
    absent = "; ".join(f"rank {m} never issued it ({_absent_phrase(m, recs, by_rank, status)})" for m in lacking)
    summary = f"collective #{first.seq} on {first.group_label}: {held}; {absent}"
    return Diagnosis(
        "collective-missing",
        summary,
        {
            "group": first.group, "group_desc": first.group_desc, "group_ranks": first.group_ranks,
            "seq": first.seq, "position": first.seq, "op": first.op,
            "waiting_ranks": [r.rank for r in waiting] if hang else [],
            "issued_by": [r.rank for r in recs],
            "absent_ranks": list(lacking),
            "ranks": [r.rank for r in recs],
            "per_rank": {str(r.rank): r.evidence() for r in recs},
            "absent": {str(m): _absent_phrase(m, recs, by_rank, status) for m in lacking},
            "call_site": short_site(first.call_site),
            "position_per_rank": _positions(recs, positions),
            "hang": hang,
        },
    )


def _p2p_mismatch(s, r, by_rank, status, hang, positions) -> Diagnosis:
    summary = (
        f"point-to-point #{s.seq} from rank {s.rank} to rank {r.rank} on {s.group_label}: rank {s.rank} sends "
        f"{s.shapes} {'/'.join(s.dtypes)} at {_site(s)}{_step(s)}, rank {r.rank} receives {r.shapes} "
        f"{'/'.join(r.dtypes)} at {_site(r)}{_step(r)}"
    )
    return Diagnosis(
        "collective-mismatch",
        summary,
        {
            "group": s.group, "group_ranks": s.group_ranks, "seq": s.seq, "position": s.seq, "p2p": True,
            "src": s.rank, "dst": r.rank, "tag": s.tag, "ranks": [s.rank, r.rank],
            "per_rank": {str(s.rank): s.evidence(), str(r.rank): r.evidence()},
            "position_per_rank": _positions([s, r], positions),
            "hang": hang,
        },
    )


def _p2p_missing(present, absent, by_rank, status, hang, positions) -> Diagnosis:
    sending = present.op.startswith(("send", "isend"))
    other = "receive" if sending else "send"
    verb = "waits in" if hang else "issued"
    summary = (
        f"point-to-point on {present.group_label}: rank {present.rank} {verb} {present.describe()} "
        f"at {_site(present)}{_step(present)}; rank {absent} never posted the matching {other} "
        f"({_absent_phrase(absent, [], by_rank, status)})"
    )
    return Diagnosis(
        "collective-missing",
        summary,
        {
            "group": present.group, "group_ranks": present.group_ranks, "seq": present.seq, "position": present.seq,
            "p2p": True, "op": present.op, "src": present.rank if sending else absent,
            "dst": absent if sending else present.rank, "tag": present.tag,
            "waiting_ranks": [present.rank] if hang else [], "issued_by": [present.rank],
            "absent_ranks": [absent], "ranks": [present.rank],
            "per_rank": {str(present.rank): present.evidence()},
            "absent": {str(absent): _absent_phrase(absent, [], by_rank, status)},
            "call_site": short_site(present.call_site),
            "position_per_rank": _positions([present], positions),
            "hang": hang,
        },
    )
