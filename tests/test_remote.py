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
