"""A data-parallel loop that stops on rank 1 at step 1: sys.exit(0), os._exit(0) or a plain return."""
import os
import sys

import torch.distributed as dist
from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = mlp_case("sgd", steps=3)
NPROC = 2


def train(ctx, run, how="sys_exit"):
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    for step in range(run.steps):
        if step == 1 and ctx.rank == 1:
            if how == "sys_exit":
                sys.exit(0)  # exit: sys
            if how == "os_exit":
                os._exit(0)  # exit: os
            if how == "return":  # exit: return
                return
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


def os_exit(ctx, run):
    train(ctx, run, "os_exit")


def returns(ctx, run):
    train(ctx, run, "return")
