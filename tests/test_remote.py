"""run_on_ranks from the pytest process: values come back per rank, the pool stays warm, and
failures and hangs raise with the launcher's report."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.launch.remote import RanksFailed, RanksHung


def summed(ctx, x: int) -> dict:
    t = torch.tensor([ctx.rank + x])
    dist.all_reduce(t)
    return {"rank": ctx.rank, "world": ctx.world_size, "sum": int(t)}


def fails_on_rank_1(ctx) -> None:
    dist.barrier()
    if ctx.rank == 1:
        raise ValueError("rank 1 is unhappy")


def skips_a_collective(ctx) -> None:
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1))


def test_values_come_back_from_each_rank(rank_runner) -> None:
    first = rank_runner.run(summed, nproc=2, kwargs={"x": 1})
    assert first.values == {0: {"rank": 0, "world": 2, "sum": 3}, 1: {"rank": 1, "world": 2, "sum": 3}}
    started = rank_runner.manager.started
    second = rank_runner.run(summed, nproc=2, kwargs={"x": 5})
    assert second.values[1]["sum"] == 11
    assert rank_runner.manager.started == started  # warm pool reused, nothing spawned


def test_a_failing_rank_raises_with_its_traceback(rank_runner) -> None:
    with pytest.raises(RanksFailed, match="rank 1 is unhappy") as info:
        rank_runner.run(fails_on_rank_1, nproc=2)
    assert "ValueError" in info.value.report


def test_a_hang_raises_ranks_hung(rank_runner) -> None:
    with pytest.raises(RanksHung) as info:
        rank_runner.run(skips_a_collective, nproc=2, timeout=6)
    assert "all_reduce" in info.value.report
    assert rank_runner.run(summed, nproc=2, kwargs={"x": 0}).values[0]["sum"] == 1  # fresh pool works


def test_a_local_function_is_refused(rank_runner) -> None:
    def local(ctx) -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        rank_runner.run(local, nproc=2)


def test_a_local_process_that_connects_and_sends_nothing_cannot_hold_the_start_up(monkeypatch) -> None:
    """While a pool starts, another local process connects to its port first: one that sends
    nothing, one that sends half a length header, one that announces an oversized frame. Each is
    dropped without delaying the ranks' handshakes (it used to hold the start-up until the
    whole start-up deadline, here 60 s, and the pool failed)."""
    import socket

    from harness.launch import pool as pool_module
    from harness.launch.pool import PoolConfig, PoolManager
    from harness.launch.remote import RankRunner

    intruders: list[socket.socket] = []
    real_create_server = socket.create_server

    def create_server(address, *args, **kwargs):
        server = real_create_server(address, *args, **kwargs)
        port = server.getsockname()[1]
        for payload in (b"", b"\x00\x00", b"\x7f\xff\xff\xff"):
            client = socket.create_connection(("127.0.0.1", port))
            if payload:
                client.sendall(payload)
            intruders.append(client)  # held open, silent, for the whole start
        return server

    monkeypatch.setattr(pool_module.socket, "create_server", create_server)
    manager = PoolManager(PoolConfig(startup_timeout=60.0))
    try:
        with RankRunner(manager) as runner:
            result = runner.run(summed, nproc=2, kwargs={"x": 1}, timeout=60)
        assert [result.values[r]["sum"] for r in (0, 1)] == [3, 3]
    finally:
        manager.close()
        for client in intruders:
            client.close()
    assert len(intruders) == 3


_BUILD = ("end=$((SECONDS + {seconds})); n=0; while [ $SECONDS -lt $end ]; do "
          "{python} -c 'import time; t = time.process_time()\nwhile time.process_time() - t < 0.3: pass'; n=$((n+1)); done; echo $n")


def runs_a_build(ctx, seconds: float) -> int:
    """Like a framework JIT-building its extension at init: a build driver (here a shell loop,
    ninja in life) runs one short compute-bound compiler after another and reaps each, while
    the rank itself only waits for the driver."""
    import subprocess
    import sys

    out = subprocess.run(["bash", "-c", _BUILD.format(seconds=int(seconds), python=sys.executable)],
                         check=True, capture_output=True, text=True)
    dist.barrier()
    return int(out.stdout.strip())


def test_a_rank_building_in_subprocesses_longer_than_the_stall_window_is_not_hung() -> None:
    """Progress is CPU time of the rank's process tree, the children its descendants have
    reaped included: the compilers a build driver runs and reaps one after another count (they
    used to vanish from it, so a rank building an extension for longer than the stall window
    was killed as hung, and its build lock stayed behind)."""
    from harness.launch.remote import RankRunner

    with RankRunner(stall_window=2.0) as runner:
        result = runner.run(runs_a_build, nproc=2, kwargs={"seconds": 6.0}, timeout=120)
    assert all(count >= 3 for count in result.values.values()), result.values


def test_cpu_seconds_counts_the_children_a_process_has_reaped(tmp_path) -> None:
    import subprocess
    import sys
    import time

    from harness.launch import procs

    flag = tmp_path / "done"
    driver = subprocess.Popen(["bash", "-c", f"{sys.executable} -c 'import time; t = time.process_time()\n"
                               f"while time.process_time() - t < 0.5: pass'; touch {flag}; sleep 30"])
    try:
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.exists()
        assert procs.cpu_seconds(driver.pid) >= 0.4  # the reaped child's CPU, though no child is alive
    finally:
        driver.kill()
        driver.wait()


def test_a_start_that_times_out_is_retried_once_and_shows_every_ranks_stacks(monkeypatch) -> None:
    """The first start gets a deadline no rank can meet (real ranks, real timeout); the manager
    starts a fresh pool once, which runs the test. A start that fails for a reason (not the
    clock) is not retried, and two timeouts report both starts with every rank's output."""
    import dataclasses

    from harness.launch import pool as pool_module
    from harness.launch.pool import PoolConfig, PoolManager, PoolStartError
    from harness.launch.remote import RankRunner

    real_start = pool_module.RankPool.start
    messages: list[str] = []

    def start_once_too_fast(self):
        if not messages:
            self.config = dataclasses.replace(self.config, startup_timeout=0.001)
            try:
                return real_start(self)
            except PoolStartError as exc:
                messages.append(str(exc))
                raise
        return real_start(self)

    monkeypatch.setattr(pool_module.RankPool, "start", start_once_too_fast)
    manager = PoolManager(PoolConfig(startup_timeout=60.0))
    try:
        with RankRunner(manager) as runner:
            result = runner.run(summed, nproc=2, kwargs={"x": 1}, timeout=60)
        assert [result.values[r]["sum"] for r in (0, 1)] == [3, 3]
    finally:
        manager.close()
    assert len(messages) == 1
    assert "did not finish" in messages[0] and "(--dist-startup-timeout)" in messages[0]
    assert "Output of rank 0:" in messages[0] and "Output of rank 1:" in messages[0]

    def refused(self):
        raise PoolStartError("rank 1 failed to join the gloo process group: boom")

    manager = PoolManager(PoolConfig(startup_timeout=60.0), start_method="spawn")  # no rank starts
    calls = []
    monkeypatch.setattr(pool_module.RankPool, "start", lambda self: calls.append(1) or refused(self))
    try:
        with pytest.raises(PoolStartError, match="boom"):
            manager.get(pool_module.PoolKey(2, "gloo", "cpu"))
    finally:
        manager.close()
    assert calls == [1]

    def always_slow(self):
        raise PoolStartError("ranks did not finish joining the process group", timed_out=True)

    monkeypatch.setattr(pool_module.RankPool, "start", always_slow)
    manager = PoolManager(PoolConfig(startup_timeout=60.0), start_method="spawn")
    try:
        with pytest.raises(PoolStartError, match="the first start timed out too"):
            manager.get(pool_module.PoolKey(2, "gloo", "cpu"))
    finally:
        manager.close()


