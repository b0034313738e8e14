"""The per-rank tracer: on each rank a :class:`Tracer` collects the run's trace
(:mod:`harness.tracing.run_trace`) cheaply: Flight Recorder keeps recording in C++, the Python
hooks (:mod:`harness.tracing.hooks`) log what FR lacks, and the tracer only notes the
wall-clock time of each step boundary; it reads FR (without stacks) and the hooks' log every
few steps, sized so neither ring buffer wraps, and once at the end. :meth:`Tracer.gather`
brings every rank's :class:`~harness.tracing.run_trace.RankTrace` to one rank as a
:class:`~harness.tracing.run_trace.RunTrace`.

A user's own data loader is traced with one line (the batches are yielded unchanged)::

    for batch in trace_samples(loader, ids=lambda b: b["id"]):
        ...

Batches are counted per tracer, across loaders and epochs: every ``micro_batches`` of them form
one step (``tracer.record_samples(step, ids, micro)`` records explicitly instead). Outside an active
:class:`Tracer` (``with Tracer(...):``; the harness opens one in ``run_strategy``) the hook
passes batches through and records nothing.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from harness.parallel_dims import is_dp_dim
from harness.tracing import hooks
from harness.tracing.records import CollectiveRecord, merge, renumber_p2p
from harness.tracing.random_ops import RandomOpLog
from harness.tracing.run_trace import RankTrace, RunTrace, TraceError, _json_default

__all__ = ["Tracer", "current_tracer", "trace_samples"]

T = TypeVar("T")

# -- the per-rank tracer ---------------------------------------------------------------------

_ACTIVE: list[Tracer] = []


def current_tracer() -> Tracer | None:
    """The innermost active :class:`Tracer` of this process, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def _fr_capacity() -> int:
    from harness.tracing import fr

    try:
        return int(os.environ.get(fr.FR_BUFFER_ENV, "0") or 0)
    except ValueError:
        return 0


