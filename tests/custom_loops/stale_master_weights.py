"""Data parallelism with a separate copy of the weights ("master weights", as a mixed-precision
loop keeps them) that the loop copies into the model before every step - but the optimizer
was built over the model's own parameters, so the masters never learn: from step 1 on each
forward runs with the initial weights again. Step 0 is right (its update is recorded before
the copy reverts it); the run departs in step 1's forward, at the first layer."""
import torch
import torch.distributed as dist

from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = mlp_case("sgd", steps=3)
NPROC = 2


def train(ctx, run, masters_learn=False):
    model = CASE.build_model(ctx.device)
    masters = [p.detach().clone() for p in model.parameters()]
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    for step in range(run.steps):
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                if masters_learn:  # the right loop keeps the masters where the optimizer left the weights
                    m.copy_(p)
                p.copy_(m)  # BUG unless masters_learn: the stale masters overwrite the last update
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, masters_learn=True)
