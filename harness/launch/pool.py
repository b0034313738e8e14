"""Warm pools of rank workers: spawn once, run many test bodies, never hang, never orphan.

A ``RankPool`` is N ``python -m harness.launch.worker`` processes joined in one default process group
(FileStore rendezvous: no port to race for; gloo/NCCL sockets on loopback). Every wait has a
deadline. On a hang the pool asks each rank for its stack and its last collectives, then
kills the whole process tree; a pool that saw a crash, hang or desync is never reused.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from harness import settings
from harness.frames import HARNESS_DIR
from harness.launch import procs
from harness.launch.worker import capture_path, exit_note_path, journal_path, read_exit_note, read_journal
from harness.launch.protocol import HANDSHAKE_CONTROL, HANDSHAKE_TASK, RankDump, RankResult, ResetResult, TestTask
from harness.tracing.entries import CollectiveEntry
from harness.tracing import fr

_REPO_ROOT = os.path.dirname(HARNESS_DIR)


class PoolStartError(RuntimeError):
    """The ranks could not be started or could not join the process group in time.

    ``timed_out`` is true when nothing failed but the deadline passed: the one kind of start
    failure that a busy machine explains, and that a second start may not repeat."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


MAX_RANKS_ENV = "HARNESS_MAX_RANKS"
RANKS_PER_CORE = 8  # gloo ranks of small tests share a core well; more thrash
RANK_MEMORY = 512 * 2**20  # resident memory of one rank with torch imported, with headroom