class Tracer:
    """Traces this rank's collectives, groups, parameters and samples for one run.

    Use on every rank::

        with Tracer(layout=layout, model=model) as tracer:
            for step in range(steps):
                tracer.begin_step(step)
                ...                                  # training; trace_samples(...) for data
                with tracer.phase("harness"):        # ops that are not the training's own
                    ...
        trace = tracer.gather(dst=0)                 # collective; RunTrace on dst

    Per step it only notes a timestamp; Flight Recorder and the hooks' log are read every few
    steps (so neither ring buffer wraps) and at :meth:`finish`."""

    def __init__(
        self,
        *,
        layout: Any = None,
        model: Any = None,
        state: Mapping[str, Any] | None = None,
        name: str = "",
    ) -> None:
        import torch.distributed as dist

        from harness.tracing import fr

        hooks.install()
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        self.backend = str(dist.get_backend()) if initialized else ""
        self.name = name
        self.start_ns = time.time_ns()
        self._py_mark = hooks.mark()
        data = fr.dump(with_stacks=False) or {}
        entries = data.get("entries", []) or []
        self._fr_after = int(entries[-1].get("record_id", -1)) if entries else -1
        self._fr_capacity = _fr_capacity()
        self._records: list[CollectiveRecord] = []
        self._boundaries: list[tuple[int, int]] = []  # (t_ns, step)
        self._phase_marks: list[tuple[int, str]] = [(self.start_ns, "setup")]
        self._phase = "setup"
        self._user_steps = False
        self._step: int | None = None
        self._auto_batches = 0
        self._steps_since_flush = 0
        self._flush_every = 1  # until the first flush measures how many ops a step takes
        self.samples: dict[int, list[list[int]]] = {}
        self.notes: list[str] = []
        self.labels: dict[str, dict[str, set[str]]] = defaultdict(lambda: {"dims": set(), "roles": set()})
        self._layout: dict[str, Any] = {}
        self._meshes: list[Any] = []
        self._params: dict[str, dict[str, Any]] = {}
        self._groups: dict[str, dict[str, Any]] = {}
        self._finished: RankTrace | None = None
        self._random_log: RandomOpLog | None = None
        self._random_open = False
        if not self._fr_capacity:
            self.notes.append(
                "Flight Recorder is off (TORCH_FR_BUFFER_SIZE unset before the process group was "
                "created): collectives issued from C++ (DDP's reducer, DTensor) are not traced"
            )
        self.describe(layout=layout, model=model, state=state)

    # -- context -----------------------------------------------------------------------------

    def __enter__(self) -> Tracer:  # noqa: PYI034 - typing.Self needs Python 3.11
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        hooks.set_phase(_ACTIVE[-1]._phase, _ACTIVE[-1]._step) if _ACTIVE else hooks.set_phase("")

    # -- what the rank is --------------------------------------------------------------------

    def describe(self, *, layout: Any = None, model: Any = None, state: Mapping[str, Any] | None = None) -> None:
        """Record the rank's layout, its model's parameters (local shapes, DTensor meshes,
        DDP's group) and any DeviceMesh in ``state``. May be called again as things appear."""
        from harness.tracing.mesh import describe_model, is_device_mesh

        if layout is not None:
            self._layout = layout.to_json() if hasattr(layout, "to_json") else dict(layout)
        if model is not None:
            params, meshes, grad_sync_groups = describe_model(model)
            self._params.update(params)
            for mesh in meshes:
                self.add_mesh(mesh)
            for pg in grad_sync_groups:
                self.label_group(pg, role="grad-sync")
        for value in (state or {}).values():
            if is_device_mesh(value):
                self.add_mesh(value)
        self._snapshot_groups()

    def add_mesh(self, mesh: Any) -> None:
        """Record a DeviceMesh and label its groups with its dim names."""
        if any(m is mesh for m in self._meshes):
            return
        self._meshes.append(mesh)
        for dim in mesh.mesh_dim_names or ():
            try:
                pg = mesh.get_group(dim)
            except Exception:  # noqa: BLE001 - a rank outside this mesh
                continue
            self.label_group(pg, dim=dim, role="grad-sync" if is_dp_dim(dim) else None)

    def label_group(self, pg: Any, *, dim: str | None = None, role: str | None = None) -> None:
        """Say what a hand-built process group is for: the mesh ``dim`` it spans (checked
        against the mesh by ``check_mesh``) and/or a ``role`` ("grad-sync": it synchronizes
        data-parallel gradients, so its ranks must hold the same shard)."""
        name = _group_name(pg)
        if dim:
            self.labels[name]["dims"].add(dim)
        if role:
            self.labels[name]["roles"].add(role)
        self._snapshot_groups()

    def _snapshot_groups(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        try:
            pgs = list(c10d._world.pg_names.items())
        except Exception:  # noqa: BLE001
            pgs = []
        for pg, name in pgs:
            if name in self._groups:
                continue
            try:
                ranks = [g for g, _ in sorted(c10d._world.pg_group_ranks[pg].items(), key=lambda kv: kv[1])]
                desc = pg.group_desc
            except Exception:  # noqa: BLE001
                continue
            self._groups[name] = {"ranks": ranks, "desc": desc}

    # -- steps, phases and samples -----------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Collectives from now on belong to ``step`` (until the next call)."""
        self._user_steps = True
        self._advance(step)

    def _advance(self, step: int) -> None:
        if self._finished is not None:
            raise TraceError(f"begin_step({step}) after finish()")
        if self._step is not None and step != self._step:
            self._steps_since_flush += 1
            if self._steps_since_flush >= self._flush_every:
                self.flush()
        self._step = step
        hooks.set_phase(self._phase, step)
        self._boundaries.append((time.time_ns(), step))
        if self._phase == "setup":
            self.set_phase("train")

    def log_random_ops(self, on: bool) -> None:
        """Start (``on``) or stop fingerprinting the random ops this rank runs
        (:mod:`harness.tracing.random_ops`); the harness logs the first training step."""
        if on and not self._random_open:
            self._random_log = self._random_log or RandomOpLog()
            self._random_log.__enter__()
            self._random_open = True
        elif not on and self._random_open:
            assert self._random_log is not None
            self._random_log.__exit__(None, None, None)
            self._random_open = False

    def set_phase(self, phase: str) -> None:
        """Name what the rank does from now on: "train" (the training's own ops), "harness"
        (recording, gathering: excluded from checks' reports and summaries), or any label."""
        self._phase = phase
        self._phase_marks.append((time.time_ns(), phase))
        hooks.set_phase(phase, self._step)  # the journal's lines carry both too

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        previous = self._phase
        self.set_phase(phase)
        try:
            yield
        finally:
            self.set_phase(previous)

    def record_samples(self, step: int, ids: Iterable[int], micro: int | None = None) -> None:
        """This rank consumed ``ids`` in micro-batch ``micro`` (default: the next one) of ``step``."""
        micros = self.samples.setdefault(int(step), [])
        index = len(micros) if micro is None else int(micro)
        while len(micros) <= index:
            micros.append([])
        micros[index] = [int(i) for i in ids]

    def record_batch(self, ids: Iterable[int], micro_batches: int = 1) -> None:
        """One batch of a traced loader: batches are counted per tracer (across loaders and
        epochs), every ``micro_batches`` of them make one step. Unless the training calls
        :meth:`begin_step` itself, a step's first batch also starts the step for collectives."""
        n = self._auto_batches
        self._auto_batches += 1
        step, micro = divmod(n, max(1, micro_batches))
        if micro == 0 and not self._user_steps:
            self._advance(step)
        self.record_samples(step, ids, micro)

    # -- reading FR and the hooks --------------------------------------------------------------

    def flush(self, *, with_stacks: bool | None = None) -> None:
        """Read what FR and the hooks recorded since the last flush into this trace.

        ``with_stacks``: None (default) symbolizes FR's stacks only when collectives issued
        from C++ need a call site; True / False force it on / off."""
        from harness.tracing import fr

        data = fr.dump(with_stacks=bool(with_stacks)) or {}
        raw = [e for e in data.get("entries", []) or [] if int(e.get("record_id", -1)) > self._fr_after]
        raw = [e for e in raw if int(e.get("time_created_ns") or 0) >= self.start_ns]
        all_ids = [int(e.get("record_id", -1)) for e in data.get("entries", []) or []]
        if all_ids and self._fr_after >= 0 and min(all_ids) > self._fr_after + 1:
            self.notes.append(
                f"Flight Recorder's ring buffer wrapped: {min(all_ids) - self._fr_after - 1} entries were lost "
                f"(raise {fr.FR_BUFFER_ENV}, now {self._fr_capacity})"
            )
        calls = [c for c in hooks.calls_since(self._py_mark) if c.t0_ns >= self.start_ns]
        if calls and self._py_mark and calls[0].index > self._py_mark + 1:
            self.notes.append(f"the Python hooks' log wrapped: {calls[0].index - self._py_mark - 1} calls were lost")
        records = merge(data, raw, calls, rank=self.rank)
        unsited = {r.fr_id for r in records if r.source == "fr" and not r.call_site}
        if unsited and with_stacks is None:
            # Issued from C++ (DDP's reducer, DTensor): no Python call of ours saw them, so
            # FR's own stack (symbolized only now, only when needed) gives the call site.
            stacked = fr.dump(with_stacks=True) or {}
            frames = {e.get("record_id"): e.get("frames") or [] for e in stacked.get("entries", []) or [] if e.get("record_id") in unsited}
            for r in records:
                if r.fr_id in frames:
                    r.call_site = fr.call_site_of(frames[r.fr_id])
        self.attribute(records)
        self._records.extend(records)
        if raw:
            self._fr_after = max(int(e.get("record_id", -1)) for e in raw)
        elif all_ids:
            self._fr_after = max(self._fr_after, max(all_ids))
        if calls:
            self._py_mark = calls[-1].index
        self._adapt(len(records))
        self._snapshot_groups()

    def _adapt(self, new_records: int) -> None:
        steps = max(1, self._steps_since_flush)
        per_step = max(1, new_records // steps)
        room = min(self._fr_capacity or hooks.DEFAULT_LOG_SIZE, hooks.DEFAULT_LOG_SIZE) // 4
        self._flush_every = max(1, room // per_step)
        self._steps_since_flush = 0

    def attribute(self, records: list[CollectiveRecord]) -> None:
        """Set each record's step and phase from when it was issued."""
        times = [t for t, _ in self._boundaries]
        ptimes = [t for t, _ in self._phase_marks]
        for r in records:
            i = bisect.bisect_right(times, r.t_ns) - 1
            r.step = self._boundaries[i][1] if i >= 0 else None
            j = bisect.bisect_right(ptimes, r.t_ns) - 1
            r.phase = self._phase_marks[j][1] if j >= 0 else "setup"

    # -- the result ------------------------------------------------------------------------------

    def finish(self, *, complete: bool = True) -> RankTrace:
        """Local: read what is left and return this rank's trace (idempotent)."""
        if self._finished is not None:
            return self._finished
        self.log_random_ops(False)
        self.flush()
        records = sorted(self._records, key=lambda r: r.t_ns)
        for i, r in enumerate(records):
            r.index = i
        renumber_p2p(records)  # counted from this tracer's start, alike on every rank
        groups = {}
        for name, info in self._groups.items():
            labels = self.labels.get(name)
            groups[name] = {
                **info,
                "dims": sorted(labels["dims"]) if labels else [],
                "roles": sorted(labels["roles"]) if labels else [],
            }
        for name, labels in self.labels.items():
            if name not in groups:
                found = hooks.group_info(name)
                groups[name] = {"ranks": found[0] if found else [], "desc": found[1] if found else "",
                                "dims": sorted(labels["dims"]), "roles": sorted(labels["roles"])}
        from harness.tracing.mesh import describe_mesh

        self._finished = RankTrace(
            rank=self.rank,
            world_size=self.world_size,
            backend=self.backend,
            layout=self._layout,
            device_meshes=[describe_mesh(m) for m in self._meshes],
            groups=groups,
            params=self._params,
            samples=self.samples,
            collectives=records,
            notes=list(dict.fromkeys(self.notes)),
            complete=complete,
            random_ops=list(self._random_log.draws) if self._random_log is not None else [],
        )
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        return self._finished

    def gather(self, dst: int = 0, *, meta: Mapping[str, Any] | None = None) -> RunTrace | None:
        """Collective: every rank's trace to ``dst`` (returned there, None elsewhere)."""
        import torch.distributed as dist

        mine = self.finish()
        payload = mine.to_json()
        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            parts = [payload]
        else:
            parts = [None] * self.world_size if self.rank == dst else None
            dist.gather_object(payload, parts, dst=dst)
        if self.rank != dst:
            return None
        assert parts is not None
        ranks = {int(p["rank"]): RankTrace.from_json(p) for p in parts if p is not None}
        return RunTrace(ranks=ranks, meta={"world_size": self.world_size, "name": self.name, **(meta or {})})

    def save_part(self, directory: str | os.PathLike[str]) -> Path:
        """Local: write this rank's trace alone as ``<directory>/rank<N>.json`` (after a
        failure, when the ranks can no longer gather)."""
        rt = self.finish(complete=False) if self._finished is None else self._finished
        path = Path(directory) / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        from reference.files import write_atomic

        return write_atomic(path, json.dumps(rt.to_json(), default=_json_default))


def _group_name(pg: Any) -> str:
    if isinstance(pg, str):
        return pg
    return str(pg.group_name)


# -- the one-line hook for a user's data loader -----------------------------------------------


def _default_ids(batch: Any) -> list[int]:
    for attr in ("ids", "id", "sample_ids"):
        value = getattr(batch, attr, None)
        if value is not None:
            return _as_ids(value)
    if isinstance(batch, Mapping):
        for key in ("ids", "id", "sample_ids", "idx", "index"):
            if key in batch:
                return _as_ids(batch[key])
    raise TraceError(
        f"trace_samples: cannot find sample ids in a batch of type {type(batch).__name__}; pass "
        "ids=<function batch -> ids>, e.g. ids=lambda b: b['id'] (batches with .ids or a 'id'/'ids' "
        "key are found without it)"
    )


def _as_ids(value: Any) -> list[int]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (int,)) and not isinstance(value, bool):
        return [int(value)]
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError):
        raise TraceError(f"trace_samples: sample ids must be ints or a sequence of ints, got {value!r}") from None


def trace_samples(
    loader: Iterable[T],
    ids: Callable[[T], Any] | None = None,
    *,
    micro_batches: int = 1,
    tracer: Tracer | None = None,
) -> Iterator[T]:
    """Yield ``loader``'s batches unchanged, recording each batch's sample ids on this rank.

    ``ids(batch)`` returns the ids (ints, a list, or a tensor); by default ``batch.ids`` or
    ``batch["id"]`` / ``batch["ids"]``. Batches are counted per tracer (across loaders and
    epochs); every ``micro_batches`` of them make one step."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise TraceError(f"trace_samples: micro_batches must be a positive int, got {micro_batches!r}")
    get = ids or _default_ids
    for batch in loader:
        active = tracer or current_tracer()
        if active is not None:
            active.record_batch(_as_ids(get(batch)) if ids is not None else get(batch), micro_batches)
        yield batch
