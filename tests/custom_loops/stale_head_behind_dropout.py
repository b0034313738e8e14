"""DP loop on the tiny transformer with dropout whose head is restored from a stale copy after
every optimizer step: step 0 matches, step 1 departs at the head, after five dropouts - their
step-1 masks are the ranks' own, taken as inputs of the step by the replay."""
import torch
import torch.distributed as dist

from cases.catalog import transformer_case
from harness.parallel_dims import RankLayout

CASE = transformer_case("adamw", steps=2, layers=2, dropout=0.1)
NPROC = 2
BUG = True  # the head restored from its stale copy after every step


def train(ctx, run, bug=None):
    bug = BUG if bug is None else bug
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    stale = [p.detach().clone() for p in model.head.parameters()]
    for step in range(run.steps):
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
        if bug:
            with torch.no_grad():
                for p, s in zip(model.head.parameters(), stale):
                    p.copy_(s)
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, bug=False)
