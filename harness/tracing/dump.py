"""This rank's collectives since a mark, as it reports them when the launcher asks (a hang,
an abort): Flight Recorder's entries (:mod:`harness.tracing.fr`) merged with the Python
hooks' calls (:mod:`harness.tracing.hooks`) into the launcher protocol's ``CollectiveEntry``
rows. The worker marks each test's start with :func:`mark_test_start`."""

from __future__ import annotations

import itertools
import time

from harness.tracing.entries import CollectiveEntry
from harness.tracing import fr, hooks, records
from harness.tracing.tracer import current_tracer

__all__ = ["mark_test_start", "read_entries", "seq_ids_at_last_mark"]

# A mark handed out by mark_test_start() -> (wall clock, Python hook position) at that moment,
# so read_entries(mark) keeps what was issued since.
_MARKS: dict[int, tuple[int, int]] = {}
_NEXT_MARK = itertools.count()
_LAST_SEQS: dict[str, int] = {}


def read_entries(since_mark: int = -1, with_stacks: bool | None = None) -> list[CollectiveEntry]:
    """Collectives and p2p ops of this rank, oldest first: FR's entries created since
    :func:`mark_test_start` returned ``since_mark`` (all of them for -1) merged with the Python
    hooks' calls since then.

    Returns what the Python hooks saw when Flight Recorder is off or unavailable.
    ``with_stacks``: True symbolizes FR's stacks, False never does (call sites then come from
    the hooks only, which see every collective issued from Python); None (default) symbolizes
    only when an entry has no Python call to take its call site from (a collective issued from
    C++, such as DDP's reducer). Symbolizing costs seconds on a loaded machine, which a rank
    answering a hang dump does not have."""
    since_ns, py_mark = _MARKS.get(since_mark, (0, 0))
    calls = [c for c in hooks.calls_since(py_mark) if c.t0_ns >= since_ns]

    def merged(stacks: bool) -> list[records.CollectiveRecord]:
        data = fr.dump(stacks) or {}
        raw = [e for e in data.get("entries", []) or [] if int(e.get("time_created_ns") or 0) >= since_ns]
        return records.merge(data, raw, calls)

    found = merged(bool(with_stacks))
    if with_stacks is None and any(r.source == "fr" and not r.call_site for r in found):
        found = merged(True)
    records.renumber_p2p(found)  # p2p ops counted from the mark, like a test's collectives
    tracer = current_tracer()
    if tracer is not None:  # a traced run: each record's step and phase ("harness" for its own)
        tracer.attribute(found)
    return [records.to_entry(r) for r in found]


def mark_test_start() -> int:
    """Mark this moment (a test starts): ``read_entries(<the mark>)`` keeps what is issued from
    now on, on FR's and the Python side. Also notes each process group's last collective
    sequence number (:func:`seq_ids_at_last_mark`) and installs the Python-side hooks
    (idempotent), so that p2p ops are in the ranks' dumps from the first test on.

    The sequence numbers come from the groups themselves (the counter FR records as
    ``collective_seq_id``), not from a dump of FR's buffer: a warm pool's buffer holds earlier
    tests' entries, and dumping it at every test start cost up to 80 ms once it was full."""
    hooks.install()
    mark = next(_NEXT_MARK)
    _MARKS[mark] = (time.time_ns(), hooks.mark())
    _LAST_SEQS.clear()
    _LAST_SEQS.update(_group_seqs())
    if len(_MARKS) > 64:  # only the newest marks are ever asked for
        for key in sorted(_MARKS)[:-32]:
            _MARKS.pop(key, None)
    return mark


def _group_seqs() -> dict[str, int]:
    """Process group name -> its collectives so far (what FR numbers them by); from a dump of
    FR where a group cannot say (a backend without the counter)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return {}
    seqs: dict[str, int] = {}
    try:
        names = dict(dist.distributed_c10d._world.pg_names)
        for group, name in names.items():
            seq = int(group._get_sequence_number_for_group())
            if seq:
                seqs[str(name)] = seq
        return seqs
    except Exception:  # noqa: BLE001 - fall back on the buffer itself
        data = fr.dump(with_stacks=False) or {}
        for e in data.get("entries", []) or []:
            name = str((tuple(e.get("process_group", ("?",))) + ("?",))[0])
            if e.get("collective_seq_id"):
                seqs[name] = max(seqs.get(name, 0), int(e["collective_seq_id"]))
        return seqs


def seq_ids_at_last_mark() -> dict[str, int]:
    """Each process group's last collective sequence number when :func:`mark_test_start` was
    last called (the journal numbers on from there)."""
    return dict(_LAST_SEQS)
