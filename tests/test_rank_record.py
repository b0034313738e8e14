"""The rank-side recorder as custom training code uses it: a few hook calls in its own loop."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cases import mlp_case
from harness.parallel_dims import RankLayout
from harness.record.recorder import RankRecorder, RecorderError
from harness.run import compare_to_reference
from reference import collate, replica_micro_batch_indices


def hand_written_data_parallel(case, rank: int, world: int, path, *, average: bool = True):
    """A user's own data-parallel loop (no DDP): all-reduce gradients by hand."""
    model = case.build_model()
    opt = case.build_optimizer(model.parameters())
    rec = RankRecorder(path if rank == 0 else None, case, model, opt, RankLayout.data_parallel(rank, world))
    for step in range(case.steps):
        for indices in replica_micro_batch_indices(case, step, rank, world):
            batch = collate(case.dataset, indices)
            loss = case.forward_loss(model, batch)
            rec.micro_batch(step, loss, batch.ids)
            (loss * case.loss_weight(len(batch), world)).backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                if average:
                    p.grad /= world
        rec.grads(step)
        opt.step()
        rec.after_step(step)
        opt.zero_grad()
    return rec.finish()


@pytest.mark.distributed(nproc=2)
def test_custom_loop_recorded_by_hand_matches_the_reference(dist_ctx, tmp_path) -> None:
    case = mlp_case("adamw", micro_batches=2)
    record = hand_written_data_parallel(case, dist_ctx.rank, dist_ctx.world_size, tmp_path / "run")
    if dist_ctx.rank != 0:
        assert record is None
        return
    result = compare_to_reference(case, record, cache=tmp_path / "cache")
    assert result.passed, result.summary()
    assert record.meta["ranks"][1]["mesh"] == {"dp": 1}


@pytest.mark.distributed(nproc=2)
def test_custom_loop_that_forgets_to_average_is_caught(dist_ctx, tmp_path) -> None:
    case = mlp_case("sgd")
    record = hand_written_data_parallel(case, dist_ctx.rank, dist_ctx.world_size, tmp_path / "run", average=False)
    if dist_ctx.rank == 0:
        result = compare_to_reference(case, record, cache=tmp_path / "cache")
        assert not result.passed
        first = [t for t in result.tensors if t.kind == "grad" and t.step == 0]
        assert len(first) == 4 and all(not t.passed and t.scale == pytest.approx(2.0, rel=1e-4) for t in first)


def test_single_process_recording_matches_the_reference(tmp_path) -> None:
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    case = mlp_case("sgd", micro_batches=4)
    record = hand_written_data_parallel(case, 0, 1, tmp_path / "run")
    assert record.complete and record.meta["world_size"] == 1
    result = compare_to_reference(case, record, cache=tmp_path / "cache")
    assert result.passed, result.summary()
    assert max(t.max_abs for t in result.tensors) == 0.0  # same computation, bit for bit


def test_hooks_out_of_order_are_clear_errors(tmp_path) -> None:
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    case = mlp_case()
    model = case.build_model()
    opt = case.build_optimizer(model.parameters())
    rec = RankRecorder(tmp_path / "r", case, model, opt, RankLayout())
    with pytest.raises(RecorderError, match=r"after_step\(step=0\) without grads\(step=0\)"):
        rec.after_step(0)
    rec.micro_batch(1, torch.tensor(1.0), [1])
    rec.grads(1)
    with pytest.raises(RecorderError, match=r"grads\(step=1\) called twice"):
        rec.grads(1)
    with pytest.raises(RecorderError, match=r"micro_batch\(step=1\) after grads"):
        rec.micro_batch(1, 1.0, [2])
    with pytest.raises(RecorderError, match="dst 3 is not a rank of this 1-rank job"):
        RankRecorder(tmp_path / "x", case, model, opt, RankLayout(), dst=3)
