"""A masked (padded) language-model loss under data parallelism with gradient accumulation:
the loss of a micro-batch is the mean over its *valid tokens*, and the case says so
(``loss_normaliser=valid_tokens``): the step's loss is the mean over all of the step's valid
tokens, on one device and on every replica. The glue is the plain one - ``run.loss_weight``
weights each micro-batch by its share of the step's valid tokens (the harness counts them from
the dataset), ``run.loss`` combines the replicas' pieces by their counts:

    python -m harness diagnose cases/masked_loss_example.py                      # PASS
    python -m harness diagnose cases/masked_loss_example.py:local_normalisation  # per-replica-statistic

``local_normalisation`` is the classic bug: every replica and micro-batch divides by its own
count and they are averaged with equal weights. The loops read the case from ``run.case``, so
other files reuse them with their own ``CASE`` (``tests/custom_loops/masked_loss*.py``).
"""
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cases.catalog import masked_lm_case
from harness.parallel_dims import RankLayout

CASE = masked_lm_case(micro_batches=2, normalised=True)
NPROC = 2


def _setup(ctx, run):
    model = DistributedDataParallel(run.case.build_model(ctx.device))
    optimizer = run.case.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    return model, optimizer


def train(ctx, run):
    """Correct for a case with ``loss_normaliser``: the harness's weights do the normalising."""
    model, optimizer = _setup(ctx, run)
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = run.case.forward_loss(model, batch)      # the micro-batch's masked mean
            (loss * run.loss_weight(batch)).backward()      # its share of the step's valid tokens
            run.loss(step, loss, batch.ids)
        run.before_step(step); optimizer.step(); run.after_step(step)
        optimizer.zero_grad()


def local_normalisation(ctx, run):
    """BUG: each replica's micro-batch normalised by its own count, weighted by its samples."""
    model, optimizer = _setup(ctx, run)
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = run.case.forward_loss(model, batch)
            (loss * run.loss_weight(len(batch))).backward()  # BUG: a share of the samples, not of the tokens
            run.loss(step, loss, batch.ids)
        run.before_step(step); optimizer.step(); run.after_step(step)
        optimizer.zero_grad()


def per_micro_batch_normalisation(ctx, run):
    """Correct for a case *without* ``loss_normaliser`` (each micro-batch's masked mean over
    the whole micro-batch, across replicas): every replica divides its masked sum by the
    micro-batch's global count, all-reduced."""
    model, optimizer = _setup(ctx, run)
    world = ctx.world_size
    for step in range(run.steps):
        for batch in run.batches(step):
            local = batch.targets["mask"].sum()
            count = local.clone().float()
            dist.all_reduce(count)                          # the micro-batch's valid tokens, all replicas
            loss = run.case.forward_loss(model, batch)      # local masked mean
            (loss * local * world / count * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids, normaliser=float(local))
        run.before_step(step); optimizer.step(); run.after_step(step)
        optimizer.zero_grad()


def unweighted_accumulation(ctx, run):
    """BUG under any case: the accumulated micro-batch losses are never weighted."""
    model, optimizer = _setup(ctx, run)
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = run.case.forward_loss(model, batch)
            (loss * run.loss_weight(len(batch)) * run.case.micro_batches).backward()  # BUG: x micro-batches
            run.loss(step, loss, batch.ids)
        run.before_step(step); optimizer.step(); run.after_step(step)
        optimizer.zero_grad()
