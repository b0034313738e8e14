"""Data-parallel loop with 2 micro-batches on 2 ranks; the bug backpropagates each
micro-batch's mean loss unweighted, so gradients are 2 x the reference's - the factor that
summing over the 2 replicas without dividing would give too."""
import torch.distributed as dist

from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = mlp_case("sgd", steps=2, micro_batches=2)
NPROC = 2


def train(ctx, run, weighted=False):
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch) if weighted else loss).backward()  # BUG unless weighted
            run.loss(step, loss, batch.ids)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, weighted=True)
