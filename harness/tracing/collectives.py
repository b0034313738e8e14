"""Per-rank collective records, and the checks that compare them across ranks.

:func:`merge` turns Flight Recorder's raw entries and the Python hooks' calls
(:mod:`harness.tracing.hooks`) into one ordered list of :class:`CollectiveRecord` per rank:
FR is the source for every collective (C++-issued ones included), the hooks add the reduce op
and the Python call site, and are the only source for point-to-point ops (FR does not record
them on gloo, nor their peer anywhere).

:func:`compare_ranks` is the check itself, shared by finished runs (``check_collectives``) and
hangs (``diagnose_hang``): per process group, every member must issue the same sequence (op,
and for ops whose inputs must agree, shapes and dtypes, and the reduce op); the first position
where they differ is ``collective-mismatch``, the first one some member never reached is
``collective-missing``. Point-to-point traffic is matched per (group, sender, receiver, tag):
the k-th send must meet the k-th receive with the same shape and dtype.
"""

from __future__ import annotations

import difflib

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.codes import Diagnosis
from harness.flight_recorder import short_site
from harness.protocol import CollectiveEntry

from . import hooks

__all__ = [
    "CollectiveRecord",
    "RankStatus",
    "compare_ranks",
    "dtype_bytes",
    "from_entry",
    "merge",
    "record_bytes",
    "short_site",
    "to_entry",
]

# FR writes c10::ScalarType names; the harness writes torch's.
_FR_DTYPES = {
    "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128",
    "ComplexHalf": "complex32", "Float8_e4m3fn": "float8_e4m3fn", "Float8_e5m2": "float8_e5m2",
}
_DTYPE_BYTES = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "complex32": 4,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
# Ops whose inputs must agree in shape and dtype on every member of the group.
_SHAPE_BOUND = (
    "all_reduce", "allreduce", "broadcast", "all_gather", "allgather", "_allgather", "reduce_scatter",
    "_reduce_scatter", "reduce",
)


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES.get(dtype, 4)


@dataclass
class CollectiveRecord:
    """One collective or point-to-point op of one rank, in issue order.

    ``seq`` is the group's collective sequence number (FR's ``collective_seq_id``, the same on
    every member for the same collective); for p2p ops it counts this rank's sends to (or
    receives from) ``peer`` on the group with that ``tag``, from 1. ``source`` says where it
    came from: "fr" (Flight Recorder only: issued from C++), "fr+python", or "python" (p2p,
    or FR off)."""

    rank: int
    index: int
    op: str
    group: str
    group_desc: str = ""
    group_ranks: list[int] | None = None
    seq: int = 0
    is_p2p: bool = False
    peer: int | None = None
    tag: int = 0
    shapes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    reduce_op: str = ""
    call_site: str = ""
    step: int | None = None
    phase: str = ""
    t_ns: int = 0
    end_ns: int = 0
    source: str = ""
    fr_id: int = -1  # Flight Recorder's record id (-1: not from FR)

    @property
    def group_key(self) -> tuple[str, tuple[int, ...]]:
        return (self.group, tuple(self.group_ranks or ()))

    @property
    def group_label(self) -> str:
        name = self.group_desc if self.group_desc and self.group_desc != "undefined" else f"pg {self.group}"
        return f"{name} {self.group_ranks}" if self.group_ranks is not None else name

    @property
    def nbytes(self) -> int:
        return record_bytes(self)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CollectiveRecord:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def describe(self) -> str:
        """'all_reduce #3 [[16, 8]] float32 sum' or 'send p2p#2 to rank 1 [[4, 8]] float32'."""
        if self.is_p2p:
            arrow = "to" if self.op.startswith(("send", "isend")) else "from"
            peer = "any rank" if self.peer is None else f"rank {self.peer}"
            head = f"{self.op} p2p#{self.seq} {arrow} {peer}"
        else:
            head = f"{self.op} #{self.seq}"
        shapes = f" {self.shapes}" if self.shapes else ""
        dtypes = f" {'/'.join(sorted(set(self.dtypes)))}" if self.dtypes else ""
        reduce = f" {self.reduce_op}" if self.reduce_op else ""
        return f"{head}{shapes}{dtypes}{reduce}"

    def evidence(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "op": self.op, "seq": self.seq, "group": self.group,
            "group_desc": self.group_desc, "group_ranks": self.group_ranks, "shapes": self.shapes,
            "dtypes": self.dtypes, "reduce_op": self.reduce_op, "peer": self.peer,
            "call_site": short_site(self.call_site), "step": self.step, "phase": self.phase,
        }