def pid_of(ctx) -> int:
    import os

    return os.getpid()


def test_a_fresh_runner_forks_ranks_that_ran_nothing_from_the_same_fork_server(rank_runner) -> None:
    """The determinism and resume runs need ranks that never ran a test: they are new processes
    forked from the runner's fork server (no second torch import), closed with their runner,
    which leaves the lender's fork server and warm pool running."""
    warm = rank_runner.run(pid_of, nproc=2, timeout=60).values
    fresh = rank_runner.fresh()
    try:
        first = fresh.run(pid_of, nproc=2, timeout=60).values
        assert set(first.values()).isdisjoint(warm.values())
        if rank_runner.manager.start_method == "forkserver":
            assert rank_runner.manager.zygote is not None and fresh.manager.zygote is None  # borrowed
    finally:
        fresh.close()
    assert rank_runner.run(pid_of, nproc=2, timeout=60).values == warm



def loaded(ctx, names: list[str]) -> list[str]:
    import sys

    return [name for name in names if name in sys.modules]


def test_the_fork_server_imports_the_compiler_stack_once_idle_and_later_pools_inherit_it() -> None:
    """The fork server answers ready once a rank could run (the first pool is not held behind
    torch's compiler stack), imports the rest while no request waits, and ranks forked after
    that inherit every module: a replacement pool imports nothing again."""
    import time

    from harness.launch import zygote as zygote_module
    from harness.launch.pool import PoolConfig, PoolManager
    from harness.launch.remote import RankRunner

    runner = RankRunner(PoolManager(PoolConfig(startup_timeout=120.0)), backend="gloo", device="cpu")
    names = list(zygote_module.PREIMPORTS)
    try:
        assert runner.run(loaded, nproc=1, kwargs={"names": []}, timeout=120).values[0] == []  # ranks run at once
        zygote = runner.manager.zygote
        assert zygote is not None and zygote.ready
        deadline = time.monotonic() + 120  # a loaded machine imports slowly; only the outcome is asserted
        while zygote.preimported() != names and time.monotonic() < deadline:
            time.sleep(1.0)  # a question is a request: asked more often than the idle wait, it would starve the imports
        assert zygote.preimported() == names
        assert runner.run(loaded, nproc=2, kwargs={"names": names}, timeout=120).values[1] == names
    finally:
        runner.close()
