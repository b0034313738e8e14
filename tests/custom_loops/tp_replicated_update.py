"""Hand-written TP MLP (column- then row-parallel) whose replicated output bias is treated as
"owned" by tensor-parallel rank 0: the other ranks drop its gradient before the optimizer
step and expect rank 0 to broadcast the updated value. The bug forgets the broadcast, so the
bias's copies drift apart across the TP ranks of the one replica (the class of the BLOOM
training incident: replicated weights diverging between TP ranks). A second bug clips the
replicated bias's gradient on rank 0 only."""
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cases.catalog import mlp_case
from harness.parallel_dims import ParallelDims

# Plain SGD: no optimizer state that only rank 0 would hold.
CASE = mlp_case("sgd", steps=3).replace(name="mlp-plain-sgd", optimizer_factory=functools.partial(torch.optim.SGD, lr=0.05))
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
    def __init__(self, full, rank, world):
        super().__init__()
        n = full.fc1.out_features // world
        self.fc1 = nn.Linear(full.fc1.in_features, n)
        with torch.no_grad():
            self.fc1.weight.copy_(full.fc1.weight[rank * n:(rank + 1) * n]); self.fc1.bias.copy_(full.fc1.bias[rank * n:(rank + 1) * n])
        self.w2 = nn.Parameter(full.fc2.weight[:, rank * n:(rank + 1) * n].detach().clone())
        self.b2 = full.fc2.bias

    def forward(self, x):
        return _Reduce.apply(F.linear(torch.relu(self.fc1(x)), self.w2)) + self.b2


def train(ctx, run, bug="no-broadcast"):
    model = Sharded(CASE.build_model(ctx.device), ctx.rank, ctx.world_size)
    g = dist.group.WORLD
    run.shard(model.fc1.weight, 0, group=g); run.shard(model.fc1.bias, 0, group=g); run.shard(model.w2, 1, group=g)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, ParallelDims(tp=ctx.world_size).layout(ctx.rank), names={"w2": "fc2.weight", "b2": "fc2.bias"})
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss if run.layout.holds_loss else None, batch.ids)
        if bug == "clip" and ctx.rank == 0:
            torch.nn.utils.clip_grad_norm_([model.b2], 0.01)  # BUG: the replicated bias clipped on rank 0 only
        run.before_step(step)
        if ctx.rank != 0:
            model.b2.grad = None  # rank 0 updates the replicated bias for everyone
        optimizer.step()
        if bug != "no-broadcast":
            dist.broadcast(model.b2.data, src=0)
        run.after_step(step)
        optimizer.zero_grad()


def clip_on_one_rank(ctx, run):
    train(ctx, run, bug="clip")


def correct(ctx, run):
    train(ctx, run, bug=None)
