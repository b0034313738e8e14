"""A data-parallel loop whose ranks sleep at step 1 (after marking STARTED_DIR): a run to interrupt."""
import os
import time
import torch.distributed as dist
from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = mlp_case("sgd", steps=3)
NPROC = 2


def train(ctx, run):
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    for step in range(run.steps):
        if step == 1:
            open(os.path.join(os.environ["STARTED_DIR"], f"rank{ctx.rank}"), "w").close()
            time.sleep(600)
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
