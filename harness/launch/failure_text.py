"""Turn what happened on each rank into the text a person reads in a failed test.

The root cause leads (the rank that failed or died first) with its full traceback; every
other rank follows as one line; on a hang each rank says where it was waiting and what its
last collectives were.
"""

from __future__ import annotations

import re

from harness.frames import is_harness_file
from harness.tracing import fr
from harness.launch.pool import RunOutcome
from harness.launch.protocol import RankDump
from harness.tracing.entries import CollectiveEntry

MAX_COLLECTIVES_SHOWN = 8


def _number(entry: CollectiveEntry) -> str:
    """'#3' for a collective, 'p2p#2 from rank 0' for a point-to-point op."""
    if not getattr(entry, "is_p2p", False) and entry.seq_id:
        return f"#{entry.seq_id}"
    peer = getattr(entry, "peer", None)
    if peer is None:
        return f"p2p#{entry.p2p_seq_id}"
    return f"p2p#{entry.p2p_seq_id} {fr.p2p_peer(entry.op, peer)}"


def where(dump: RankDump | None) -> str:
    """'in all_reduce #3 on pg 0:default_pg ranks=[0, 1] at test_x.py:12 in test_hang'."""
    if dump is None:
        return "did not answer"
    if dump.state == "unresponsive":
        return "did not answer (faulthandler stack below)"
    last = dump.collectives[-1] if dump.collectives else None
    op = dump.waiting_in
    detail = ""
    if last is not None and (not op or last.op == op or op in ("wait", "barrier")):
        op = op or last.op
        ranks = f" ranks={last.group_ranks}" if last.group_ranks is not None else ""
        detail = f" {_number(last)} on pg {last.process_group}{ranks}"
    site = fr.short_site(dump.user_site or (last.call_site if last else ""))
    if op:
        return f"in {op}{detail} at {site}" if site else f"in {op}{detail}"
    if dump.state.startswith("running"):
        return f"running, not in a collective, at {site}" if site else "running"
    return dump.state


def _root_cause(outcome: RunOutcome) -> tuple[int, str] | None:
    """(rank, 'died'|'failed') of the first failure: a death first, it usually causes the rest."""
    if outcome.deaths:
        rank = min(outcome.deaths, key=lambda r: outcome.death_times.get(r, 0.0))
        return rank, "died"
    failed = [r for r in outcome.results.values() if r.outcome == "failed"]
    if failed:
        return min(failed, key=lambda r: r.finished_at).rank, "failed"
    return None


# What the process-group backend says when ranks' collectives differ in size (gloo aborts the
# process with it), and the errors the backend raises: consequences of a collective bug or of
# another rank's failure, never the user's own error.
BACKEND_MISMATCH = ("collective mismatch", "doesn't match expected size", "does not match expected size")
_BACKEND_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
_BACKEND_TEXT = (*BACKEND_MISMATCH, "Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
                 "NCCL error", "Gloo", "gloo")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_PYTEST_FRAME = re.compile(r"^\s*(\S+\.py):(\d+): \w+", re.MULTILINE)


def _mismatch_line(text: str) -> str:
    """The first line of ``text`` in which the backend says collectives' sizes differ."""
    return next((ln.strip() for ln in text.splitlines() if any(m in ln for m in BACKEND_MISMATCH)), "")


def _is_backend_error(exc_type: str, message: str) -> bool:
    text = f"{exc_type} {message}"
    return exc_type in _BACKEND_ERRORS or any(m in text for m in _BACKEND_TEXT)


