"""The examples README.md shows, run as they are written (the bundled example tests)."""

import pytest
import torch
import torch.distributed as dist

from cases import mlp_case
from cases.strategies import DDPStrategy
from harness.run import run_strategy


@pytest.mark.distributed  # runs on --nproc ranks
def test_sum(dist_ctx):  # dist_ctx: rank, world_size, local_rank, device, backend
    t = torch.ones(1) * dist_ctx.rank
    torch.distributed.all_reduce(t)
    assert t.item() == sum(range(dist_ctx.world_size))


@pytest.mark.distributed(nproc=4)  # a test that needs exactly 4 ranks
def test_mesh(dist_ctx):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    coordinate = list(mesh.get_coordinate())
    assert coordinate == [dist_ctx.rank // 2, dist_ctx.rank % 2]
    assert dist.get_process_group_ranks(mesh.get_group("tp")) == [2 * coordinate[0], 2 * coordinate[0] + 1]


@pytest.mark.distributed(nproc=2)
def test_ddp_matches_single_device(dist_ctx, tmp_path):
    result = run_strategy(mlp_case("adamw"), DDPStrategy(), dist_ctx, workdir=tmp_path, cache=tmp_path / "cache")
    assert result.passed, result.summary()
