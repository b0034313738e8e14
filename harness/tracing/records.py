"""Per-rank collective records: :func:`merge` turns Flight Recorder's raw entries and the
Python hooks' calls (:mod:`harness.tracing.hooks`) into one ordered list of
:class:`CollectiveRecord` per rank: FR is the source for every collective (C++-issued ones
included), the hooks add the reduce op and the Python call site, and are the only source for
point-to-point ops (FR does not record them on gloo, nor their peer anywhere).
:func:`to_entry` / :func:`from_entry` convert to and from the launcher protocol's rows."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.tracing.entries import CollectiveEntry
from harness.tracing import fr, hooks
from harness.tracing.fr import short_site

__all__ = ["CollectiveRecord", "dtype_bytes", "from_entry", "merge", "record_bytes", "renumber_p2p", "to_entry"]

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
            head = f"{self.op} p2p#{self.seq} {fr.p2p_peer(self.op, self.peer)}"
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
    from harness.tracing import fr

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
        ranks = info[0] if info else fr.group_ranks_from_config(dump_data, pg_name, pg_desc)
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
                call_site=(paired.call_site if paired else "") or fr.call_site_of(raw.get("frames", []) or []),
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
