"""Data-parallel loop that builds its epoch order once and never reshuffles: the sampler's
``set_epoch`` is never called, so every epoch repeats the first one's order. The first epoch
(4 steps of the 64-sample MLP case at global batch 16) is right; the bug shows only after the
epoch wraps, where the reference draws a new permutation."""
import torch.distributed as dist

from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout
from reference.case import collate
from reference.schedule import replica_micro_batch_indices

CASE = mlp_case("sgd", steps=12)
NPROC = 2
STEPS_PER_EPOCH = 64 // 16


def train(ctx, run, set_epoch=False):
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    layout = RankLayout.data_parallel(ctx.rank, ctx.world_size)
    run.watch(model, optimizer, layout)
    for step in range(run.steps):
        # BUG unless set_epoch: the order of epoch 0 again and again.
        at = step if set_epoch else step % STEPS_PER_EPOCH
        for idx in replica_micro_batch_indices(CASE, at, layout.dp_rank, layout.dp_size):
            batch = collate(CASE.dataset, idx, device=ctx.device, dtype=CASE.dtype, step=step)
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


def correct(ctx, run):
    train(ctx, run, set_epoch=True)
