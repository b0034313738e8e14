"""DDP with gradient accumulation normalised by the step's global token count, as Hugging Face's
Trainer does with ``num_items_in_batch``: every micro-batch's masked *sum* over the step's valid
tokens of all replicas, times the world size (DDP averages). Its training is right. What it tells
``run.loss`` differs by variant, and only that:

- ``train``: the value it backpropagates, its share of the step (sum / the step's count): the
  harness's reading (a mean over the micro-batch's own tokens) gives another loss. PASS, with the
  reading that would give the reference's loss and the glue that states it.
- ``samples_declared``: the micro-batch's token mean with ``normaliser=`` its number of samples:
  read as said, another loss; under the case's token count, the reference's. PASS, said.
- ``correct``: the micro-batch's token mean, no glue: the plain PASS.
- ``world_factor_forgotten``: BUG, the gradients are half the reference's (``grad-scaled``),
  whatever the loss says.
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cases.catalog import masked_lm_case
from harness.parallel_dims import RankLayout

CASE = masked_lm_case(micro_batches=2, normalised=True)
NPROC = 2


def _loop(ctx, run, report, world_factor=True):
    model = DistributedDataParallel(run.case.build_model(ctx.device))
    optimizer = run.case.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    for step in range(run.steps):
        batches = run.batches(step)
        num_items = torch.stack([b.targets["mask"].sum() for b in batches]).sum().float()
        dist.all_reduce(num_items)                                   # the step's valid tokens, all replicas
        for batch in batches:
            tokens = batch.targets["mask"].sum().float()
            masked_sum = run.case.forward_loss(model, batch) * tokens
            share = masked_sum / num_items
            (share * (ctx.world_size if world_factor else 1)).backward()  # BUG without the factor: DDP averages
            report(run, step, batch, share, masked_sum / tokens)
        run.before_step(step); optimizer.step(); run.after_step(step)
        optimizer.zero_grad()


def train(ctx, run):
    """Reports its share of the step's loss (what it backpropagates)."""
    _loop(ctx, run, lambda run, step, batch, share, mean: run.loss(step, share, batch.ids))


def samples_declared(ctx, run):
    """Reports the micro-batch's token mean, declared a mean over its samples."""
    _loop(ctx, run, lambda run, step, batch, share, mean: run.loss(step, mean, batch.ids, normaliser=len(batch.ids)))


def correct(ctx, run):
    """Reports the micro-batch's token mean; the case's normaliser counts its tokens."""
    _loop(ctx, run, lambda run, step, batch, share, mean: run.loss(step, mean, batch.ids))


def world_factor_forgotten(ctx, run):
    _loop(ctx, run, lambda run, step, batch, share, mean: run.loss(step, mean, batch.ids), world_factor=False)
