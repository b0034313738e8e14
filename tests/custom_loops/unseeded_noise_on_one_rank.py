"""Data-parallel loop where rank 1 adds input noise from a generator nobody seeded (an
augmentation written with ``torch.Generator()`` and ``g.seed()``, or a library's own RNG): the
other ranks repeat, rank 1 does not. Its forward draws something new every run, so two runs
of the program differ bitwise from rank 1's first loss on (and, the noise being real, the run
also leaves one device's values: numeric-mismatch beside nondeterministic-run)."""
import dataclasses

import torch
import torch.distributed as dist

from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout
from reference.case import collate
from reference.schedule import replica_micro_batch_indices

CASE = mlp_case("sgd")
NPROC = 2


def train(ctx, run, noise=True):
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    layout = RankLayout.data_parallel(ctx.rank, ctx.world_size)
    run.watch(model, optimizer, layout)
    unseeded = torch.Generator()
    unseeded.seed()  # BUG (with noise on rank 1): a seed from the OS, not the program
    for step in range(run.steps):
        for idx in replica_micro_batch_indices(CASE, step, layout.dp_rank, layout.dp_size):
            batch = collate(CASE.dataset, idx, device=ctx.device, dtype=CASE.dtype, step=step)
            if noise and ctx.rank == 1:
                batch = dataclasses.replace(batch, inputs=batch.inputs + 1e-3 * torch.randn(batch.inputs.shape, generator=unseeded))
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


def seeded(ctx, run):
    train(ctx, run, noise=False)
