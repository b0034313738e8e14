"""Read PyTorch's Flight Recorder on this rank, completed by the harness's Python-side hooks.

Flight Recorder (enabled by ``TORCH_FR_BUFFER_SIZE`` before the process group is created)
records every collective issued through c10d, on gloo as well as NCCL, including those
issued from C++ such as DDP's reducer, with the Python stack that issued it. On gloo it does
not record point-to-point ops at all, and nowhere the peer of a p2p op or a collective's reduce
op: :mod:`harness.tracing.hooks` records those from Python, and :func:`read_entries` merges
both into ``CollectiveEntry`` rows (pairing a Python call with FR's entry by process group
and time). The launcher turns FR on in every rank worker.

Reading FR without stacks is cheap (well under a millisecond for a few hundred entries);
symbolizing stacks costs more the first time in a process (measured in
``tests/bench/bench_tracing.py``), so the per-run tracer reads without stacks and takes call
sites from the Python hooks, falling back to FR's stacks only for C++-issued collectives.
"""

from __future__ import annotations

import ast
import os
import pickle
import time
from typing import Any

from harness.protocol import CollectiveEntry

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
DEFAULT_FR_BUFFER = "20000"

_TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__import__("torch").__file__)))
_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))
_STDLIB_DIR = os.path.dirname(os.__file__)

# after_record_id handed out by last_record_id() -> (wall clock, Python hook position) at that
# moment, so read_entries(after_record_id) can cut the Python-side log at the same point.
_MARKS: dict[int, tuple[int, int]] = {}
_LAST_SEQS: dict[str, int] = {}


def is_library_frame(filename: str) -> bool:
    """True for frames of torch, the harness's own launcher or the standard library."""
    path = os.path.abspath(filename) if filename and not filename.startswith("<") else filename
    if not path or path.startswith("<"):
        return True
    return (
        path.startswith(os.path.join(_TORCH_DIR, "torch") + os.sep)
        or path.startswith(_HARNESS_DIR + os.sep)
        or path.startswith(_STDLIB_DIR + os.sep)
        or f"{os.sep}_pytest{os.sep}" in path
        or f"{os.sep}pluggy{os.sep}" in path
    )


def call_site_of(frames: list[dict]) -> str:
    """The first FR stack frame outside torch / the harness / the stdlib, as 'file:line in fn'."""
    for frame in frames:
        if not is_library_frame(frame.get("filename", "")):
            return f"{frame['filename']}:{frame['line']} in {frame['name']}"
    if frames:
        f = frames[0]
        return f"{f['filename']}:{f['line']} in {f['name']}"
    return ""


def _parse_ranks(text: object) -> list[int] | None:
    if isinstance(text, list):
        return [int(r) for r in text]
    try:
        value = ast.literal_eval(str(text))
        ranks = [int(r) for r in value]
    except (ValueError, SyntaxError, TypeError):
        return None
    return ranks or None


def enabled() -> bool:
    """Whether Flight Recorder was asked for in this process (it must be before the group)."""
    try:
        return int(os.environ.get(FR_BUFFER_ENV, "0") or 0) > 0
    except ValueError:
        return False


