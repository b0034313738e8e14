"""DeepSpeed ZeRO (stage 2 by default; 1 and 3 as variants) training the MLP with gradient
accumulation, as a DeepSpeed user writes it; the harness reads the partitioned state through
DeepSpeed's own accessors. The bug: the loss divided by the accumulation steps again, though
``engine.backward`` already scales by them (gradients half the reference's)."""
import deepspeed
from torch.utils.data import DataLoader, DistributedSampler

from cases.catalog import mlp_case

CASE = mlp_case("adamw", steps=2, micro_batches=2)
NPROC = 2


def train(ctx, run, stage=2, bug=True):
    model = CASE.build_model(ctx.device)
    micro = CASE.global_batch_size // (ctx.world_size * CASE.micro_batches)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": CASE.micro_batches,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=CASE.build_optimizer(model.parameters()), config=config)
    run.watch(engine, hook_step=True)                                                 # harness
    loader = DataLoader(CASE.dataset, batch_size=micro, sampler=DistributedSampler(CASE.dataset, seed=CASE.seed))
    for batch in loader:
        loss = CASE.loss_fn(engine(batch.input), batch.target)
        run.loss(run.step, loss, batch.id)                                            # harness
        engine.backward(loss / CASE.micro_batches if bug else loss)  # BUG when bug: scaled twice
        engine.step()
        if run.done:                                                                  # harness
            break


def correct(ctx, run):
    train(ctx, run, bug=False)


def zero1(ctx, run):
    train(ctx, run, stage=1, bug=False)


def zero3(ctx, run):
    train(ctx, run, stage=3, bug=False)


def zero3_bug(ctx, run):
    train(ctx, run, stage=3, bug=True)
