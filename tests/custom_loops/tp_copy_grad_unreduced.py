"""Megatron-style tensor parallelism of a pre-norm MLP language model, written by hand: in each
block ``up`` is column-parallel (its weight's rows and its bias split over the two ranks) and
``down`` row-parallel (its weight's columns split, its output all-reduced, its bias added once
after); the embedding, the norms and the head are replicated. A column-parallel layer's input
is replicated, so its gradient is a partial sum on each rank: the "copy to the tensor-parallel
region" before the matmul is the identity forward and an all-reduce backward. The bug leaves
that backward's all-reduce out: the forward and the loss are right, the gradient of each norm's
output is a partial sum, and the replicated parameters before it get partial gradients. The
``averaged`` entry all-reduces and then divides by the group's size, as a data-parallel
gradient is: every rank holds half of the gradient instead."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cases.catalog import normed_mlp_lm_case
from harness.parallel_dims import ParallelDims

CASE = normed_mlp_lm_case("adamw", steps=2)
NPROC = 2
BUG = True


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; backward sums the ranks' partial gradients (unless ``bug``)."""

    @staticmethod
    def forward(ctx, x, bug):
        ctx.bug = bug
        return x

    @staticmethod
    def backward(ctx, g):
        if ctx.bug is not True:
            g = g.clone()
            dist.all_reduce(g)
            if ctx.bug == "averaged":  # BUG (the averaged entry): a sum over the group is wanted
                g = g / dist.get_world_size()
        return g, None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward (the row-parallel partial sums); backward passes the gradient."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, world: int, bug: bool):
        super().__init__()
        rows = slice(rank * full.out_features // world, (rank + 1) * full.out_features // world)
        self.weight = nn.Parameter(full.weight[rows].detach().clone())
        self.bias = nn.Parameter(full.bias[rows].detach().clone())
        self.bug = bug

    def forward(self, x):
        return F.linear(_CopyToRegion.apply(x, self.bug), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        cols = slice(rank * full.in_features // world, (rank + 1) * full.in_features // world)
        self.weight = nn.Parameter(full.weight[:, cols].detach().clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        return _ReduceFromRegion.apply(F.linear(x, self.weight)) + self.bias


def train(ctx, run, bug=None):
    bug = BUG if bug is None else bug
    model = CASE.build_model(ctx.device)
    for block in model.blocks:
        block.up = ColumnParallelLinear(block.up, ctx.rank, ctx.world_size, bug)
        block.down = RowParallelLinear(block.down, ctx.rank, ctx.world_size)
        run.shard(block.up.weight, 0, group=dist.group.WORLD)
        run.shard(block.up.bias, 0, group=dist.group.WORLD)
        run.shard(block.down.weight, 1, group=dist.group.WORLD)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, ParallelDims(tp=ctx.world_size).layout(ctx.rank))
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss if run.layout.holds_loss else None, batch.ids)
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, bug=False)


def averaged(ctx, run):
    train(ctx, run, bug="averaged")
