"""Fork server for rank workers: pay the torch import once per pytest process, not per rank.

Importing torch costs 2-3 s of CPU per process; a pool of 4 ranks on 2 cores took ~12 s to
start. The zygote imports torch (without touching CUDA or starting compute threads) and then
forks each rank on request, so a pool (re)start after a crash or hang costs milliseconds.
Each forked rank leads its own session, so the launcher can still kill its whole tree.

Run as ``python -m harness.launch.zygote FD``, FD being its end of a socketpair with the launcher.
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection

from harness.launch import procs


def _child(conn: Connection, env: dict[str, str], log_path: str, cwd: str) -> None:
    try:
        os.setsid()
        conn.close()
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        from harness.launch import worker

        worker.main()
    finally:
        os._exit(1)


def _reap(statuses: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = os.waitstatus_to_exitcode(status)


# Imported once here rather than in every rank a pool forks: torch's compiler stack (the first
# optimizer an rank builds imports torch._dynamo, about 1.2 s of CPU), the parallel APIs and the
# harness's rank-side modules. Measured: 1.5 s per rank process before, paid again by every
# replacement pool (after a hang or a crash) on every rank.
PREIMPORTS = (
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "harness.pipeline",
)


def _preimport(name: str) -> None:
    import importlib

    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a build without it: the rank imports what it needs itself
        pass


# The fork server says it is ready once a rank could run (torch, torch.distributed, the worker),
# and imports PREIMPORTS one by one only while no request waits: the first pool's ranks are then
# forked 1.7 s sooner (a short session waited for the compiler stack before its first test, on
# the critical path after collection) and import what they use themselves; every later fork
# (a replacement pool, another world size, a fresh runner) gets them all.
IDLE_BEFORE_PREIMPORT_S = 0.3


def main() -> None:
    procs.die_with_parent()
    # A rank's children outlive a crashed rank as this process's children, not init's: the
    # fork server's tree (killed when the session ends) still holds them.
    procs.become_subreaper()
    conn = Connection(int(sys.argv[1]))
    # What every rank needs, imported once here and inherited by fork.
    import _pytest._code  # noqa: F401
    import _pytest.assertion.rewrite  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import harness.tracing.fr  # noqa: F401
    import harness.launch.rank_state  # noqa: F401
    import harness.launch.worker  # noqa: F401

    statuses: dict[int, int] = {}
    children: set[int] = set()
    pending = list(PREIMPORTS)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            if not conn.poll(IDLE_BEFORE_PREIMPORT_S if pending else 1.0):
                _reap(statuses)
                if pending:
                    _preimport(pending.pop(0))
                continue
            kind, *args = conn.recv()
        except (EOFError, OSError):
            break
        _reap(statuses)
        if kind == "spawn":
            env, log_path, cwd = args
            pid = os.fork()
            if pid == 0:
                _child(conn, env, log_path, cwd)
            children.add(pid)
            statuses.pop(pid, None)  # a reused pid must not inherit an old child's status
            conn.send(("spawned", pid))
        elif kind == "status":
            (pid,) = args
            if pid not in statuses and pid in children:
                # The launcher saw it exit: its status is a moment away at most.
                deadline = time.monotonic() + 2.0
                while pid not in statuses and time.monotonic() < deadline:
                    _reap(statuses)
                    time.sleep(0.01)
            conn.send(("status", statuses.get(pid)))
        elif kind == "preimported":
            conn.send(("preimported", [name for name in PREIMPORTS if name not in pending]))
    # The launcher is gone: nothing of ours may outlive it.
    for pid in children:
        procs.kill_tree(pid)
    os._exit(0)


if __name__ == "__main__":
    main()
