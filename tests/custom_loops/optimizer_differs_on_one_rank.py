"""Hand-written data parallelism where rank 1's AdamW is built with another ``eps``: the
gradients are averaged and agree on every rank, the update on rank 1 does not. The comparison
reads rank 0's copy (right); the replicas go apart after step 0, and the location is rank 1's
optimizer step."""
import torch.distributed as dist

from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = mlp_case("adamw", steps=2)
NPROC = 2


def train(ctx, run, eps_on_rank_1=1e-3):
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    if ctx.rank == 1 and eps_on_rank_1 is not None:
        for group in optimizer.param_groups:
            group["eps"] = eps_on_rank_1  # BUG: a config read on one rank only
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
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
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, eps_on_rank_1=None)
