"""Hand-written TP MLP whose row-parallel matmul is written inline in the model's own forward
(no submodule of its own); the bug uses its partial sums without the all-reduce."""
import io

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cases.catalog import mlp_case
from harness.parallel_dims import ParallelDims

CASE = mlp_case("adamw", steps=2)
NPROC = 2


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class Sharded(nn.Module):
    def __init__(self, full, rank, world, reduce, bias_first=False):
        super().__init__()
        self.bias_first = bias_first
        n = full.fc1.out_features // world
        self.fc1 = nn.Linear(full.fc1.in_features, n)
        with torch.no_grad():
            self.fc1.weight.copy_(full.fc1.weight[rank * n:(rank + 1) * n]); self.fc1.bias.copy_(full.fc1.bias[rank * n:(rank + 1) * n])
        self.w2 = nn.Parameter(full.fc2.weight[:, rank * n:(rank + 1) * n].detach().clone())
        self.b2 = full.fc2.bias
        self.reduce = reduce

    def forward(self, x):
        partial = F.linear(torch.relu(self.fc1(x)), self.w2)
        if self.bias_first:  # BUG (bias_before_reduce): the bias added on every rank, then summed
            return _Reduce.apply(partial + self.b2)
        return (_Reduce.apply(partial) if self.reduce else partial) + self.b2  # BUG unless reduce


def train(ctx, run, reduce=False, group=True, bias_first=False):
    model = Sharded(CASE.build_model(ctx.device), ctx.rank, ctx.world_size, reduce, bias_first)
    g = {"group": dist.group.WORLD} if group else {}  # without one: the layout's TP group
    run.shard(model.fc1.weight, 0, **g); run.shard(model.fc1.bias, 0, **g); run.shard(model.w2, 1, **g)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, ParallelDims(tp=ctx.world_size).layout(ctx.rank), names={"w2": "fc2.weight", "b2": "fc2.bias"})
    torch.save(model.state_dict(), io.BytesIO())  # a declared model still pickles
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
    train(ctx, run, reduce=True)


def layout_group(ctx, run):
    """Shards declared without a group: the layout's "tp" group."""
    train(ctx, run, reduce=True, group=False)


def bias_before_reduce(ctx, run):
    """The partial sums all-reduced, but the bias added to each before: counted N times."""
    train(ctx, run, bias_first=True)
