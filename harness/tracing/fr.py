"""Read PyTorch's Flight Recorder on this rank, completed by the harness's Python-side hooks.

Flight Recorder (enabled by ``TORCH_FR_BUFFER_SIZE`` before the process group is created)
records every collective issued through c10d, on gloo as well as NCCL, including those
issued from C++ such as DDP's reducer, with the Python stack that issued it. On gloo it does
not record point-to-point ops at all, and nowhere the peer of a p2p op or a collective's reduce
op: :mod:`harness.tracing.hooks` records those from Python, and :func:`harness.tracing.dump.read_entries` merges
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
from typing import Any

from harness.frames import is_library_frame

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
# Entries per rank; the launcher sets it before the process group exists (a user's own
# TORCH_FR_BUFFER_SIZE wins). A dump costs time in proportion to the entries held, and a warm
# pool's buffer fills with earlier tests' collectives: 20000 entries took 0.5 s a dump, several
# per test and rank. The tracer reads the buffer often enough to keep a quarter of it free
# between reads, and notes a loss should a single step issue more.
RANK_FR_BUFFER = "4000"

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


def p2p_peer(op: str, peer: int | None) -> str:
    """'to rank 1' for a send, 'from rank 0' / 'from any rank' for a receive."""
    arrow = "to" if op.startswith(("send", "isend")) else "from"
    return f"{arrow} {'any rank' if peer is None else f'rank {peer}'}"


def format_entry(entry: Any) -> str:
    """One ``CollectiveEntry`` (harness.tracing.entries) as a report line."""
    if getattr(entry, "is_p2p", False):
        return (
            f"{entry.op} p2p#{entry.p2p_seq_id} {p2p_peer(entry.op, entry.peer)} on pg {entry.process_group} "
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
