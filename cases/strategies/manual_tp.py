"""Hand-written Megatron-style tensor parallelism for the two-layer MLP, without DTensor.

This is what custom parallel code looks like: plain tensors holding slices, explicit
collectives in autograd functions, and ``annotate_shard`` telling the harness how to gather
each slice back to full shape. ``fc1`` is column-parallel (output features split), ``fc2``
row-parallel (input features split, its partial outputs all-reduced, bias added once).

Megatron's two conjugate operators: ``f`` is the identity forward and an all-reduce of the
input gradient backward (before a column-parallel layer); ``g`` is an all-reduce forward and
the identity backward (after a row-parallel layer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.record.gather import annotate_shard
from harness.parallel_dims import ParallelDims
from harness.strategy import DistContextLike, RankSetup, StrategyBase
from reference.case import Case

__all__ = ["ColumnParallelLinear", "ManualTPMLP", "ManualTensorParallel", "RowParallelLinear", "copy_to_group", "reduce_from_group"]


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ``f``."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ``g``."""
    return _ReduceFromGroup.apply(x, group)


def _slice(t: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    return t.detach().chunk(parts, dim)[index].clone()


class ColumnParallelLinear(nn.Module):
    """This rank's rows of ``full``'s weight and bias: its slice of the output features."""

    def __init__(self, full: nn.Linear, group: Any, index: int, parts: int):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(_slice(full.weight, 0, index, parts))
        self.bias = nn.Parameter(_slice(full.bias, 0, index, parts))
        annotate_shard(self.weight, 0, group=group)
        annotate_shard(self.bias, 0, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_group(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of ``full``'s weight (its slice of the input features); the bias is
    replicated and added once, after the partial outputs are summed."""

    def __init__(self, full: nn.Linear, group: Any, index: int, parts: int, weight_shard_dim: int = 1):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(_slice(full.weight, 1, index, parts))
        self.bias = nn.Parameter(full.bias.detach().clone())
        annotate_shard(self.weight, weight_shard_dim, group=group)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return reduce_from_group(partial, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight)) + self.bias


class ManualTPMLP(nn.Module):
    """The tensor-parallel twin of :class:`cases.models.TwoLayerMLP` (same parameter names)."""

    def __init__(self, full: nn.Module, group: Any, index: int, parts: int, row_cls: type = RowParallelLinear):
        super().__init__()
        self.fc1 = ColumnParallelLinear(full.fc1, group, index, parts)
        self.act = nn.ReLU()
        self.dropout = nn.Dropout(full.dropout.p)
        self.fc2 = row_cls(full.fc2, group, index, parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout(self.act(self.fc1(x))))


class ManualTensorParallel(StrategyBase):
    """Every rank is one tensor-parallel shard of the MLP and sees the whole batch."""

    name = "manual-tp"
    row_cls: type = RowParallelLinear

    def setup(self, case: Case, ctx: DistContextLike) -> RankSetup:
        dims = ParallelDims(tp=ctx.world_size)
        full = case.build_model(ctx.device)
        hidden = full.fc1.out_features
        if hidden % ctx.world_size:
            raise ValueError(f"MLP hidden size {hidden} is not divisible by tp={ctx.world_size}")
        group = dist.group.WORLD
        model = ManualTPMLP(full, group, ctx.rank, ctx.world_size, self.row_cls)
        return RankSetup(model=model, optimizer=case.build_optimizer(model.parameters()), layout=dims.layout(ctx.rank), device=ctx.device)

