"""The per-run trace as data: what each rank did (:class:`RankTrace`), all ranks together
(:class:`RunTrace`), written next to the run's record as ``trace.json``. Per rank: its mesh
coordinate and dim names (declared by the strategy's layout, and those of every DeviceMesh
its parameters live on), the ranks and labels of every process group it knew, the local and
global shape of every parameter, the sample ids it consumed per step and micro-batch, and
every collective and point-to-point op in issue order (op, group and its ranks, shapes,
dtypes, reduce op, sequence number, peer, Python call site, step, phase). The
:class:`~harness.tracing.tracer.Tracer` records it on each rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from harness.tracing.records import CollectiveRecord, record_bytes
from harness.tracing.random_ops import RandomDraw

__all__ = ["TRACE_FILE", "TRACE_FORMAT", "TRACE_VERSION", "RankTrace", "RunTrace", "TraceError", "load_trace"]

TRACE_FORMAT = "harness-trace"
TRACE_VERSION = 1
TRACE_FILE = "trace.json"

T = TypeVar("T")


class TraceError(ValueError):
    """A trace file is missing or malformed, or the tracer was used out of order."""


@dataclass
class RankTrace:
    """One rank's trace (see the module docstring for what each field holds).

    - ``layout``: the strategy's :class:`~harness.record.recorder.RankLayout` as JSON (declared
      ``mesh`` coordinates and ``groups``; empty when none was given);
    - ``device_meshes``: ``{"dims", "shape", "mesh", "coords", "groups": {dim: {"name",
      "ranks"}}}`` per DeviceMesh found (parameters' meshes, the strategy's state);
    - ``groups``: process group name -> ``{"ranks", "desc", "dims", "roles"}``; ``dims`` are the
      mesh dims the group belongs to, ``roles`` e.g. ``"grad-sync"`` (DDP's group);
    - ``params``: reference name -> ``{"local_shape", "shape", "dtype", "placements",
      "mesh_dims"}``;
    - ``samples``: step -> sample ids per micro-batch;
    - ``collectives``: every op in issue order."""

    rank: int
    world_size: int
    backend: str = ""
    layout: dict[str, Any] = field(default_factory=dict)
    device_meshes: list[dict[str, Any]] = field(default_factory=list)
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: dict[int, list[list[int]]] = field(default_factory=dict)
    collectives: list[CollectiveRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    complete: bool = True
    random_ops: list[RandomDraw] = field(default_factory=list)  # the first step's, see random_ops

    @property
    def mesh_dims(self) -> list[str]:
        """Declared mesh dim names, outermost first."""
        return list((self.layout.get("mesh") or {}).keys())

    @property
    def coords(self) -> dict[str, int]:
        """Declared mesh coordinate (the layout's), else the first DeviceMesh's."""
        declared = dict(self.layout.get("mesh") or {})
        if declared:
            return {k: int(v) for k, v in declared.items()}
        for mesh in self.device_meshes:
            if mesh.get("coords"):
                return {k: int(v) for k, v in mesh["coords"].items()}
        return {}

    def events(self, *, include_harness: bool = False) -> list[CollectiveRecord]:
        """The rank's ops in issue order; the harness's own (recording) ones only if asked."""
        if include_harness:
            return list(self.collectives)
        return [c for c in self.collectives if c.phase != "harness"]

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "backend": self.backend,
            "layout": self.layout,
            "device_meshes": self.device_meshes,
            "groups": self.groups,
            "params": self.params,
            "samples": {str(k): v for k, v in self.samples.items()},
            "collectives": [c.to_json() for c in self.collectives],
            "notes": self.notes,
            "complete": self.complete,
            "random_ops": [d.to_json() for d in self.random_ops],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankTrace:
        try:
            return cls(
                rank=int(data["rank"]),
                world_size=int(data["world_size"]),
                backend=str(data.get("backend", "")),
                layout=dict(data.get("layout") or {}),
                device_meshes=list(data.get("device_meshes") or []),
                groups=dict(data.get("groups") or {}),
                params=dict(data.get("params") or {}),
                samples={int(k): [list(m) for m in v] for k, v in (data.get("samples") or {}).items()},
                collectives=[CollectiveRecord.from_json(c) for c in data.get("collectives") or []],
                notes=list(data.get("notes") or []),
                complete=bool(data.get("complete", True)),
                random_ops=[RandomDraw.from_json(d) for d in data.get("random_ops") or []],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"malformed rank trace ({type(exc).__name__}: {exc})") from None


@dataclass
class RunTrace:
    """Every rank's trace of one run; ``complete`` is False when a rank failed part way."""

    ranks: dict[int, RankTrace] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    path: str = ""

    @property
    def world_size(self) -> int:
        if self.ranks:
            return next(iter(self.ranks.values())).world_size
        return int(self.meta.get("world_size", 0))

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.world_size and all(r.complete for r in self.ranks.values())

    def rank(self, rank: int) -> RankTrace:
        if rank not in self.ranks:
            raise TraceError(f"trace {self.path or '(in memory)'} has no rank {rank}; it has ranks {sorted(self.ranks)}")
        return self.ranks[rank]

    # -- summaries ---------------------------------------------------------------------------

    def collective_summary(self, *, include_harness: bool = False) -> list[dict[str, Any]]:
        """Per step, process group and op: how many ops and how many bytes.

        Rows ``{"step", "group", "group_ranks", "op", "count", "bytes"}``; ``step`` is None for
        ops before the first step (setup). For a collective, count and bytes are those of one
        member (the lowest rank of the group: every member issues the same); for p2p ops they
        add up every rank's sends (op "send") and receives ("recv") on the group."""
        rows: dict[tuple, dict[str, Any]] = {}
        for rank, rt in sorted(self.ranks.items()):
            for c in rt.events(include_harness=include_harness):
                if not c.is_p2p and c.group_ranks and rank != min(c.group_ranks):
                    continue
                label = c.group_label
                key = (c.step if c.step is not None else -1, label, c.op)
                row = rows.setdefault(key, {"step": c.step, "group": label, "group_ranks": c.group_ranks, "op": c.op, "count": 0, "bytes": 0})
                row["count"] += 1
                row["bytes"] += record_bytes(c)
        return [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1], k[2]))]

    def to_report(self) -> dict[str, Any]:
        """The diagnosis report's ``collectives`` section (harness.report.model's schema)."""
        starts = [c.t_ns for rt in self.ranks.values() for c in rt.events() if c.t_ns]
        origin = min(starts) if starts else 0
        events: dict[str, list[dict[str, Any]]] = {}
        for rank, rt in sorted(self.ranks.items()):
            rows = []
            for c in rt.events():
                row = {
                    "seq": c.seq, "op": c.op, "group": c.group_desc if c.group_desc not in ("", "undefined") else c.group,
                    "group_ranks": c.group_ranks, "shapes": c.shapes, "dtypes": c.dtypes, "reduce_op": c.reduce_op or None,
                    "peer": c.peer, "call_site": c.call_site, "step": c.step, "phase": c.phase,
                }
                if c.t_ns and origin:
                    row["start_us"] = (c.t_ns - origin) / 1000.0
                    if c.end_ns:
                        row["end_us"] = (c.end_ns - origin) / 1000.0
                rows.append(row)
            events[str(rank)] = rows
        return {"events": events, "summary": self.collective_summary()}

    def positions(self) -> dict[int, dict[int, int]]:
        """rank -> {record index -> position in :meth:`to_report`'s event list}."""
        return {
            rank: {c.index: i for i, c in enumerate(rt.events())} for rank, rt in self.ranks.items()
        }

    # -- files -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "meta": self.meta,
            "complete": self.complete,
            "ranks": {str(r): t.to_json() for r, t in sorted(self.ranks.items())},
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace as JSON at ``path`` (atomically: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        from reference.files import write_atomic

        write_atomic(path, json.dumps(self.to_json(), default=_json_default))
        self.path = str(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunTrace:
        """Read a trace: a ``trace.json`` file, a record directory holding one, or a directory
        of per-rank parts (``rank<N>.json``, written by ranks whose run failed)."""
        path = Path(path)
        if path.is_dir():
            if (path / TRACE_FILE).is_file():
                path = path / TRACE_FILE
            else:
                parts = sorted(path.glob("rank*.json"))
                if not parts:
                    raise TraceError(f"{path} holds neither {TRACE_FILE} nor per-rank parts rank<N>.json")
                trace = cls(path=str(path))
                for part in parts:
                    rt = RankTrace.from_json(_read_json(part))
                    trace.ranks[rt.rank] = rt
                trace.meta = {"world_size": next(iter(trace.ranks.values())).world_size, "parts": True}
                return trace
        if not path.is_file():
            raise TraceError(f"no trace at {path}")
        data = _read_json(path)
        if data.get("format") != TRACE_FORMAT:
            raise TraceError(f"{path}: format is {data.get('format')!r}, expected {TRACE_FORMAT!r}")
        if data.get("version") != TRACE_VERSION:
            raise TraceError(f"{path}: trace version {data.get('version')!r} is not supported (this harness reads {TRACE_VERSION})")
        ranks = {int(k): RankTrace.from_json(v) for k, v in (data.get("ranks") or {}).items()}
        return cls(ranks=ranks, meta=dict(data.get("meta") or {}), path=str(path))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TraceError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return repr(value)


def load_trace(path: str | os.PathLike[str] | None) -> RunTrace | None:
    """The :class:`~harness.tracing.RunTrace` at ``path``, or None when there is none to read
    (no path, a missing or unreadable file): the engine then works without
    the trace checks."""
    if not path:
        return None
    try:
        return RunTrace.load(path)
    except (OSError, ValueError):
        return None