def rank_bound() -> tuple[int, str]:
    """The most ranks this machine may start at once, and why: ``$HARNESS_MAX_RANKS`` when
    set, else the smaller of 8 per CPU core and one per 0.5 GiB of memory."""
    override = os.environ.get(MAX_RANKS_ENV)
    if override is not None:
        try:
            value = int(override)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{MAX_RANKS_ENV}={override!r} is not allowed; give a whole number of ranks >= 1")
        return value, f"{MAX_RANKS_ENV}={value}"
    cores = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = RANK_MEMORY * RANKS_PER_CORE * cores
    bound = max(1, min(RANKS_PER_CORE * cores, memory // RANK_MEMORY))
    return bound, (f"{cores} CPU cores x {RANKS_PER_CORE} = {RANKS_PER_CORE * cores}, "
                   f"{memory / 2**30:.0f} GiB memory / 0.5 GiB per rank = {memory // RANK_MEMORY}")


def check_world_size(nproc: int) -> None:
    """Raise ValueError for a world size below 1 or beyond :func:`rank_bound` (before any rank
    forks)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"a world size must be an int >= 1, got {nproc!r}")
    bound, why = rank_bound()
    if nproc > bound:
        raise ValueError(
            f"{nproc} ranks exceed this machine's bound of {bound} ({why}); set {MAX_RANKS_ENV}=N "
            "to allow more, or use a smaller world size"
        )


@dataclass(frozen=True)
class PoolKey:
    nproc: int
    backend: str
    device: str


@dataclass
class PoolConfig:
    startup_timeout: float = settings.STARTUP_TIMEOUT_S
    failure_grace: float = settings.FAILURE_GRACE_S  # how long the other ranks get to finish once one has failed
    dump_timeout: float = 5.0
    reset_timeout: float = 30.0
    pg_timeout: float = 1800.0
    # A test counts as hung once every rank still running has made no progress for this long
    # (0: off, only the deadline): see RankPool.run.
    stall_window: float = settings.STALL_WINDOW_S


# A rank "makes progress" while it uses CPU: computing ranks use about a core, ranks blocked in
# a collective, sleeping or waiting on a lock about 0.2% (gloo's threads). 1% of a core over
# the window separates the two with room on both sides.
STALL_CPU_FRACTION = 0.01
STALL_SAMPLE_S = 1.0
# How many dump_timeouts a rank still working on its dump may take to answer (see RankPool.dump).
DUMP_PATIENCE = 6
# A rank connects and sends its handshake in one go; an accepted connection that has not sent a
# whole one this long after it was accepted is not a rank (see RankPool._accept).
HANDSHAKE_TIMEOUT_S = 10.0
HANDSHAKE_MAX_BYTES = 64


@dataclass
class RunOutcome:
    """What happened on each rank for one test."""

    nproc: int
    results: dict[int, RankResult] = field(default_factory=dict)
    deaths: dict[int, str] = field(default_factory=dict)  # rank -> "killed by signal 11 (SIGSEGV)"
    death_times: dict[int, float] = field(default_factory=dict)
    death_logs: dict[int, str] = field(default_factory=dict)
    timed_out: bool = False
    timeout_s: float = 0.0
    stalled_s: float = 0.0  # > 0: ended early because no running rank made progress for this long
    aborted: dict[int, RankDump | None] = field(default_factory=dict)  # killed by us, with dump
    # Ranks that died or failed: the collectives their journal holds (harness.tracing.hooks).
    journals: dict[int, list[CollectiveEntry]] = field(default_factory=dict)
    finished: dict[int, RankDump | None] = field(default_factory=dict)  # done when others hung
    # The rank fork server died during the test ("killed by signal 9"), taking every rank along.
    fork_server_death: str = ""
    fork_server_pid: int = 0
    pool_replaced: bool = False
    replace_reason: str = ""

    @property
    def failed(self) -> bool:
        return (
            self.timed_out
            or bool(self.deaths)
            or bool(self.aborted)
            or any(r.outcome == "failed" for r in self.results.values())
        )

    @property
    def all_skipped(self) -> bool:
        return len(self.results) == self.nproc and all(
            r.outcome == "skipped" for r in self.results.values()
        )


class Zygote:
    """Handle on the fork server (``harness.launch.zygote``) that starts rank processes."""

    def __init__(self, startup_timeout: float, log_path: str) -> None:
        ours, theirs = socket.socketpair()
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "harness.launch.zygote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=_worker_base_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        theirs.close()
        _LIVE_PIDS.add(self.proc.pid)
        self.log_path = log_path
        self.conn = Connection(ours.detach())
        self.startup_timeout = startup_timeout
        self._ready = False

    @property
    def ready(self) -> bool:
        """Whether the fork server has said it is ready (:meth:`wait_ready` returned)."""
        return self._ready

    def wait_ready(self) -> "Zygote":
        """Block until the fork server has imported what ranks need (it started importing
        when this handle was made, so a session can overlap that with collection)."""
        if self._ready:
            return self
        if not self.conn.poll(self.startup_timeout):
            self.close()
            raise PoolStartError(
                f"the rank fork server did not start within {self.startup_timeout:.0f} s:\n{_tail(self.log_path)}"
            )
        try:
            self.conn.recv()
        except (EOFError, OSError):
            self.close()
            raise PoolStartError(f"the rank fork server failed to start:\n{_tail(self.log_path)}") from None
        self._ready = True
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _ask(self, *request: Any) -> Any:
        self.conn.send(request)
        if not self.conn.poll(30):
            raise PoolStartError(f"the rank fork server stopped answering:\n{_tail(self.log_path)}")
        return self.conn.recv()[1]

    def spawn(self, env: dict[str, str], log_path: str, cwd: str) -> int:
        return int(self._ask("spawn", env, log_path, cwd))

    def status(self, pid: int) -> int | None:
        try:
            return self._ask("status", pid)
        except (OSError, EOFError, PoolStartError):
            return None

    def preimported(self) -> list[str]:
        """The modules of ``zygote.PREIMPORTS`` the fork server has imported so far (it imports
        them while idle, after it said it was ready): what a rank forked now inherits."""
        return list(self._ask("preimported"))

    def close(self) -> None:
        self.conn.close()
        procs.kill_tree(self.proc.pid)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _LIVE_PIDS.discard(self.proc.pid)


class _RankProcess:
    """A rank's OS process, started by the fork server or by a plain spawn."""

    def __init__(self, pid: int, zygote: Zygote | None = None, popen: subprocess.Popen | None = None) -> None:
        self.pid = pid
        self.zygote = zygote
        self.popen = popen
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self.popen is not None:
            self.returncode = self.popen.poll()
        elif not procs._alive(self.pid):
            status = self.zygote.status(self.pid) if self.zygote is not None else None
            self.returncode = status if status is not None else -9
        return self.returncode

    def wait(self, timeout: float) -> None:
        procs.wait_gone([self.pid], timeout)
        self.poll()


def _worker_base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Rank:
    def __init__(self, rank: int, proc: _RankProcess, log_path: str) -> None:
        self.rank = rank
        self.proc = proc
        self.log_path = log_path
        self.task: Connection | None = None
        self.control: Connection | None = None
        try:
            self.exit_fd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self.exit_fd = None

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def wait_handles(self) -> list[Any]:
        handles: list[Any] = [self.task] if self.task is not None else []
        if self.exit_fd is not None:
            handles.append(self.exit_fd)
        return handles


class _StallWatch:
    """Whether every rank still running has used almost no CPU for the stall window (blocked in
    a collective, sleeping, waiting): a hang, named in seconds instead of at the deadline. A
    slow rank that computes keeps using CPU and is never called stalled."""

    def __init__(self, window: float, pids: dict[int, int], started: float) -> None:
        self.window = window
        self.pids = pids
        self.samples: dict[int, list[tuple[float, float]]] = {rank: [] for rank in pids}
        self.started = started
        self.last_sample = 0.0

    def stalled(self, running: list[int], now: float) -> bool:
        if self.window <= 0 or not running or now - self.started < self.window:
            return False
        if now - self.last_sample >= STALL_SAMPLE_S:
            self.last_sample = now
            used_now = procs.cpu_seconds_of([self.pids[rank] for rank in running])
            for rank in running:
                history = self.samples[rank]
                history.append((now, used_now[self.pids[rank]]))
                while len(history) > 2 and history[1][0] <= now - self.window:
                    history.pop(0)  # keep one sample at or before the window's start
        for rank in running:
            history = self.samples[rank]
            if len(history) < 2 or history[0][0] > now - self.window + STALL_SAMPLE_S:
                return False  # not a whole window observed yet
            used = history[-1][1] - history[0][1]
            if used >= STALL_CPU_FRACTION * (history[-1][0] - history[0][0]):
                return False
        return True


class RankPool:
    def __init__(self, key: PoolKey, config: PoolConfig, zygote: Zygote | None = None) -> None:
        self.key = key
        self.config = config
        self.zygote = zygote
        self.ranks: list[_Rank] = []
        self.workdir = tempfile.mkdtemp(prefix=f"harness-pool-{key.nproc}-")
        self.alive = False
        self.tests_run = 0
        self._tag = ""  # HARNESS_TOKEN=<hex> of this pool, set at start

    # -- start ------------------------------------------------------------------------------
    def start(self) -> "RankPool":
        deadline = time.monotonic() + self.config.startup_timeout
        token = secrets.token_bytes(16)
        self._tag = f"HARNESS_TOKEN={token.hex()}"  # every process the ranks start inherits it
        server = socket.create_server(("127.0.0.1", 0))
        try:
            port = server.getsockname()[1]
            for rank in range(self.key.nproc):
                self.ranks.append(self._spawn(rank, port, token))
            self._accept(server, token, deadline)
        except BaseException:
            self.close()
            raise
        finally:
            server.close()
        try:
            for r in self.ranks:
                reply = self._recv(r, deadline, "joining the process group")
                if reply[0] != "ready":
                    raise PoolStartError(
                        f"rank {r.rank} failed to join the {self.key.backend} process group:\n{reply[1]}"
                    )
        except BaseException:
            self.close()
            raise
        self.alive = True
        return self

    def _spawn(self, rank: int, port: int, token: bytes) -> _Rank:
        env = _worker_base_env()
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.key.nproc),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(self.key.nproc),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            HARNESS_LAUNCHER_PORT=str(port),
            HARNESS_TOKEN=token.hex(),
            HARNESS_BACKEND=self.key.backend,
            HARNESS_DEVICE=self.key.device,
            HARNESS_WORKDIR=self.workdir,
            HARNESS_STORE_PATH=os.path.join(self.workdir, "filestore"),
            HARNESS_PG_TIMEOUT=str(self.config.pg_timeout),
            HARNESS_STARTUP_TIMEOUT=str(self.config.startup_timeout),
            HARNESS_WORKER="1",
        )
        env.pop("MASTER_PORT", None)  # nothing listens on a fixed port here
        # Loopback only, and no thread oversubscription when N ranks share the cores.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault(fr.FR_BUFFER_ENV, fr.RANK_FR_BUFFER)
        log_path = os.path.join(self.workdir, f"rank{rank}.log")
        if self.zygote is not None:
            proc = _RankProcess(self.zygote.spawn(env, log_path, os.getcwd()), zygote=self.zygote)
        else:
            with open(log_path, "wb") as log:
                popen = subprocess.Popen(
                    [sys.executable, "-m", "harness.launch.worker"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: killpg takes the whole tree
                    cwd=os.getcwd(),
                )
            proc = _RankProcess(popen.pid, popen=popen)
        _LIVE_PIDS.add(proc.pid)
        return _Rank(rank, proc, log_path)

    def _accept(self, server: socket.socket, token: bytes, deadline: float) -> None:
        """Take the ranks' task and control connections. Every accepted connection is read
        without blocking, side by side with the others and with new ones, and one that has not
        sent a complete, valid handshake within HANDSHAKE_TIMEOUT_S is dropped: a local process
        that connects and sends nothing (or half a header) cannot hold the start-up up."""
        wanted = {(r.rank, role) for r in self.ranks for role in (HANDSHAKE_TASK, HANDSHAKE_CONTROL)}
        pending: dict[socket.socket, tuple[bytearray, float]] = {}
        server.setblocking(False)
        try:
            while wanted:
                self._check_started_alive("connecting to the launcher")
                now = time.monotonic()
                if deadline - now <= 0:
                    raise PoolStartError(self._startup_timeout_message("connecting to the launcher"), timed_out=True)
                for sock, (_, since) in list(pending.items()):
                    if now - since > HANDSHAKE_TIMEOUT_S:
                        pending.pop(sock)
                        sock.close()
                readable, _, _ = select.select([server, *pending], [], [], min(deadline - now, 0.2))
                for sock in readable:
                    if sock is server:
                        try:
                            client, _addr = server.accept()
                        except (BlockingIOError, InterruptedError):
                            continue
                        client.setblocking(False)
                        pending[client] = (bytearray(), time.monotonic())
                        continue
                    hello = self._read_hello(sock, pending)
                    if hello is None:
                        continue
                    pending.pop(sock)
                    if not hello.startswith(token) or len(hello) <= len(token) + 4 \
                            or not hello[len(token) + 4:].isdigit():
                        sock.close()  # not one of ours
                        continue
                    role, rank = hello[len(token) : len(token) + 4], int(hello[len(token) + 4 :])
                    if (rank, role) not in wanted:
                        sock.close()
                        continue
                    wanted.discard((rank, role))
                    sock.setblocking(True)
                    conn = Connection(sock.detach())
                    if role == HANDSHAKE_TASK:
                        self.ranks[rank].task = conn
                    else:
                        self.ranks[rank].control = conn
        finally:
            for sock in pending:
                sock.close()

    @staticmethod
    def _read_hello(sock: socket.socket, pending: dict[socket.socket, tuple[bytearray, float]]) -> bytes | None:
        """Read what ``sock`` has of its handshake (a ``Connection.send_bytes`` frame: a 4-byte
        big-endian length, then the bytes); the hello once complete, else None (a connection that
        closes or announces more than a hello can be is dropped)."""
        buffer, _ = pending[sock]
        try:
            chunk = sock.recv(HANDSHAKE_MAX_BYTES + 4 - len(buffer))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            chunk = b""
        if not chunk:
            pending.pop(sock)
            sock.close()
            return None
        buffer += chunk
        if len(buffer) < 4:
            return None
        size = struct.unpack("!i", bytes(buffer[:4]))[0]
        if not 0 < size <= HANDSHAKE_MAX_BYTES:
            pending.pop(sock)
            sock.close()
            return None
        if len(buffer) < 4 + size:
            return None
        return bytes(buffer[4 : 4 + size])

    def _check_started_alive(self, phase: str) -> None:
        for r in self.ranks:
            if r.exited():
                raise PoolStartError(
                    f"rank {r.rank} exited while {phase} ({procs.describe_exit(r.proc.returncode)}).\n"
                    f"Its output:\n{_tail(r.log_path)}"
                )

    def _startup_timeout_message(self, phase: str) -> str:
        """Where every rank stands: each is asked for its Python stacks (faulthandler on
        SIGUSR1, registered before the worker connects) so a start that hung shows where."""
        for r in self.ranks:
            if r.proc.poll() is None:
                try:
                    os.kill(r.proc.pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(0.5)  # faulthandler writes from the signal handler: let it finish
        parts = [
            f"ranks did not finish {phase} within {self.config.startup_timeout:.0f} s "
            f"(--dist-startup-timeout)."
        ]
        for r in self.ranks:
            parts.append(f"Output of rank {r.rank}:\n{_tail(r.log_path, 1500)}")
        return "\n".join(parts)

    def _recv(self, r: _Rank, deadline: float, phase: str) -> Any:
        assert r.task is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolStartError(self._startup_timeout_message(phase), timed_out=True)
            if r.task.poll(min(remaining, 0.2)):
                try:
                    return r.task.recv()
                except (EOFError, OSError):
                    pass
            self._check_started_alive(phase)

    # -- run one test -----------------------------------------------------------------------
    def run(self, task: TestTask, timeout: float, stall_window: float | None = None) -> RunOutcome:
        """Run ``task`` on every rank; ``stall_window`` overrides the pool's for this call."""
        try:
            return self._run(task, timeout, self.config.stall_window if stall_window is None else stall_window)
        except BaseException:
            # Ctrl-C, SIGTERM, or an exception raised into this wait from outside (pytest-timeout's
            # signal method fails the test from its SIGALRM handler) while the ranks are inside
            # a test body: they would not answer an orderly shutdown and must never hand this
            # body's result to the next test, so their trees are killed now and it goes on.
            self.close()
            raise

    def _run(self, task: TestTask, timeout: float, stall_window: float) -> RunOutcome:
        if not self.alive:
            raise RuntimeError("this rank pool was closed")
        self.tests_run += 1
        outcome = RunOutcome(nproc=self.key.nproc, timeout_s=timeout)
        started = time.monotonic()
        deadline = started + timeout
        pending = {r.rank: r for r in self.ranks}
        for r in self.ranks:
            try:
                assert r.task is not None
                r.task.send(("run", task))
            except (OSError, EOFError):
                pass  # noticed below as a death
        first_failure: float | None = None
        stall = _StallWatch(stall_window, {r.rank: r.proc.pid for r in self.ranks}, started)
        while pending:
            now = time.monotonic()
            limit = deadline if first_failure is None else min(deadline, first_failure + self.config.failure_grace)
            if now >= limit:
                break
            if first_failure is None and stall.stalled(list(pending), now):
                outcome.stalled_s = stall_window
                break
            handles = [h for r in pending.values() for h in r.wait_handles()]
            ready = wait(handles, timeout=min(limit - now, 0.5))
            for r in list(pending.values()):
                if r.task in ready:
                    try:
                        result = r.task.recv()
                    except (EOFError, OSError):
                        result = None
                    if isinstance(result, RankResult):
                        outcome.results[r.rank] = result
                        del pending[r.rank]
                        if result.outcome == "failed" and first_failure is None:
                            first_failure = time.monotonic()
                        continue
                if r.exited() or (r.exit_fd is not None and r.exit_fd in ready):
                    r.proc.wait(timeout=5)
                    outcome.deaths[r.rank] = procs.describe_exit(r.proc.returncode)
                    if note := read_exit_note(exit_note_path(self.workdir, r.rank)):
                        outcome.deaths[r.rank] += f": the test body called {note}"
                    outcome.death_times[r.rank] = time.monotonic()
                    outcome.death_logs[r.rank] = (
                        _tail(r.log_path) + _tail(capture_path(self.workdir, r.rank))
                    )
                    del pending[r.rank]
                    if first_failure is None:
                        first_failure = time.monotonic()
        if self.zygote is not None and any("SIGKILL" in d for d in outcome.deaths.values()):
            # Ranks die of SIGKILL when the fork server dies (their PDEATHSIG), and the kernel
            # signals them before their parent can be waited for: give it a moment to be.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.zygote.proc.wait(timeout=1)
        if self.zygote is not None and outcome.deaths and not self.zygote.alive():
            outcome.fork_server_death = procs.describe_exit(self.zygote.proc.returncode)
            outcome.fork_server_pid = self.zygote.proc.pid
        for rank in range(self.key.nproc):
            # Ranks that cannot be asked (dead, or failed and back to idle) still left their
            # collectives in their journal.
            if rank in outcome.deaths or (rank in outcome.results and outcome.results[rank].outcome == "failed"):
                outcome.journals[rank] = read_journal(journal_path(self.workdir, rank))
        if pending:
            outcome.timed_out = first_failure is None
            # Every live rank, finished ones too: "rank 1 finished after all_reduce #1" is
            # half of the story of a skipped collective.
            dumps = self.dump([r.rank for r in self.ranks if r.rank not in outcome.deaths])
            for rank in pending:
                outcome.aborted[rank] = dumps.get(rank)
            outcome.finished = {r: d for r, d in dumps.items() if r not in pending}
            for rank, found in dumps.items():
                # A rank that did not answer still journalled what it issued from Python.
                if found is None or found.state == "unresponsive":
                    outcome.journals[rank] = read_journal(journal_path(self.workdir, rank))
            self._retire("timed out" if outcome.timed_out else "ranks aborted after a failure", outcome)
        elif outcome.deaths:
            self._retire("a rank died", outcome)
        return outcome

    def _retire(self, reason: str, outcome: RunOutcome) -> None:
        outcome.pool_replaced = True
        outcome.replace_reason = reason
        self.close()

    def dump(self, ranks: list[int]) -> dict[int, RankDump | None]:
        """Ask ranks where they are (stack, last collectives). Collect first, then kill."""
        dumps: dict[int, RankDump | None] = {rank: None for rank in ranks}
        asked = []
        for rank in ranks:
            r = self.ranks[rank]
            try:
                assert r.control is not None
                r.control.send("dump")
                asked.append(r)
            except (OSError, EOFError, AssertionError):
                pass
        waiting = {r.control: r for r in asked if r.control is not None}
        # A rank gets dump_timeout to answer, and more while it is visibly working on the
        # answer (its tree uses CPU, as reading its collectives does on a loaded machine), up to
        # DUMP_PATIENCE x dump_timeout: a fixed deadline let a busy machine turn a slow answer
        # into "did not answer" and lose the hang's diagnosis.
        started = time.monotonic()
        deadline, cap = started + self.config.dump_timeout, started + DUMP_PATIENCE * self.config.dump_timeout
        cpu = {r.rank: procs.cpu_seconds(r.proc.pid) for r in waiting.values()}
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                busy = False
                for r in waiting.values():
                    used = procs.cpu_seconds(r.proc.pid)
                    busy |= used - cpu[r.rank] > STALL_CPU_FRACTION * self.config.dump_timeout
                    cpu[r.rank] = used
                if not busy or now >= cap:
                    break
                deadline = min(cap, now + self.config.dump_timeout)
            for conn in wait(list(waiting), timeout=max(0.0, min(deadline, cap) - time.monotonic())):
                r = waiting.pop(conn)
                try:
                    dumps[r.rank] = conn.recv()
                except (EOFError, OSError):
                    pass
        for rank, found in dumps.items():
            if found is None:  # the control thread could not answer: faulthandler's view
                r = self.ranks[rank]
                try:
                    os.kill(r.proc.pid, signal.SIGUSR1)
                    time.sleep(0.3)
                except ProcessLookupError:
                    pass
                dumps[rank] = RankDump(
                    rank=rank,
                    pid=r.proc.pid,
                    state="unresponsive",
                    stack=_tail(r.log_path),
                    waiting_in="",
                    user_site="",
                )
        return dumps

    # -- between tests ----------------------------------------------------------------------
    def reset(self) -> str:
        """Put every rank back to a clean state; '' when done, else why the pool must go."""
        if not self.alive:
            return "pool already closed"
        deadline = time.monotonic() + self.config.reset_timeout
        for r in self.ranks:
            try:
                assert r.task is not None
                r.task.send(("reset", None))
            except (OSError, EOFError):
                return f"rank {r.rank} is gone"
        replies: list[ResetResult] = []
        for r in self.ranks:
            assert r.task is not None
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not r.task.poll(remaining):
                return f"rank {r.rank} did not finish its reset within {self.config.reset_timeout:.0f} s"
            try:
                replies.append(r.task.recv())
            except (EOFError, OSError):
                return f"rank {r.rank} died during reset"
        bad = [f"rank {x.rank}: {x.detail}" for x in replies if not x.ok]
        if bad:
            return "; ".join(bad)
        if len({x.group_count for x in replies}) > 1:
            counts = {x.rank: x.group_count for x in replies}
            return f"ranks created different numbers of process groups {counts}"
        return ""

    # -- stop -------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Orderly stop (destroy_process_group on every rank), with a deadline, then kill."""
        if self.alive:
            for r in self.ranks:
                try:
                    assert r.task is not None
                    r.task.send(("shutdown", None))
                except (OSError, EOFError, AssertionError):
                    pass
            procs.wait_gone([r.proc.pid for r in self.ranks], timeout)
        self.close()

    def close(self) -> None:
        """Kill every rank's process tree and free the pool's files. Safe to call twice."""
        self.alive = False
        for r in self.ranks:
            procs.kill_tree(r.proc.pid)
        if self._tag:
            # What the ranks started that left their tree: in its own session and re-parented
            # to init after its rank died, or still running after a test that passed.
            procs.kill_tagged(self._tag)
        procs.wait_gone([r.proc.pid for r in self.ranks], 5)
        for r in self.ranks:
            _LIVE_PIDS.discard(r.proc.pid)
            for conn in (r.task, r.control):
                if conn is not None:
                    conn.close()
            if r.exit_fd is not None:
                os.close(r.exit_fd)
                r.exit_fd = None
        shutil.rmtree(self.workdir, ignore_errors=True)


class PoolManager:
    """Warm pools keyed by (world size, backend, device), a few kept alive at once."""

    def __init__(
        self,
        config: PoolConfig,
        max_pools: int = 2,
        fresh_per_test: bool = False,
        start_method: str = "forkserver",
        fork_server_of: "PoolManager | None" = None,
    ) -> None:
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', not {start_method!r}")
        self.config = config
        self.max_pools = max_pools
        self.fresh_per_test = fresh_per_test
        self.start_method = start_method
        self.pools: OrderedDict[PoolKey, RankPool] = OrderedDict()
        self.started = 0
        self.zygote: Zygote | None = None
        # A manager whose pools must be fresh ranks (the determinism and resume runs) may fork
        # them from another manager's fork server: a forked rank has run nothing either way,
        # and the fork server's torch import (seconds) is paid once. The lender closes it.
        self._lender = fork_server_of if start_method == "forkserver" else None
        self._zygote_dir = tempfile.mkdtemp(prefix="harness-zygote-")

    def start_fork_server(self) -> None:
        """Start the fork server now without waiting for it: its torch import then overlaps
        whatever the caller does next (pytest's collection); the first pool waits for it."""
        if self._lender is not None:
            self._lender.start_fork_server()
            return
        if self.start_method == "forkserver" and self.zygote is None:
            self.zygote = Zygote(self.config.startup_timeout, os.path.join(self._zygote_dir, "zygote.log"))

    def _fork_server(self) -> Zygote | None:
        if self.start_method != "forkserver":
            return None
        if self._lender is not None:
            return self._lender._fork_server()
        if self.zygote is not None and self.zygote.ready and not self.zygote.alive():
            self.zygote.close()
            self.zygote = None
        self.start_fork_server()
        assert self.zygote is not None
        try:
            return self.zygote.wait_ready()
        except PoolStartError:
            self.zygote = None
            raise

    def get(self, key: PoolKey) -> RankPool:
        check_world_size(key.nproc)
        pool = self.pools.get(key)
        if pool is not None and pool.alive:
            self.pools.move_to_end(key)
            return pool
        self.pools.pop(key, None)
        while len(self.pools) >= self.max_pools:
            _, old = self.pools.popitem(last=False)
            old.shutdown()
        try:
            pool = RankPool(key, self.config, self._fork_server()).start()
        except PoolStartError as first:
            if not first.timed_out:
                raise
            # Nothing failed, the deadline passed: on a loaded machine one start can stall
            # (every rank waiting its turn for a core) where the next does not. No user code
            # has run yet, so a second, fresh start changes no verdict; a second timeout is
            # reported with both starts' evidence.
            try:
                pool = RankPool(key, self.config, self._fork_server()).start()
            except PoolStartError as second:
                raise PoolStartError(
                    f"{second}\n(the first start timed out too:)\n{first}", timed_out=second.timed_out
                ) from None
        self.started += 1
        self.pools[key] = pool
        return pool

    def run(self, key: PoolKey, task: TestTask, timeout: float, stall_window: float | None = None) -> RunOutcome:
        pool = self.get(key)
        outcome = pool.run(task, timeout, stall_window)
        if pool.alive:
            why = "fresh pool per test requested" if self.fresh_per_test else pool.reset()
            if why:
                outcome.pool_replaced = True
                outcome.replace_reason = why
                pool.close()
        if not pool.alive:
            self.pools.pop(key, None)
        return outcome

    def close(self) -> None:
        while self.pools:
            _, pool = self.pools.popitem()
            pool.shutdown()
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
        shutil.rmtree(self._zygote_dir, ignore_errors=True)


def _tail(path: str, limit: int = 3000) -> str:
    return procs.tail_of(path, limit)


# Backstop: whatever happens in the pytest process (Ctrl-C, an internal error), no rank outlives it.
_LIVE_PIDS: set[int] = set()


@atexit.register
def _kill_leftovers() -> None:
    for pid in list(_LIVE_PIDS):
        procs.kill_tree(pid)