def own_exception(outcome: RunOutcome) -> str:
    """When the first failure is a rank raising an exception of its own (not a death, not the
    backend failing a collective), one line naming it: rank, type, message and the innermost
    frame outside the harness (file:line in function). Empty otherwise."""
    root = _root_cause(outcome)
    if root is None or root[1] != "failed":
        return ""
    result = outcome.results[root[0]]
    if _is_backend_error(result.exc_type, result.message):
        return ""
    # Python tracebacks ('File "x.py", line 3, in f') and pytest's ("x.py:3: RuntimeError").
    frames = _FRAME.findall(result.longrepr or "") + [(f, ln, "") for f, ln in _PYTEST_FRAME.findall(result.longrepr or "")]
    message = (result.message or "").strip().splitlines()
    first = message[0] if message else ""
    if is_internal_failure(result.exc_type, frames):
        inner = frames[-1]
        return (f"internal error of the harness (ours, not your code): rank {root[0]} raised {result.exc_type} at "
                f"{inner[0]}:{inner[1]}{f' in {inner[2]}' if inner[2] else ''}: {first}\n"
                "  What you can do: report it with this output (the traceback is below); what the run recorded before "
                "it is kept (named below), and your loop's own result is not in question.").rstrip(": ")
    own = [f for f in frames if not is_harness_file(f[0])]
    at = f" at {own[-1][0]}:{own[-1][1]}" + (f" in {own[-1][2]}" if own[-1][2] else "") if own else ""
    return f"rank {root[0]} raised {result.exc_type or 'an exception'}{at}: {first}".rstrip(": ")


def is_internal_failure(exc_type: str, frames: list[tuple[str, str, str]]) -> bool:
    """Whether an exception is the harness's own failure: Python's own exception type (an
    AttributeError, a KeyError: not one of the errors the harness raises to tell a person what
    to change, which are its own classes) raised in the harness's own code (the innermost
    frame). A user's exception, or torch's raised inside the user's call, stays theirs."""
    import builtins

    return bool(frames) and is_harness_file(frames[-1][0]) and isinstance(getattr(builtins, exc_type or "", None), type)


def backend_failure(outcome: RunOutcome) -> tuple[int, str] | None:
    """(rank, the backend's line) when the first failure is the process-group backend's: the
    first rank to die left a backend message in its output (gloo aborts a rank whose
    collective's size differs), or the first rank to fail raised a backend error. None when the
    first failure is a rank's own exception or a death the backend did not cause (a signal)."""
    root = _root_cause(outcome)
    if root is None:
        return None
    rank, kind = root
    if kind == "died":
        line = _mismatch_line(outcome.death_logs.get(rank, ""))
        return (rank, line) if line else None
    result = outcome.results[rank]
    if not _is_backend_error(result.exc_type, result.message):
        return None
    return rank, _mismatch_line(result.longrepr or result.message or "") or _first_line(result.message)


def culprits(outcome: RunOutcome) -> list[int]:
    """The ranks this report holds responsible for the failure, as its first lines name them.

    A hang or a collective the backend failed: the first diagnosis from the ranks'
    collectives - the ranks that issued a collective the others never did, the side of a
    missing collective that stands apart (a rank that never came, or the one rank waiting in a
    collective the rest never issued: the minority of the group), the minority of a mismatch.
    Otherwise the rank that died or raised first. Both sides of an even split: the evidence
    cannot tell them apart."""
    if outcome.timed_out or backend_failure(outcome) is not None:
        try:
            from harness.tracing import diagnose_hang

            found = diagnose_hang(outcome)
        except Exception:  # noqa: BLE001 - the root cause below still stands
            found = []
        if found:
            return _responsible(found[0].evidence)
    root = _root_cause(outcome)
    if root is not None:
        return [root[0]]
    return sorted(r for r, d in outcome.aborted.items() if d is None or not d.waiting_in)


def _responsible(ev: dict) -> list[int]:
    if ev.get("extra_on_ranks"):
        return sorted(ev["extra_on_ranks"])
    if ev.get("absent_ranks") is not None and ev.get("issued_by") is not None:
        absent, present = sorted(ev["absent_ranks"]), sorted(ev["issued_by"])
        if ev.get("p2p") or len(absent) < len(present):
            return absent
        return present if len(present) < len(absent) else sorted(absent + present)
    per_rank = ev.get("per_rank") or {}
    sides: dict[tuple, list[int]] = {}
    for rank, rec in per_rank.items():
        key = (rec.get("op"), str(rec.get("shapes")), str(rec.get("dtypes")), rec.get("reduce_op"))
        sides.setdefault(key, []).append(int(rank))
    if len(sides) > 1:
        smallest = min(len(v) for v in sides.values())
        minority = [r for v in sides.values() if len(v) == smallest for r in v]
        if len(minority) < len(per_rank):
            return sorted(minority)
    return sorted(int(r) for r in per_rank) or sorted(ev.get("ranks", []))


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:200]
    return ""


