"""DDP over a transformer with dropout 0.1 whose loop evaluates after each step - and puts the
model in eval mode for that without putting it back: from step 1 on, training runs without
dropout. Step 0 is right; the run departs at step 1, in the first dropout module."""
import torch
from torch.nn.parallel import DistributedDataParallel

from cases.catalog import transformer_case
from harness.parallel_dims import RankLayout

CASE = transformer_case(dropout=0.1, steps=3, layers=2)
NPROC = 2


def train(ctx, run, back_to_train=False):
    model = DistributedDataParallel(CASE.build_model(ctx.device))
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    validation = run.batches(0)[0].inputs
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)
        run.before_step(step); optimizer.step(); run.after_step(step)
        optimizer.zero_grad()
        model.eval()  # a validation pass
        with torch.no_grad():
            model.module(validation)
        if back_to_train:  # BUG unless back_to_train: model.train() is never called again
            model.train()


def correct(ctx, run):
    train(ctx, run, back_to_train=True)
