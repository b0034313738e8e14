"""The memory report measures what each parallelism cuts: FSDP divides parameters, gradients
and optimizer state by the world size, DDP keeps the whole model on every rank, tensor
parallelism divides the state of the layers it splits; activations are what autograd saves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cases import transformer_case
from cases.strategies import DDPStrategy, FSDPStrategy, TensorParallelStrategy
from harness.record.memory import SavedTensorMeter, format_memory_report, measure_memory

F32 = 4  # bytes


def _shapes(case) -> dict[str, torch.Size]:
    return {n: p.shape for n, p in case.build_model().named_parameters()}


def _fsdp_shard_numel(shape: torch.Size, rank: int, world: int) -> int:
    """FSDP2 shards dim 0 the way torch.chunk does (the last ranks may get fewer rows)."""
    rows = [c.shape[0] for c in torch.empty(shape[0]).chunk(world)] + [0] * world
    return rows[rank] * (shape[1:].numel() if len(shape) > 1 else 1)


# Tensor parallelism splits these weights (and the column-parallel biases); the rest is replicated.
TP_SPLIT = (".attn.q.", ".attn.k.", ".attn.v.", ".attn.o.weight", ".mlp.up.", ".mlp.down.weight")


@pytest.mark.distributed(nproc=4)
def test_fsdp_divides_the_state_by_four_ddp_keeps_it_whole_tp_splits_its_layers(dist_ctx) -> None:
    case = transformer_case()
    ddp = measure_memory(case, DDPStrategy(), dist_ctx)
    fsdp = measure_memory(case, FSDPStrategy(), dist_ctx)
    tp = measure_memory(case, TensorParallelStrategy(), dist_ctx)
    full = ddp.reference
    assert full is not None and full.param_bytes > 0 and full.activation_bytes > 0
    shapes = _shapes(case)
    n_params = len(shapes)
    assert full.param_bytes == full.grad_bytes == sum(s.numel() for s in shapes.values()) * F32
    # AdamW: exp_avg + exp_avg_sq per element, plus one scalar float32 `step` per parameter.
    assert full.optim_bytes == 2 * full.param_bytes + n_params * F32

    for r in range(4):
        # DDP: every rank holds the whole model.
        d = ddp[r]
        assert (d.param_bytes, d.grad_bytes, d.optim_bytes) == (full.param_bytes, full.grad_bytes, full.optim_bytes)
        # ...and sees a quarter of the batch, so a quarter of the activations.
        assert d.activation_bytes == pytest.approx(full.activation_bytes / 4, rel=0.05)

        # FSDP: dim-0 shards, exactly torch.chunk's rows; `step` scalars stay whole.
        f = fsdp[r]
        shard = sum(_fsdp_shard_numel(s, r, 4) for s in shapes.values()) * F32
        assert (f.param_bytes, f.grad_bytes, f.optim_bytes) == (shard, shard, 2 * shard + n_params * F32)
        assert f.total_state_bytes == pytest.approx(d.total_state_bytes / 4, rel=0.03)  # padding, `step`

        # TP: the split layers hold a quarter, embedding/norms/head/row biases stay whole.
        t = tp[r]
        expected = sum(s.numel() // 4 if any(k in n for k in TP_SPLIT) else s.numel() for n, s in shapes.items()) * F32
        assert (t.param_bytes, t.grad_bytes) == (expected, expected)
        assert full.param_bytes / 4 < t.param_bytes < full.param_bytes / 2
        # TP ranks consume the whole batch: more activations than a DDP rank, fewer than one device.
        assert d.activation_bytes < t.activation_bytes < full.activation_bytes

    assert fsdp.total_state_bytes == pytest.approx(full.total_state_bytes, rel=0.03)
    assert ddp.total_state_bytes == 4 * full.total_state_bytes
    table = format_memory_report(fsdp)
    assert table.count("0.25x") == 4 and "1 device" in table and "dp=3" in table, table


def test_the_meter_counts_what_autograd_saves_and_frees_it_after_backward() -> None:
    layer = nn.Linear(8, 16)
    x = torch.randn(4, 8)
    with SavedTensorMeter() as meter:
        y = torch.relu(layer(x))  # addmm saves x (the weight is a parameter: not counted); relu its output
        assert meter.live_bytes == (4 * 8 + 4 * 16) * F32
        y.sum().backward()
    assert meter.peak_bytes == (4 * 8 + 4 * 16) * F32
    assert meter.live_bytes == 0
