"""End to end on real ranks: DDP matches the single-device reference step by step, and the
harness catches a DDP that is wrong in the ways the seeds warn about."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cases import mlp_case
from cases.strategies import DDPStrategy
from harness.run import run_strategy
from harness.strategy import RankSetup
from reference import Batch, Case, Record


@pytest.mark.distributed(nproc=2)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_ddp_matches_the_reference(dist_ctx, tmp_path, optimizer: str) -> None:
    result = run_strategy(mlp_case(optimizer, steps=3), DDPStrategy(), dist_ctx, workdir=tmp_path, cache=tmp_path / "cache")
    assert result.passed, result.summary()
    kinds = {(t.kind, t.step) for t in result.comparison.tensors}
    assert kinds == {(k, s) for k in ("loss", "grad", "param", "optim") for s in range(3)}


@pytest.mark.distributed(nproc=2)
def test_ddp_with_gradient_accumulation_matches(dist_ctx, tmp_path) -> None:
    result = run_strategy(mlp_case("adamw", micro_batches=2), DDPStrategy(), dist_ctx, workdir=tmp_path, cache=tmp_path / "cache")
    assert result.passed, result.summary()
    assert {t.name for t in result.comparison.tensors if t.kind == "loss"} == {"loss", "micro.0", "micro.1"}
    if dist_ctx.rank == 0:
        record = Record.load(result.record_path)
        assert record.source == "strategy:ddp" and record.meta["world_size"] == 2
        step = record.step(0)
        by_rank = step.rank_sample_ids
        assert sorted(by_rank) == [0, 1] and all(len(m) == 2 for m in by_rank.values())
        mine = [set(i for m in by_rank[r] for i in m) for r in (0, 1)]
        assert not mine[0] & mine[1] and sorted(mine[0] | mine[1]) == sorted(step.sample_ids)
        assert [r["dp_rank"] for r in record.meta["ranks"]] == [0, 1]
        assert "replica_mismatch" not in step.extra  # DDP keeps replicas identical


@pytest.mark.distributed(nproc=2)
def test_ddp_bf16_passes_with_calibrated_tolerance(dist_ctx, tmp_path) -> None:
    result = run_strategy(mlp_case("adamw", dtype=torch.bfloat16), DDPStrategy(), dist_ctx, workdir=tmp_path, cache=tmp_path / "cache")
    assert result.passed, result.summary()
    assert result.comparison.tolerance["mode"] == "calibrated"
    assert all(t.tolerance.source == "calibrated" for t in result.comparison.tensors if t.kind == "grad")


# -- wrong strategies: the comparison must fail, and say where ----------------------------


class DoubleAveragedDDP(DDPStrategy):
    """Divides the loss by the world size although DDP already averages gradients."""

    name = "ddp-double-averaged"

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]):
        ddp = setup.model
        losses = []
        for batch in micro_batches:
            loss = case.forward_loss(ddp, batch)
            (loss * case.loss_weight(len(batch), setup.layout.dp_size) / setup.layout.dp_size).backward()
            losses.append(loss.detach())
        return losses


class SameShardDDP(DDPStrategy):
    """Every rank reads replica 0's shard: samples duplicated, half the batch dropped."""

    name = "ddp-same-shard"

    def local_batches(self, case: Case, setup: RankSetup, step: int) -> list[Batch]:
        return super().local_batches(case, replace(setup, layout=replace(setup.layout, dp_rank=0)), step)


@pytest.mark.distributed(nproc=2)
def test_gradients_averaged_twice_show_only_in_gradients(dist_ctx, tmp_path) -> None:
    result = run_strategy(mlp_case("adamw"), DoubleAveragedDDP(), dist_ctx, workdir=tmp_path, cache=tmp_path / "cache")
    comparison = result.comparison
    assert not result.passed
    failed = comparison.failures()
    # Stepwise, the update is checked from the run's own gradients: loss, parameters and the
    # optimizer state all match what the optimizer makes of them...
    assert comparison.mode == "stepwise"
    assert {t.kind for t in failed} == {"grad"}
    assert all(t.passed for t in comparison.tensors if t.kind in ("loss", "param", "optim"))
    # ...only the gradients show the factor 1/2.
    assert all(t.scale == pytest.approx(0.5, rel=1e-4) for t in failed)
    assert comparison.first_divergence.step == 0
    assert [k for k, _ in comparison.first_divergence.entries] == ["grad"] * 4
    assert "FAIL" in result.summary() and "first divergence at step 0: grad fc1.weight" in result.summary()
    # The trajectory view (secondary) still shows the moments drift from the reference's.
    trajectory = comparison.trajectory
    assert not trajectory["within_tolerance"] and trajectory["first_divergence"]["step"] == 0
    assert {k for k, _ in trajectory["first_divergence"]["entries"]} == {"grad", "optim"}


@pytest.mark.distributed(nproc=2)
def test_duplicated_samples_are_caught(dist_ctx, tmp_path) -> None:
    result = run_strategy(mlp_case("sgd"), SameShardDDP(), dist_ctx, workdir=tmp_path, cache=tmp_path / "cache")
    assert not result.passed
    issues = result.comparison.samples
    assert [i.step for i in issues] == [0, 1, 2]
    assert all(len(i.missing) == 8 and len(i.duplicated) == 8 for i in issues)
    assert result.comparison.first_divergence.entries[0] == ("samples", "ids")
