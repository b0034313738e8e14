"""Python-side collective hooks: what Flight Recorder does not record.

PyTorch's Flight Recorder (FR) records every collective a process group runs, the C++-issued
ones too (DDP's reducer, DTensor's functional collectives), with op, sequence number, shapes,
dtypes and the Python stack. It does not record, on gloo, any point-to-point op (send / recv /
``batch_isend_irecv``, which pipelining runs on), nor the peer of a p2p op or the reduce op of a
collective anywhere. These hooks add exactly that: every ``ProcessGroup`` method called from
Python (``torch.distributed``'s functions, FSDP2, pipelining, DeviceMesh) is wrapped once per
process; each call appends one :class:`PyCall` (op, group, peer, tag, shapes, dtypes, reduce op,
the first call site outside torch and the harness, and the wall-clock window of the call) to a
ring buffer. :mod:`harness.tracing.records` pairs them with FR's entries by process group
and time (FR's ``time_created_ns`` falls inside the call's window).

The cost is one Python function call, two ``time.time_ns()`` and a cached frame walk per
collective (a few microseconds; see ``tests/bench/bench_tracing.py``); nothing is added to
collectives issued from C++.

**The journal.** The ring buffer lives in the rank's memory, so a rank that dies (gloo aborts
the process on a size mismatch, a segfault, SIGKILL) takes it along. While a journal is open
(:func:`open_journal`, the launcher's worker opens one per test) each call is also written,
unbuffered, as one JSON line to a file, before the call can block: the launcher reads a dead
rank's collectives back from it (:func:`harness.launch.worker.read_journal`), numbered per group as
Flight Recorder numbers them (on from the group's sequence number when the journal opened).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.frames import user_frame

__all__ = [
    "DEFAULT_LOG_SIZE",
    "PyCall",
    "calls_since",
    "close_journal",
    "group_info",
    "install",
    "installed",
    "mark",
    "open_journal",
    "set_phase",
]

DEFAULT_LOG_SIZE = 50_000

# ProcessGroup method -> (canonical op, index of the argument holding this rank's input
# tensors, p2p direction or "").
_METHODS: dict[str, tuple[str, int, str]] = {
    "allreduce": ("all_reduce", 0, ""),
    "allreduce_coalesced": ("all_reduce_coalesced", 0, ""),
    "broadcast": ("broadcast", 0, ""),
    "allgather": ("all_gather", 1, ""),
    "_allgather_base": ("all_gather_into_tensor", 1, ""),
    "all_gather_single": ("all_gather_into_tensor", 1, ""),
    "allgather_coalesced": ("all_gather_coalesced", 1, ""),
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", 1, ""),
    "reduce": ("reduce", 0, ""),
    "gather": ("gather", 1, ""),
    "scatter": ("scatter", 0, ""),
    "reduce_scatter": ("reduce_scatter", 1, ""),
    "_reduce_scatter_base": ("reduce_scatter_tensor", 1, ""),
    "reduce_scatter_single": ("reduce_scatter_tensor", 1, ""),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", 1, ""),
    "alltoall": ("all_to_all", 1, ""),
    "alltoall_base": ("all_to_all_single", 1, ""),
    "all_to_all_single": ("all_to_all_single", 1, ""),
    "barrier": ("barrier", -1, ""),
    "send": ("send", 0, "send"),
    "recv": ("recv", 0, "recv"),
    "recv_anysource": ("recv", 0, "recv"),
}


@dataclass
class PyCall:
    """One ``ProcessGroup`` method call seen from Python.

    ``t0_ns`` / ``t1_ns`` bracket the call (``time.time_ns()``, the clock FR's
    ``time_created_ns`` uses). ``peer`` is the peer's *global* rank for p2p ops (None for a
    receive from any source); ``p2p_seq`` counts this rank's ops of that direction towards that
    peer on that group, from 1."""

    index: int
    op: str
    pg_name: str
    t0_ns: int
    t1_ns: int
    shapes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    peer: int | None = None
    tag: int = 0
    p2p_seq: int = 0
    call_site: str = ""
    _reduce: str = ""

    @property
    def reduce_op(self) -> str:
        """"sum", "avg", "max", ... ("" for ops that do not reduce or when unknown)."""
        return self._reduce


_LOG: deque[tuple] = deque(maxlen=DEFAULT_LOG_SIZE)  # raw tuples, see _log / _to_call
_COUNTER = itertools.count(1)
_LAST_INDEX = 0
_P2P_COUNTS: dict[tuple[str, str, int | None, int], int] = {}
_GROUPS: dict[str, tuple[list[int], str]] = {}
_LOCK = threading.Lock()
_INSTALLED = False
# torch.Tensor's isinstance goes through a Python metaclass hook (microseconds); its C base
# class answers the same question at C speed.
_TENSOR = getattr(torch._C, "TensorBase", torch.Tensor)
# Arguments that are data, never the options holding a reduce op (and must not be kept alive).
_NOT_OPTIONS = (_TENSOR, list, tuple)


def installed() -> bool:
    return _INSTALLED


def mark() -> int:
    """An opaque position: :func:`calls_since` with it returns the calls made after now."""
    return _LAST_INDEX


def calls_since(position: int = 0) -> list[PyCall]:
    """Logged calls newer than ``position`` (oldest first)."""
    raw = list(_LOG)  # a snapshot (deque iteration is not safe against concurrent appends)
    return [_to_call(r) for r in raw if r[0] > position]


def group_info(pg_name: str) -> tuple[list[int], str] | None:
    """(global ranks, description) of a process group of this process, by its name: one the
    hooks have seen, else one c10d still knows (groups used only from C++, e.g. by DDP)."""
    found = _GROUPS.get(pg_name)
    if found is not None:
        return found
    try:
        from torch.distributed import distributed_c10d as c10d

        for pg, name in list(c10d._world.pg_names.items()):
            if name == pg_name:
                _pg_name(pg)
                return _GROUPS.get(pg_name)
    except Exception:  # noqa: BLE001 - torch without distributed, or no group yet
        return None
    return None


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, _TENSOR):
        return [value]
    out: list[Any] = []
    if isinstance(value, (list, tuple)):
        for item in value:
            out.extend(_tensors(item))
    return out


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _reduce_op(candidates: tuple) -> str:
    """The reduce op among a call's option arguments (options object, ReduceOp or RedOpType)."""
    for value in candidates:
        op = getattr(value, "reduceOp", None)  # AllreduceOptions, ReduceOptions, ...
        if op is None and type(value).__name__ in ("ReduceOp", "RedOpType"):
            op = value
        if op is not None:
            inner = getattr(op, "op", op)  # ReduceOp -> RedOpType
            return str(getattr(inner, "name", inner)).lower()
    return ""


