"""A custom data-parallel training loop (no DDP) diagnosed by the harness.

Run it: ``python -m harness diagnose cases/custom_example.py``. The loop is ordinary
hand-written data parallelism; the lines marked ``# harness`` are all the glue it needs: the
harness trains the single-device reference, records this loop on every rank, compares and names
what is wrong. Change ``/ ctx.world_size`` below to see ``grad-not-averaged``.
"""

from __future__ import annotations

import torch.distributed as dist

from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = mlp_case("adamw")  # harness: the model, data with sample ids, loss and optimizer
NPROC = 2


def train(ctx, run):
    model = CASE.build_model(ctx.device)  # the same seeded weights on every rank
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))  # harness
    for step in range(run.start, run.steps):  # harness: run.start > 0 when resumed (--resume-at)
        for batch in run.batches(step):  # this replica's shard (or your own loader + ids)
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)  # harness
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        run.before_step(step)  # harness
        optimizer.step()
        run.after_step(step)  # harness
        optimizer.zero_grad()