def _rank_line(outcome: RunOutcome, rank: int) -> str:
    if rank in outcome.deaths:
        return f"rank {rank}: died ({outcome.deaths[rank]})"
    if rank in outcome.aborted:
        return f"rank {rank}: aborted while waiting: {where(outcome.aborted[rank])}"
    result = outcome.results.get(rank)
    if result is None:
        return f"rank {rank}: no result"
    if result.outcome == "failed":
        return f"rank {rank}: also failed: {result.exc_type}: {_first_line(result.message)}"
    line = f"rank {rank}: {result.outcome}"
    finished = outcome.finished.get(rank)
    if finished is not None and outcome.aborted:
        if finished.collectives:
            last = finished.collectives[-1]
            line += (
                f", finished its test body; its last collective was {last.op} {_number(last)} "
                f"at {fr.short_site(last.call_site)}"
            )
        else:
            line += ", finished its test body without issuing a collective"
    return line


def _collectives_block(dump: RankDump) -> list[str]:
    return _entries_block(dump.collectives)


def _entries_block(entries: list[CollectiveEntry]) -> list[str]:
    if not entries:
        return ["    (no collectives recorded in this test)"]
    shown = entries[-MAX_COLLECTIVES_SHOWN:]
    lines = [f"    {fr.format_entry(e)}" for e in shown]
    if len(entries) > len(shown):
        lines.insert(0, f"    ... {len(entries) - len(shown)} earlier")
    return lines


def _dump_details(dumps: dict[int, RankDump | None]) -> list[str]:
    lines: list[str] = []
    for rank in sorted(dumps):
        dump = dumps[rank]
        if dump is None:
            continue
        lines.append(f"---- rank {rank} (pid {dump.pid}) last collectives, oldest first ----")
        lines.extend(_collectives_block(dump))
        lines.append(f"---- rank {rank} Python stack ----")
        lines.append(dump.stack.rstrip() or "    (empty)")
        if dump.stdout_tail.strip():
            lines.append(f"---- rank {rank} output so far ----")
            lines.append(dump.stdout_tail.rstrip())
    return lines


def _hang_diagnosis(outcome: RunOutcome) -> list[str]:
    """The named cause, from the ranks' collective traces (harness.tracing.diagnose_hang):
    'rank 1 is in all_reduce #17 at model.py:42; rank 0 is in broadcast #17 at train.py:88'."""
    try:
        from harness.tracing import hang_lines
    except Exception as exc:  # noqa: BLE001 - the stacks below must still be reported
        return [f"(hang diagnosis unavailable: {type(exc).__name__}: {exc})"]
    found = hang_lines(outcome)
    return [f"DIAGNOSIS {line}" for line in found]