def _ranks_of(pg: Any) -> list[int]:
    from torch.distributed import distributed_c10d as c10d

    try:
        mapping = c10d._world.pg_group_ranks.get(pg)
    except Exception:  # noqa: BLE001 - a diagnostic aid must never break the call
        mapping = None
    if mapping:
        return [g for g, _ in sorted(mapping.items(), key=lambda kv: kv[1])]
    try:
        return list(range(pg.size()))
    except Exception:  # noqa: BLE001
        return []


def _pg_name(pg: Any) -> str:
    try:
        name = pg.group_name
    except Exception:  # noqa: BLE001
        name = str(id(pg))
    if name not in _GROUPS:
        try:
            desc = pg.group_desc
        except Exception:  # noqa: BLE001
            desc = ""
        _GROUPS[name] = (_ranks_of(pg), desc)
    return name


def _wrap(method: str, original: Callable[..., Any]) -> Callable[..., Any]:
    op, input_index, direction = _METHODS[method]

    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.time_ns()
        try:  # what the ring buffer and the journal both need, read once
            seen = (_pg_name(self), _tensors(args[input_index]) if 0 <= input_index < len(args) else [],
                    user_frame(sys._getframe(1)))  # the torch.distributed function, then outward
        except Exception:  # noqa: BLE001 - tracing must never break the user's collective
            seen = None
        if _JOURNAL_FD is not None and seen is not None:
            try:
                _journal(*seen, op, direction, method, args, kwargs, t0)
            except Exception:  # noqa: BLE001
                pass
        result = original(self, *args, **kwargs)
        t1 = time.time_ns()
        if seen is not None:
            try:
                _log(*seen, op, direction, method, args, kwargs, t0, t1)
            except Exception:  # noqa: BLE001
                pass
        return result

    traced.__name__ = method
    traced.__qualname__ = f"ProcessGroup.{method}"
    traced.__doc__ = original.__doc__
    traced.__wrapped__ = original  # type: ignore[attr-defined]
    return traced


def _peer_and_tag(method: str, args: tuple, ranks: list[int]) -> tuple[int | None, int]:
    """A p2p call's peer as a *global* rank (None: any source) and its tag."""
    if method == "recv_anysource":
        return None, int(args[1]) if len(args) > 1 else 0
    group_peer = int(args[1]) if len(args) > 1 else None
    tag = int(args[2]) if len(args) > 2 else 0
    return (ranks[group_peer] if group_peer is not None and group_peer < len(ranks) else group_peer), tag


def _log(
    name: str, tensors: list[Any], frame: Any, op: str, direction: str, method: str, args: tuple, kwargs: dict,
    t0: int, t1: int,
) -> None:
    """The hot path: append one raw tuple (no strings formatted, no tensors kept)."""
    global _LAST_INDEX
    extra: Any = None
    if direction:
        peer, tag = _peer_and_tag(method, args, _GROUPS[name][0])
        key = (name, direction, peer, tag)
        with _LOCK:
            seq = _P2P_COUNTS[key] = _P2P_COUNTS.get(key, 0) + 1
        extra = (peer, tag, seq)
    elif op.startswith(("all_reduce", "reduce")):
        # Reading a ReduceOp out of its pybind options object costs microseconds: keep the
        # options (never the tensors) and read them when the log is read.
        extra = tuple(v for v in (*args[1:], *kwargs.values()) if not isinstance(v, _NOT_OPTIONS))
    index = _LAST_INDEX = next(_COUNTER)
    _LOG.append((index, op, name, t0, t1, [t.shape for t in tensors], [t.dtype for t in tensors],
                 frame.f_code, frame.f_lineno, direction, extra))