def record_bytes(record: CollectiveRecord) -> int:
    """Bytes of this rank's input tensors (the data it puts into the collective)."""
    total = 0
    for i, shape in enumerate(record.shapes):
        n = 1
        for d in shape:
            n *= int(d)
        dtype = record.dtypes[i] if i < len(record.dtypes) else (record.dtypes[0] if record.dtypes else "float32")
        total += n * dtype_bytes(dtype)
    return total


# -- merging FR and the Python hooks -------------------------------------------------------


def _fr_op(name: str) -> str:
    return str(name).split(":", 1)[-1] or "?"


def _shape_list(sizes: Any) -> list[list[int]]:
    out = []
    for s in sizes or []:
        try:
            out.append([int(d) for d in s])
        except TypeError:
            out.append([int(s)])
    return out


def merge(
    dump_data: Mapping[str, Any] | None,
    fr_entries: Sequence[Mapping[str, Any]],
    calls: Sequence[hooks.PyCall],
    *,
    rank: int = -1,
) -> list[CollectiveRecord]:
    """One rank's records, oldest first, from FR's raw ``fr_entries`` and the hooks' ``calls``
    (both already cut to the window wanted)."""
    from harness import flight_recorder

    dump_data = dump_data or {}
    py_by_pg: dict[str, list[hooks.PyCall]] = defaultdict(list)
    p2p_calls: list[hooks.PyCall] = []
    for c in calls:
        (p2p_calls if c.op in ("send", "recv") else py_by_pg[c.pg_name]).append(c)
    cursor: dict[str, int] = defaultdict(int)
    used: set[int] = set()
    records: list[CollectiveRecord] = []
    p2p_pgs = {c.pg_name for c in p2p_calls}

    for raw in fr_entries:
        pg_name, pg_desc = (tuple(raw.get("process_group", ("?", "?"))) + ("?", "?"))[:2]
        pg_name, pg_desc = str(pg_name), str(pg_desc)
        is_p2p = bool(raw.get("is_p2p")) or (not raw.get("collective_seq_id") and raw.get("p2p_seq_id"))
        if is_p2p and (pg_name in p2p_pgs or hooks.installed()):
            continue  # the hooks have it, with its peer
        created = int(raw.get("time_created_ns") or 0)
        paired: hooks.PyCall | None = None
        queue = py_by_pg.get(pg_name, [])
        i = cursor[pg_name]
        while i < len(queue) and queue[i].t1_ns < created:
            i += 1
        cursor[pg_name] = i
        if i < len(queue) and queue[i].t0_ns <= created <= queue[i].t1_ns:
            paired = queue[i]
            used.add(paired.index)
        info = hooks.group_info(pg_name)
        ranks = info[0] if info else flight_recorder.group_ranks_from_config(dump_data, pg_name, pg_desc)
        dtypes = [_FR_DTYPES.get(str(d), str(d).lower()) for d in raw.get("input_dtypes", []) or []]
        records.append(
            CollectiveRecord(
                rank=rank,
                index=0,
                op=_fr_op(raw.get("profiling_name", "?")),
                group=pg_name,
                group_desc=pg_desc if pg_desc != "?" else (info[1] if info else ""),
                group_ranks=list(ranks) if ranks else None,
                seq=int(raw.get("collective_seq_id") or raw.get("p2p_seq_id") or 0),
                is_p2p=bool(is_p2p),
                shapes=_shape_list(raw.get("input_sizes")),
                dtypes=dtypes,
                reduce_op=paired.reduce_op if paired else "",
                call_site=(paired.call_site if paired else "") or flight_recorder.call_site_of(raw.get("frames", []) or []),
                t_ns=created,
                end_ns=paired.t1_ns if paired else 0,
                source="fr+python" if paired else "fr",
                fr_id=int(raw.get("record_id", -1)),
            )
        )

    # Python-issued collectives FR did not see (FR off, or its ring buffer wrapped): numbered
    # per group in issue order, which every member does alike.
    fr_pgs = {r.group for r in records}
    counters: dict[str, int] = defaultdict(int)
    for pg_name, queue in py_by_pg.items():
        for c in queue:
            if c.index in used:
                continue
            counters[pg_name] += 1
            info = hooks.group_info(pg_name)
            records.append(_from_call(c, rank, info, seq=counters[pg_name], source="python" if pg_name not in fr_pgs else "python-unpaired"))
    for c in p2p_calls:
        records.append(_from_call(c, rank, hooks.group_info(c.pg_name), seq=c.p2p_seq, source="python"))
    records.sort(key=lambda r: r.t_ns)
    for i, r in enumerate(records):
        r.index = i
    return records


