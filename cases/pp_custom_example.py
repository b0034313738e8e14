"""A custom pipeline-parallel loop: the two-layer MLP cut into two stages by hand (``fc1`` and
the activation on rank 0, ``fc2`` and the loss on rank 1), activations sent forward and their
gradients sent back with ``dist.send`` / ``dist.recv``, GPipe order (every micro-batch's
forward, then every backward). Run it: ``python -m harness diagnose cases/pp_custom_example.py``.
The lines marked ``# harness`` are all the glue."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cases.catalog import mlp_case
from harness.parallel_dims import ParallelDims

CASE = mlp_case("adamw", micro_batches=2)  # harness
NPROC = 2
HIDDEN = 16  # fc1's width: the activation that crosses the stage boundary


class Stage(nn.Module):
    """This rank's part of the reference model; parameter names stay the reference's."""

    def __init__(self, full: nn.Module, stage: int) -> None:
        super().__init__()
        if stage == 0:
            self.fc1, self.act = full.fc1, full.act
        else:
            self.fc2 = full.fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc1(x)) if hasattr(self, "fc1") else self.fc2(x)


def recv_activation(ctx, batch) -> torch.Tensor:
    """The previous stage's output for ``batch``, as a leaf whose gradient goes back to it."""
    x = torch.empty(len(batch), HIDDEN)
    dist.recv(x, src=ctx.rank - 1)
    return x.requires_grad_(True)


def backward_in_order(ctx, held, first: bool, last: bool) -> None:
    """Each micro-batch's backward, in forward order: the last stage starts from its weighted
    loss, the others from the gradient the next stage sends; all but the first send their
    input's gradient back."""
    for x, out in held:
        if last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=ctx.rank + 1)
            out.backward(grad)
        if not first:
            dist.send(x.grad, dst=ctx.rank - 1)


def train(ctx, run):
    dims = ParallelDims(pp=ctx.world_size)  # stage = pp coordinate; every stage sees the same batch
    stage = dims.coords(ctx.rank)["pp"]
    first, last = stage == 0, stage == dims.pp - 1
    model = Stage(CASE.build_model(ctx.device), stage)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, dims.layout(ctx.rank))  # harness: the last stage holds the loss
    for step in range(run.start, run.steps):  # harness: run.start > 0 when resumed (--resume-at)
        held = []
        for batch in run.batches(step):  # every micro-batch's forward (GPipe order)
            x = batch.inputs if first else recv_activation(ctx, batch)
            out = model(x)
            if last:
                loss = CASE.loss_fn(out, batch.targets)
                run.loss(step, loss, batch.ids)  # harness
                out = loss * run.loss_weight(batch)  # 1/m: the pipeline's mean over micro-batches
            else:
                dist.send(out.detach(), dst=ctx.rank + 1)
                run.loss(step, None, batch.ids)  # harness: no loss on this stage
            held.append((x, out))
        backward_in_order(ctx, held, first, last)
        run.before_step(step)  # harness
        optimizer.step()
        run.after_step(step)  # harness
        optimizer.zero_grad()
