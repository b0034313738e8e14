"""Hugging Face accelerate's DDP with gradient accumulation (``accelerator.accumulate``), as an
accelerate user writes it: the optimizer's step runs only on the accumulation boundary, where the
harness records it. Bugs: the loss divided by the accumulation steps again (``accelerator.backward``
already does), an Accelerator that accumulates 4 micro-batches where the case says 2, and a loader every rank reads whole. Every
variant ends as accelerate documents a loop's end, with ``accelerator.end_training()``, which
destroys the default process group: the harness finishes its own work anyway."""
from accelerate import Accelerator
from torch.utils.data import DataLoader, DistributedSampler

from cases.catalog import mlp_case

CASE = mlp_case("adamw", steps=2, micro_batches=2)
NPROC = 2


def train(ctx, run, divide=True, accumulate=CASE.micro_batches, shard=True):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = CASE.build_model(ctx.device)
    model, optimizer = accelerator.prepare(model, CASE.build_optimizer(model.parameters()))
    run.watch(model, optimizer, hook_step=True)                                      # harness
    micro = CASE.global_batch_size // (ctx.world_size * CASE.micro_batches)
    sampler = DistributedSampler(CASE.dataset, seed=CASE.seed) if shard else None  # BUG when not shard: every rank reads all
    loader = DataLoader(CASE.dataset, batch_size=micro, sampler=sampler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = CASE.loss_fn(model(batch.input), batch.target)
            run.loss(run.step, loss, batch.id)                                        # harness
            accelerator.backward(loss / accumulate if divide else loss)  # BUG when divide: scaled twice
            optimizer.step()
            optimizer.zero_grad()
        if run.done:                                                                  # harness
            break
    accelerator.end_training()  # destroys the default process group


def correct(ctx, run):
    train(ctx, run, divide=False)


def accumulates_four(ctx, run):
    """The Accelerator steps after 4 micro-batches; the case's global batch is 2 of them."""
    train(ctx, run, divide=False, accumulate=4)


def loader_not_sharded(ctx, run):
    """The plain DataLoader was never given a DistributedSampler (nor accelerator.prepare): every
    rank reads the same samples."""
    train(ctx, run, divide=False, shard=False)
