"""Hand-written TP MLP (column- then row-parallel) with gradient clipping by the global norm
(the sharded gradients' squares all-reduced, the replicated bias counted once); the bug clips
on rank 0 only, with torch's clip_grad_norm_ over its own shards."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from cases.catalog import mlp_case
from harness.parallel_dims import ParallelDims

CASE = mlp_case("sgd", steps=2).replace(grad_clip=0.05)
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


def clip_by_global_norm(model, max_norm):
    sharded = [model.fc1.weight, model.fc1.bias, model.w2]
    sq = torch.stack([p.grad.pow(2).sum() for p in sharded]).sum()
    dist.all_reduce(sq)
    total = (sq + model.b2.grad.pow(2).sum()).sqrt()
    coef = min(1.0, float(max_norm / (total + 1e-6)))
    for p in model.parameters():
        p.grad.mul_(coef)


def train(ctx, run, bug=True):
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
        if bug:
            if ctx.rank == 0:  # BUG: only the first TP rank clips
                torch.nn.utils.clip_grad_norm_(model.parameters(), CASE.grad_clip)
        else:
            clip_by_global_norm(model, CASE.grad_clip)
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, bug=False)