def dump(with_stacks: bool = False) -> dict[str, Any] | None:
    """FR's raw dump (``pg_config``, ``entries``...), None when unavailable in this build."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:
        return None
    try:
        return pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=with_stacks))
    except Exception:  # noqa: BLE001 - a diagnostic aid must never raise
        return None


def group_ranks_from_config(dump_data: dict[str, Any], pg_name: str, pg_desc: str) -> list[int] | None:
    """A group's ranks from FR's ``pg_config`` (filled on NCCL; empty on gloo)."""
    configs = dump_data.get("pg_config", {}) or {}
    config = configs.get(pg_name) or (configs.get("") if pg_desc == "default_pg" else None)
    return _parse_ranks(config.get("ranks")) if config else None


def read_entries(after_record_id: int = -1, with_stacks: bool = True) -> list[CollectiveEntry]:
    """Collectives and p2p ops of this rank, oldest first: FR's entries with a record id above
    ``after_record_id`` merged with the Python hooks' calls since :func:`last_record_id`
    returned that id.

    Returns what the Python hooks saw when Flight Recorder is off or unavailable.
    ``with_stacks=False`` skips symbolizing FR's stacks (call sites then come from the hooks
    only, which see every collective issued from Python)."""
    from harness.tracing import collectives, hooks

    since_ns, py_mark = _MARKS.get(after_record_id, (0, 0))
    data = dump(with_stacks) or {}
    raw = [e for e in data.get("entries", []) or [] if e.get("record_id", -1) > after_record_id]
    calls = [c for c in hooks.calls_since(py_mark) if c.t0_ns >= since_ns]
    records = collectives.merge(data, raw, calls)
    collectives.renumber_p2p(records)  # p2p ops counted from the mark, like a test's collectives
    from harness.tracing.trace import current_tracer

    tracer = current_tracer()
    if tracer is not None:  # a traced run: each record's step and phase ("harness" for its own)
        tracer.attribute(records)
    return [collectives.to_entry(r) for r in records]


def last_record_id() -> int:
    """The newest FR record id so far (-1 when nothing is recorded yet). Remembers this moment
    so that ``read_entries(<that id>)`` also cuts the Python-side log here.

    The launcher calls this as each test starts; it also installs the Python-side hooks
    (idempotent), so that p2p ops are in the ranks' dumps from the first test on."""
    from harness.tracing import hooks

    hooks.install()
    data = dump(with_stacks=False) or {}
    entries = data.get("entries", []) or []
    rid = int(entries[-1].get("record_id", -1)) if entries else -1
    _MARKS[rid] = (time.time_ns(), hooks.mark())
    _LAST_SEQS.clear()
    for e in entries:
        name = str((tuple(e.get("process_group", ("?",))) + ("?",))[0])
        if e.get("collective_seq_id"):
            _LAST_SEQS[name] = max(_LAST_SEQS.get(name, 0), int(e["collective_seq_id"]))
    if len(_MARKS) > 64:  # only the newest marks are ever asked for
        for key in list(_MARKS)[:-32]:
            _MARKS.pop(key, None)
    return rid


def seq_ids_at_last_mark() -> dict[str, int]:
    """Each process group's last collective sequence number in Flight Recorder when
    :func:`last_record_id` was last called (the journal numbers on from there)."""
    return dict(_LAST_SEQS)


def format_entry(entry: CollectiveEntry) -> str:
    if getattr(entry, "is_p2p", False):
        arrow = "to" if entry.op.startswith(("send", "isend")) else "from"
        peer = "any rank" if entry.peer is None else f"rank {entry.peer}"
        return (
            f"{entry.op} p2p#{entry.p2p_seq_id} {arrow} {peer} on pg {entry.process_group} "
            f"sizes={entry.input_sizes} at {entry.call_site}"
        )
    seq = f"#{entry.seq_id}" if entry.seq_id else f"p2p#{entry.p2p_seq_id}"
    ranks = f" ranks={entry.group_ranks}" if entry.group_ranks is not None else ""
    reduce = f" op={entry.reduce_op}" if getattr(entry, "reduce_op", "") else ""
    return (
        f"{entry.op} {seq} on pg {entry.process_group}{ranks} sizes={entry.input_sizes}{reduce} "
        f"at {entry.call_site}"
    )


def short_site(site: str) -> str:
    """A call site with its path relative to the working directory when under it."""
    if not site:
        return site
    path, sep, rest = site.partition(":")
    try:
        rel = os.path.relpath(path)
    except ValueError:
        rel = path
    if not rel.startswith(".."):
        path = rel
    return f"{path}{sep}{rest}"
