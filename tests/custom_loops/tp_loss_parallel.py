"""Tensor-parallel loop whose vocab-parallel cross entropy is torch's own: the tiny transformer
under the Llama-style plan, its head column-parallel with DTensor logits (``Shard(-1)``, no
gather), the loss under ``loss_parallel()``. The correct loop passes. The bug (``BUG``) divides
the loss by the tensor-parallel size, as if the TP ranks' losses were summed somewhere: every
gradient is halved (``grad-scaled``), and the loss's ops match the reference's up to its
``nll_loss_forward``, after which the rank computes a ``div`` the reference has not."""
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

from cases.catalog import transformer_case
from cases.strategies.tp import apply_tensor_parallel
from harness.parallel_dims import ParallelDims

CASE = transformer_case("adamw", steps=2, layers=2, vocab=32)
NPROC = 2
BUG = True


def train(ctx, run, bug=None):
    bug = BUG if bug is None else bug
    dims = ParallelDims(tp=ctx.world_size)
    mesh = dims.build_mesh(ctx.device.type)
    model = apply_tensor_parallel(CASE.build_model(ctx.device), mesh)
    parallelize_module(model, mesh, {"head": ColwiseParallel(use_local_output=False)})
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, dims.layout(ctx.rank))
    for step in range(run.steps):
        for batch in run.batches(step):
            logits = model(batch.inputs)
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, -2), batch.targets.flatten())
                if bug:  # BUG: the TP ranks hold one replica's loss, not pieces of a sum
                    loss = loss / ctx.world_size
                (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss.full_tensor() if run.layout.holds_loss else None, batch.ids)
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, bug=False)
