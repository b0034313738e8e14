"""A custom tensor-parallel loop: ``parallelize_module`` on the tiny transformer over all ranks,
the training loop written by hand. Run it: ``python -m harness diagnose cases/tp_custom_example.py``.
The lines marked ``# harness`` are all the glue; the mesh, the layout (which rank holds the loss,
each rank's coordinate and groups) come from ``harness.parallel_dims.ParallelDims``."""

from __future__ import annotations

from cases.catalog import transformer_case
from cases.strategies.tp import apply_tensor_parallel
from harness.parallel_dims import ParallelDims

CASE = transformer_case()  # harness
NPROC = 2


def train(ctx, run):
    dims = ParallelDims(tp=ctx.world_size)  # every rank one TP shard; they all see the same batch
    model = apply_tensor_parallel(CASE.build_model(ctx.device), dims.build_mesh(ctx.device.type))
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, dims.layout(ctx.rank))  # harness: tp rank 0 holds the loss
    for step in range(run.start, run.steps):  # harness: run.start > 0 when resumed (--resume-at)
        for batch in run.batches(step):  # the whole batch: one data-parallel replica
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss if run.layout.holds_loss else None, batch.ids)  # harness
        run.before_step(step)  # harness
        optimizer.step()
        run.after_step(step)  # harness
        optimizer.zero_grad()
