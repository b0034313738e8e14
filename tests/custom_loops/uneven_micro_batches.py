"""Data-parallel loop that all-reduces each micro-batch's sample count; the bug: rank 1 drops
its last micro-batch, so the ranks' collectives part ways and gloo aborts a rank."""
import torch
import torch.distributed as dist

from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = mlp_case("sgd", steps=2, micro_batches=2)
TIMEOUT = 30


def count_samples(batch) -> torch.Tensor:
    n = torch.tensor([float(len(batch.ids))])
    dist.all_reduce(n)  # one per micro-batch
    return n


def train(ctx, run, uneven=True):
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    for step in range(run.steps):
        batches = list(run.batches(step))
        if uneven and ctx.rank == 1:
            batches = batches[:1]  # BUG: this rank drops its last micro-batch
        for batch in batches:
            count_samples(batch)
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)
        for p in model.parameters():
            dist.all_reduce(p.grad)  # the gradient sync
            p.grad /= ctx.world_size
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, uneven=False)