def _to_call(raw: tuple) -> PyCall:
    index, op, name, t0, t1, shapes, dtypes, code, lineno, direction, extra = raw
    call = PyCall(
        index=index, op=op, pg_name=name, t0_ns=t0, t1_ns=t1,
        shapes=[list(s) for s in shapes], dtypes=[_dtype_name(d) for d in dtypes],
        call_site=f"{code.co_filename}:{lineno} in {code.co_name}",
    )
    if direction:
        call.peer, call.tag, call.p2p_seq = extra
    elif extra is not None:
        call._reduce = _reduce_op(extra)
    return call


# -- the journal: the calls on disk, for ranks that die -------------------------------------

_JOURNAL_FD: int | None = None
_JOURNAL_SEQ: dict[str, int] = {}
_PHASE = ""
_STEP: int | None = None


def set_phase(phase: str, step: int | None = None) -> None:
    """What the rank does now ("harness" for the harness's own collectives) and in which
    training step: journal lines carry both, as a tracer's records do."""
    global _PHASE, _STEP
    _PHASE, _STEP = phase, step


def open_journal(path: str, seq_base: dict[str, int] | None = None) -> None:
    """Write every call from now on to ``path`` (truncated). ``seq_base``: each group's last
    collective sequence number so far (Flight Recorder's), so journal lines number the
    group's collectives as Flight Recorder does on the ranks that live."""
    global _JOURNAL_FD
    close_journal()
    install()
    _JOURNAL_SEQ.clear()
    _JOURNAL_SEQ.update(seq_base or {})
    _JOURNAL_FD = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)


def close_journal() -> None:
    global _JOURNAL_FD
    if _JOURNAL_FD is not None:
        fd, _JOURNAL_FD = _JOURNAL_FD, None
        try:
            os.close(fd)
        except OSError:
            pass


def _journal(
    name: str, tensors: list[Any], frame: Any, op: str, direction: str, method: str, args: tuple, kwargs: dict, t0: int
) -> None:
    """One unbuffered line per call, written before the call (it may never return)."""
    ranks, desc = _GROUPS[name]
    entry: dict[str, Any] = {
        "op": op, "process_group": f"{name}:{desc or 'undefined'}", "group_ranks": ranks,
        "input_sizes": [list(t.shape) for t in tensors], "dtypes": [_dtype_name(t.dtype) for t in tensors],
        "call_site": f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}",
        "time_ns": t0, "phase": _PHASE, "step": _STEP, "state": "journal",
    }
    if direction:
        peer, tag = _peer_and_tag(method, args, ranks)
        entry.update(is_p2p=True, peer=peer, tag=tag)
    else:
        seq = _JOURNAL_SEQ[name] = _JOURNAL_SEQ.get(name, 0) + 1
        entry["seq_id"] = seq
        if op.startswith(("all_reduce", "reduce")):
            entry["reduce_op"] = _reduce_op(tuple(v for v in (*args[1:], *kwargs.values()) if not isinstance(v, _NOT_OPTIONS)))
    fd = _JOURNAL_FD
    if fd is not None:
        os.write(fd, (json.dumps(entry) + "\n").encode())


def install(log_size: int | None = None) -> None:
    """Wrap ``ProcessGroup``'s collective and p2p methods in this process (idempotent).

    ``log_size`` resizes the ring buffer (default :data:`DEFAULT_LOG_SIZE` calls)."""
    global _INSTALLED, _LOG
    if log_size is not None and log_size != _LOG.maxlen:
        with _LOCK:
            _LOG = deque(_LOG, maxlen=log_size)
    if _INSTALLED:
        return
    from torch._C._distributed_c10d import ProcessGroup

    for method in _METHODS:
        original = getattr(ProcessGroup, method, None)  # callable with an explicit self
        if original is None or hasattr(original, "__wrapped__"):
            continue
        traced = _wrap(method, original)
        traced._harness_raw = ProcessGroup.__dict__.get(method, original)  # type: ignore[attr-defined]
        setattr(ProcessGroup, method, traced)
    _INSTALLED = True


def uninstall() -> None:
    """Put the original ``ProcessGroup`` methods back (benchmarks compare with and without)."""
    global _INSTALLED
    from torch._C._distributed_c10d import ProcessGroup

    for method in _METHODS:
        raw = getattr(ProcessGroup.__dict__.get(method), "_harness_raw", None)
        if raw is not None:
            setattr(ProcessGroup, method, raw)  # pybind's own method descriptor, as it was
    _INSTALLED = False
