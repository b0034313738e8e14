"""Process-tree plumbing for rank workers: kill a whole tree, never leave an orphan."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as an interrupt is: the launcher's Ctrl-C cleanup
    (rank trees killed, what was recorded named) runs for it too."""

    exit_code = 128 + signal.SIGTERM


def terminate_as_interrupt() -> Callable[[], None]:
    """From now on SIGTERM raises :class:`Terminated` in the main thread, where SIGTERM still
    has its default action (ended on the spot, with the ranks' trees left to notice their
    launcher is gone); a handler someone else installed is kept. Returns the restorer."""
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def raise_terminated(signum: int, frame: Any) -> None:
        raise Terminated(f"terminated by signal {signum} (SIGTERM)")

    signal.signal(signal.SIGTERM, raise_terminated)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is raise_terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    return restore


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the process that started it dies.

    This is the backstop for a launcher that is itself killed (SIGKILL, OOM) and gets no
    chance to clean up. Elsewhere it is a no-op; the control-channel EOF check still applies.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def become_subreaper() -> None:
    """Make this process the reaper of its orphaned descendants (Linux): a process whose
    parent dies - a rank's child when the rank crashes - is re-parented here, not to init,
    so it stays in this process's tree and :func:`kill_tree` still finds it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def kill_tagged(entry: str) -> list[int]:
    """SIGKILL every process (but this one) whose environment holds ``entry`` ("NAME=value")
    and return their pids: the descendants of a pool's ranks that left its process tree (a
    child started in its own session, re-parented to init) still carry the pool's tag.
    Reads /proc; elsewhere it finds nothing."""
    needle = entry.encode() + b"\0"
    killed: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return killed
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            continue
        if environ.startswith(needle) or b"\0" + needle in environ:
            try:
                os.kill(int(name), signal.SIGKILL)
                killed.append(int(name))
            except (ProcessLookupError, PermissionError):
                pass
    return killed


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return children
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        # The command name may hold spaces and parentheses: the ppid follows the last ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) >= 2:
            children.setdefault(int(fields[1]), []).append(int(name))
    return children


def descendants(pid: int, tree: dict[int, list[int]] | None = None) -> list[int]:
    """All live descendants of ``pid`` (children first), read from /proc (or ``tree``, a
    :func:`_children_map` already read)."""
    tree = _children_map() if tree is None else tree
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in tree.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_of(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # After the ")" of the command name: state is field 3, utime and stime are fields 14 and 15,
    # cutime and cstime (the children it has waited for: a compiler it ran and reaped) 16 and 17.
    return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / _CLOCK_TICKS


def cpu_seconds(pid: int, tree: dict[int, list[int]] | None = None) -> float:
    """CPU time used so far by ``pid``, its live descendants (all threads) and the children they
    have reaped, from /proc: how a rank shows progress whatever it is doing - computing itself,
    or in a subprocess (a framework building its C++ extension with ninja / g++), or not
    (blocked in a collective, sleeping, waiting on a lock). ``tree``: a children map read once
    for several calls."""
    return _cpu_of(pid) + sum(_cpu_of(child) for child in descendants(pid, tree))


def cpu_seconds_of(pids: list[int]) -> dict[int, float]:
    """:func:`cpu_seconds` of each of ``pids``, from one read of the process table."""
    tree = _children_map()
    return {pid: cpu_seconds(pid, tree) for pid in pids}


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group (workers lead their own session) and all descendants."""
    victims = [pid, *descendants(pid)]
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def describe_exit(returncode: int | None) -> str:
    """'exit code 3', 'killed by signal 11 (SIGSEGV)' or 'still running'."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-returncode} ({name})"
    return f"exit code {returncode}"


def wait_gone(pids: list[int], timeout: float) -> bool:
    """Wait until none of ``pids`` exists (zombies of our own children count as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return True
        time.sleep(0.02)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[-1].split()[0]
        return state != b"Z"
    except (OSError, IndexError):
        return False


LONG_LINE = 300  # a tail's line is cut to this many characters


def tail_of(path: str, limit: int = 4000) -> str:
    """The last ``limit`` characters of a log file, decoded, each line cut to ``LONG_LINE``
    (a crashing interpreter's one-line list of extension modules would otherwise fill the
    tail and push out its last words); '' when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 4 * limit))
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line if len(line) <= LONG_LINE else f"{line[:LONG_LINE]} ... ({len(line) - LONG_LINE} more characters)"
             for line in text.split("\n")]
    return "\n".join(lines)[-limit:]
