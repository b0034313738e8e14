"""This rank's collectives since a mark, as it reports them when the launcher asks (a hang,
an abort): Flight Recorder's entries (:mod:`harness.tracing.fr`) merged with the Python
hooks' calls (:mod:`harness.tracing.hooks`) into the launcher protocol's ``CollectiveEntry``
rows. The worker marks each test's start with :func:`last_record_id`."""

from __future__ import annotations

import time

from harness.launch.protocol import CollectiveEntry
from harness.tracing import fr, hooks, records
from harness.tracing.tracer import current_tracer

__all__ = ["last_record_id", "read_entries", "seq_ids_at_last_mark"]

# after_record_id handed out by last_record_id() -> (wall clock, Python hook position) at that
# moment, so read_entries(after_record_id) can cut the Python-side log at the same point.
_MARKS: dict[int, tuple[int, int]] = {}
_LAST_SEQS: dict[str, int] = {}


def read_entries(after_record_id: int = -1, with_stacks: bool | None = None) -> list[CollectiveEntry]:
    """Collectives and p2p ops of this rank, oldest first: FR's entries with a record id above
    ``after_record_id`` merged with the Python hooks' calls since :func:`last_record_id`
    returned that id.

    Returns what the Python hooks saw when Flight Recorder is off or unavailable.
    ``with_stacks``: True symbolizes FR's stacks, False never does (call sites then come from
    the hooks only, which see every collective issued from Python); None (default) symbolizes
    only when an entry has no Python call to take its call site from (a collective issued from
    C++, such as DDP's reducer). Symbolizing costs seconds on a loaded machine, which a rank
    answering a hang dump does not have."""
    since_ns, py_mark = _MARKS.get(after_record_id, (0, 0))
    calls = [c for c in hooks.calls_since(py_mark) if c.t0_ns >= since_ns]

    def merged(stacks: bool) -> list[records.CollectiveRecord]:
        data = fr.dump(stacks) or {}
        raw = [e for e in data.get("entries", []) or [] if e.get("record_id", -1) > after_record_id]
        return records.merge(data, raw, calls)

    found = merged(bool(with_stacks))
    if with_stacks is None and any(r.source == "fr" and not r.call_site for r in found):
        found = merged(True)
    records.renumber_p2p(found)  # p2p ops counted from the mark, like a test's collectives
    tracer = current_tracer()
    if tracer is not None:  # a traced run: each record's step and phase ("harness" for its own)
        tracer.attribute(found)
    return [records.to_entry(r) for r in found]


def last_record_id() -> int:
    """The newest FR record id so far (-1 when nothing is recorded yet). Remembers this moment
    so that ``read_entries(<that id>)`` also cuts the Python-side log here.

    The launcher calls this as each test starts; it also installs the Python-side hooks
    (idempotent), so that p2p ops are in the ranks' dumps from the first test on."""
    hooks.install()
    data = fr.dump(with_stacks=False) or {}
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