def _from_call(c: hooks.PyCall, rank: int, info: tuple[list[int], str] | None, *, seq: int, source: str) -> CollectiveRecord:
    return CollectiveRecord(
        rank=rank,
        index=0,
        op=c.op,
        group=c.pg_name,
        group_desc=info[1] if info else "",
        group_ranks=list(info[0]) if info else None,
        seq=seq,
        is_p2p=c.op in ("send", "recv"),
        peer=c.peer,
        tag=c.tag,
        shapes=[list(s) for s in c.shapes],
        dtypes=list(c.dtypes),
        reduce_op=c.reduce_op,
        call_site=c.call_site,
        t_ns=c.t0_ns,
        end_ns=c.t1_ns,
        source=source,
    )


def renumber_p2p(records: Iterable[CollectiveRecord]) -> None:
    """Number p2p ops per (group, direction, peer, tag) from 1 within ``records`` (the hooks
    count from process start; a warm rank has run other tests before)."""
    counts: dict[tuple, int] = defaultdict(int)
    for r in records:
        if r.is_p2p:
            key = (r.group, r.op, r.peer, r.tag)
            counts[key] += 1
            r.seq = counts[key]


def to_entry(record: CollectiveRecord) -> CollectiveEntry:
    """The launcher protocol's row (what a rank sends back when dumped on a hang)."""
    return CollectiveEntry(
        record_id=record.index,
        op=record.op,
        process_group=f"{record.group}:{record.group_desc or 'undefined'}",
        group_ranks=record.group_ranks,
        seq_id=0 if record.is_p2p else record.seq,
        p2p_seq_id=record.seq if record.is_p2p else 0,
        input_sizes=record.shapes,
        state=record.source,
        call_site=record.call_site,
        dtypes=record.dtypes,
        reduce_op=record.reduce_op,
        is_p2p=record.is_p2p,
        peer=record.peer,
        tag=record.tag,
        time_ns=record.t_ns,
        phase=record.phase,
        step=record.step,
    )


def from_entry(entry: CollectiveEntry, rank: int, index: int) -> CollectiveRecord:
    name, _, desc = entry.process_group.partition(":")
    is_p2p = bool(getattr(entry, "is_p2p", False))
    return CollectiveRecord(
        rank=rank,
        index=index,
        op=entry.op,
        group=name,
        group_desc=desc,
        group_ranks=list(entry.group_ranks) if entry.group_ranks is not None else None,
        seq=entry.p2p_seq_id if is_p2p else entry.seq_id,
        is_p2p=is_p2p,
        peer=getattr(entry, "peer", None),
        tag=getattr(entry, "tag", 0),
        shapes=_shape_list(entry.input_sizes),
        dtypes=list(getattr(entry, "dtypes", []) or []),
        reduce_op=getattr(entry, "reduce_op", ""),
        call_site=entry.call_site,
        t_ns=getattr(entry, "time_ns", 0),
        source=entry.state,
        phase=getattr(entry, "phase", ""),
        step=getattr(entry, "step", None),
    )


# -- comparing ranks -----------------------------------------------------------------------


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
