"""A custom loop with its own checkpoint code that saves the model and the optimizer but not the
lr scheduler: after the resume, warm-up starts over.

Real-world class: a hand-written ``save_checkpoint`` with ``{"model": ..., "optimizer": ...}``
(the scheduler added to the loop later, never to the checkpoint), reported as "the LR scheduler
is back at step 0 after resume". The loaded param groups carry the saved lr, so the first
resumed loss is bitwise right; the next ``scheduler.step()`` computes warm-up step 1's lr again.
The target's ``save(ctx, run, path)`` / ``load(ctx, run, path)`` are the loop's own checkpoint
code: the harness calls them at ``--resume-at`` and gates what they restored.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.distributed as dist

from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

EXPECTED_CODE = "resume-scheduler-not-restored"
NPROC = 2
RESUME_AT = 2
CASE = dataclasses.replace(
    mlp_case("adamw", steps=4),
    lr_scheduler_factory=functools.partial(torch.optim.lr_scheduler.LinearLR, start_factor=0.25, total_iters=3),
)


def train(ctx, run):
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    scheduler = CASE.build_lr_scheduler(optimizer)
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size), lr_scheduler=scheduler)
    for step in range(run.start, run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        run.before_step(step)
        optimizer.step()
        scheduler.step()  # before run.after_step: the lr recorded (and saved) is the next step's
        run.after_step(step)
        optimizer.zero_grad()


def save(ctx, run, path):
    """The loop's checkpoint: the replicas are equal, so rank 0 writes one file."""
    if ctx.rank == 0:
        torch.save({"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict()},
                   os.path.join(path, "checkpoint.pt"))  # BUG: run.lr_scheduler.state_dict() is not saved
    dist.barrier()


def load(ctx, run, path):
    state = torch.load(os.path.join(path, "checkpoint.pt"), weights_only=True)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