def format_failure(outcome: RunOutcome) -> str:
    n = outcome.nproc
    lines: list[str] = []
    if outcome.timed_out:
        if outcome.stalled_s:
            lines.append(
                f"HANG: no rank still running made progress for {outcome.stalled_s:g} s (the stall window: "
                "a rank blocked in a collective, sleeping or waiting uses no CPU), so the test was stopped "
                f"before its {outcome.timeout_s:g} s deadline. Each rank's stack and last collectives were "
                "collected, then the ranks' process trees were killed."
            )
        else:
            lines.append(
                f"TIMEOUT: the test did not finish on all {n} ranks within {outcome.timeout_s:g} s "
                "(--dist-timeout, or timeout= on the distributed marker). Each rank's stack and last "
                "collectives were collected, then the ranks' process trees were killed."
            )
        lines.extend(_hang_diagnosis(outcome))
        for rank in range(n):
            if rank in outcome.aborted:
                lines.append(f"rank {rank}: {where(outcome.aborted[rank])}")
            else:
                lines.append(_rank_line(outcome, rank))
        lines.append("")
        lines.extend(_dump_details({**outcome.finished, **outcome.aborted}))
        return "\n".join(lines)

    root = _root_cause(outcome)
    if root is None:
        return "\n".join(_rank_line(outcome, r) for r in range(n))
    rank, kind = root
    if outcome.fork_server_death:
        lines.append(
            f"the rank fork server (pid {outcome.fork_server_pid}) died during the test "
            f"({outcome.fork_server_death}), and every rank with it: ranks are its children and die "
            "with their parent, so the rank deaths below are its consequence. On a rank, "
            "os.getppid() is the fork server: a signal sent there from the test body ends them all."
        )
        lines.append("")
    if backend_failure(outcome) is not None:
        # The backend failed a collective: what the ranks issued (the dead ones' journals
        # too) names which one and where, ahead of the backend's own words.
        lines.extend(_hang_diagnosis(outcome))
    if kind == "died":
        lines.append(
            f"rank {rank} died first ({outcome.deaths[rank]}), of {n} ranks. Its last output:"
        )
        lines.append(outcome.death_logs.get(rank, "").rstrip() or "    (no output)")
    else:
        result = outcome.results[rank]
        lines.append(f"rank {rank} failed first, of {n} ranks:")
        lines.append("")
        lines.append(result.longrepr.rstrip())
    lines.append("")
    others = [r for r in range(n) if r != rank]
    if others:
        lines.append("other ranks:")
        lines.extend(f"  {_rank_line(outcome, r)}" for r in others)
    if outcome.aborted:
        lines.append("")
        lines.extend(_dump_details(outcome.aborted))
    for r, entries in sorted(outcome.journals.items()):
        if entries and r in outcome.deaths:  # a dead rank's only account of its collectives
            lines.append(f"---- rank {r} last collectives (from its journal), oldest first ----")
            lines.extend(_entries_block(entries))
    return "\n".join(lines)


def rank_states(outcome: RunOutcome) -> list[dict]:
    """Where each rank is, as data, for a report built around it: its state (waiting in a
    collective, running, finished, failed, died), the op and sequence number it waits in, the
    group's ranks, the user's frame it waits at, and the last collective it completed."""
    out: list[dict] = []
    for rank in range(outcome.nproc):
        dump = outcome.aborted.get(rank) or outcome.finished.get(rank)
        row: dict = {"rank": rank, "state": "", "op": "", "seq": None, "group": "", "group_ranks": None, "site": "",
                     "last_completed": ""}
        if rank in outcome.deaths:
            row["state"] = f"died: {outcome.deaths[rank]}"
        elif rank in outcome.finished:
            row["state"] = "finished"
        elif (result := outcome.results.get(rank)) is not None and result.outcome == "failed":
            row["state"] = f"raised {result.exc_type}"
        if dump is not None:
            entries = dump.collectives or []
            pending = next((e for e in reversed(entries) if e.state != "completed"), None)
            done = next((e for e in reversed(entries) if e.state == "completed"), None)
            if dump.waiting_in or pending is not None:
                row["state"] = row["state"] or "waiting"
                if pending is not None:
                    row.update(op=pending.op, seq=pending.seq_id, group=pending.process_group, group_ranks=pending.group_ranks)
                else:
                    row["op"] = dump.waiting_in
            elif not row["state"]:
                row["state"] = "running" if dump.state.startswith("running") else dump.state
            if dump.user_site:
                row["site"] = fr.short_site(dump.user_site)
            elif pending is not None and pending.phase == "harness":
                row["site"] = "the harness's own recording (the rank finished its step's code)"
            elif pending is not None:
                row["site"] = fr.short_site(pending.call_site)
            if done is not None:
                row["last_completed"] = f"{done.op} #{done.seq_id} on {done.process_group}"
        elif not row["state"]:
            row["state"] = "did not answer"
        out.append(row)
    return out
