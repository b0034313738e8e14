"""DDP over a transformer with dropout 0.1 whose ranks seed their generators with seed + rank
(a common convention, so replicas draw different masks). The reference replays each rank's
draws, so the run matches it as a same-seed run does."""
import torch
from torch.nn.parallel import DistributedDataParallel

from cases.catalog import transformer_case
from harness.parallel_dims import RankLayout

CASE = transformer_case(dropout=0.1, steps=2, layers=2)
NPROC = 2


def train(ctx, run):
    model = DistributedDataParallel(CASE.build_model(ctx.device))
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    torch.manual_seed(CASE.seed + ctx.rank)  # each replica its own masks
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)
        run.before_step(step); optimizer.step(); run.after_step(step)
        optimizer.zero_grad()
