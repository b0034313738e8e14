"""Megatron-style vocab-parallel embedding by hand on the tiny transformer: each rank holds
half of the embedding rows; tokens outside a rank's range must contribute zero before the
all-reduce. BUG: the out-of-range rows are looked up at index 0 and never zeroed."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cases.catalog import transformer_case
from harness.parallel_dims import ParallelDims

CASE = transformer_case("adamw", steps=2, layers=2, vocab=32)
NPROC = 2
BUG = True


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full, rank, world, bug):
        super().__init__()
        n = full.num_embeddings // world
        self.start, self.end, self.bug = rank * n, (rank + 1) * n, bug
        self.weight = nn.Parameter(full.weight[self.start:self.end].detach().clone())

    def forward(self, x):
        outside = (x < self.start) | (x >= self.end)
        local = (x - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        if not self.bug:
            out = out.masked_fill(outside[..., None], 0.0)
        return _Reduce.apply(out)


def train(ctx, run, bug=None):
    bug = BUG if bug is None else bug
    model = CASE.build_model(ctx.device)
    model.embed = VocabParallelEmbedding(model.embed, ctx.rank, ctx.world_size, bug)
    run.shard(model.embed.weight, 0, group=dist.group.WORLD)
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
