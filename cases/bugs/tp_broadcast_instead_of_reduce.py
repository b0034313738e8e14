"""Hand-written tensor parallelism that broadcasts rank 0's partial output instead of summing.

Real-world class: a collective swapped for another with the same shape (``broadcast`` where
``all_reduce`` was meant): the other ranks' shards never take part in the loss, so their
slices of the gradients are exactly zero while training looks normal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cases.catalog import mlp_case
from cases.strategies.manual_tp import ManualTensorParallel, RowParallelLinear

EXPECTED_CODE = "missing-shard-contribution"
NPROC = 2
CASE = mlp_case("adamw")


class _BroadcastFromFirst(torch.autograd.Function):
    """Forward: every rank gets group rank 0's tensor. Backward (its true adjoint): the
    gradient is summed onto rank 0; the other ranks' inputs influenced nothing."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous().clone()
        dist.broadcast(x, src=dist.get_global_rank(group, 0), group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return (grad if dist.get_rank(ctx.group) == 0 else torch.zeros_like(grad)), None


class BroadcastRowParallel(RowParallelLinear):
    def reduce(self, partial):
        return _BroadcastFromFirst.apply(partial, self.group)  # BUG: broadcast, not all_reduce


class BroadcastInsteadOfReduceTP(ManualTensorParallel):
    name = "manual-tp-broadcast"
    row_cls = BroadcastRowParallel


STRATEGY = BroadcastInsteadOfReduceTP
