"""Read PyTorch's Flight Recorder on this rank.

Flight Recorder (enabled by ``TORCH_FR_BUFFER_SIZE`` before the process group is created)
records every collective issued through c10d, on gloo as well as NCCL, including those
issued from C++ such as DDP's reducer, with the Python stack that issued it. The launcher
turns it on in every rank worker; this module turns its dump into ``CollectiveEntry`` rows.
"""

from __future__ import annotations

import ast
import os
import pickle

from harness.protocol import CollectiveEntry

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
DEFAULT_FR_BUFFER = "20000"

_TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__import__("torch").__file__)))
_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))
_STDLIB_DIR = os.path.dirname(os.__file__)


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


def _call_site(frames: list[dict]) -> str:
    for frame in frames:
        if not is_library_frame(frame.get("filename", "")):
            return f"{frame['filename']}:{frame['line']} in {frame['name']}"
    if frames:
        f = frames[0]
        return f"{f['filename']}:{f['line']} in {f['name']}"
    return "?"


def _parse_ranks(text: object) -> list[int] | None:
    if isinstance(text, list):
        return [int(r) for r in text]
    try:
        value = ast.literal_eval(str(text))
        return [int(r) for r in value]
    except (ValueError, SyntaxError, TypeError):
        return None


def read_entries(after_record_id: int = -1, with_stacks: bool = True) -> list[CollectiveEntry]:
    """Collectives recorded on this rank with a record id above ``after_record_id``.

    Returns an empty list when Flight Recorder is off or unavailable in this build.
    ``with_stacks=False`` skips symbolizing call sites, which costs seconds the first time.
    """
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:
        return []
    try:
        dump = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=with_stacks))
    except Exception:  # noqa: BLE001 - a diagnostic aid must never raise
        return []
    configs = dump.get("pg_config", {}) or {}
    entries = []
    for raw in dump.get("entries", []) or []:
        if raw.get("record_id", -1) <= after_record_id:
            continue
        pg_name, pg_desc = (tuple(raw.get("process_group", ("?", "?"))) + ("?", "?"))[:2]
        config = configs.get(pg_name) or (configs.get("") if pg_desc == "default_pg" else None)
        ranks = _parse_ranks(config.get("ranks")) if config else None
        op = str(raw.get("profiling_name", "?"))
        entries.append(
            CollectiveEntry(
                record_id=int(raw.get("record_id", -1)),
                op=op.split(":", 1)[-1],
                process_group=f"{pg_name}:{pg_desc}",
                group_ranks=ranks,
                seq_id=int(raw.get("collective_seq_id", 0)),
                p2p_seq_id=int(raw.get("p2p_seq_id", 0)),
                input_sizes=list(raw.get("input_sizes", [])),
                state=str(raw.get("state", "")),
                call_site=_call_site(raw.get("frames", []) or []),
            )
        )
    return entries


def last_record_id() -> int:
    """The newest record id so far, -1 when nothing is recorded yet."""
    entries = read_entries(with_stacks=False)
    return entries[-1].record_id if entries else -1


def format_entry(entry: CollectiveEntry) -> str:
    seq = f"#{entry.seq_id}" if entry.seq_id else f"p2p#{entry.p2p_seq_id}"
    ranks = f" ranks={entry.group_ranks}" if entry.group_ranks is not None else ""
    return (
        f"{entry.op} {seq} on pg {entry.process_group}{ranks} sizes={entry.input_sizes} "
        f"at {entry.call_site}"
    )
