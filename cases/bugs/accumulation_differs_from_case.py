"""A DDP loop whose optimizer steps every 4 micro-batches while the case's step is 2.

Real-world class: a framework's or trainer's ``gradient_accumulation_steps`` (or batch size)
set apart from the experiment's global batch: each optimizer step consumes twice the samples
the single-device run does, so every loss, gradient and update differs from the first step.
The loop hooks the optimizer's own step (``run.watch(..., hook_step=True)``), as framework
loops do, and collates the dataset with torch's default collate.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from cases.catalog import mlp_case

EXPECTED_CODE = "batch-size-mismatch"
NPROC = 2
CASE = mlp_case("adamw", steps=2, micro_batches=2)
ACCUMULATE = 4  # BUG: the case's global batch is 2 micro-batches per replica


def train(ctx, run):
    model = DistributedDataParallel(CASE.build_model(ctx.device))
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, hook_step=True)
    micro = CASE.global_batch_size // (ctx.world_size * CASE.micro_batches)
    loader = DataLoader(CASE.dataset, batch_size=micro, sampler=DistributedSampler(CASE.dataset, seed=CASE.seed))
    for i, batch in enumerate(loader):
        loss = CASE.loss_fn(model(batch.input), batch.target)
        run.loss(run.step, loss, batch.id)
        (loss / ACCUMULATE).backward()
        if (i + 1) % ACCUMULATE == 0:
            optimizer.step()
            optimizer.zero_grad()
        if run.done:
            break
