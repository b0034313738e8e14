"""Data-parallel loop on the tiny transformer that computes its loss itself, with label
smoothing the case does not have (``F.cross_entropy(..., label_smoothing=0.1)``): the forward
matches, the loss departs. Its ops match the reference's ``_log_softmax`` and
``nll_loss_forward``; after them the rank computes the smoothing term the reference has not."""
import torch.distributed as dist
import torch.nn.functional as F

from cases.catalog import transformer_case
from harness.parallel_dims import RankLayout

CASE = transformer_case("adamw", steps=2, layers=2)
NPROC = 2
SMOOTHING = 0.1  # BUG: the case's loss has none


def train(ctx, run, smoothing=None):
    smoothing = SMOOTHING if smoothing is None else smoothing
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    for step in range(run.steps):
        for batch in run.batches(step):
            logits = model(batch.inputs)
            loss = F.cross_entropy(logits.flatten(0, -2), batch.targets.flatten(), label_smoothing=smoothing)
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
    train(ctx, run, smoothing=0.0)


def own_loader(ctx, run, smoothing=None):
    """The same loss, the batches from the loop's own DataLoader (not run.batches): the probe
    takes the first forward's input from the model call and the targets from the samples the
    loop names in run.loss."""
    from torch.utils.data import DataLoader, DistributedSampler

    smoothing = SMOOTHING if smoothing is None else smoothing
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    sampler = DistributedSampler(CASE.dataset, seed=CASE.seed)
    loader = DataLoader(CASE.dataset, batch_size=CASE.global_batch_size // ctx.world_size, sampler=sampler)
    for step, batch in zip(range(run.steps), loader):
        logits = model(batch.input)
        loss = F.cross_entropy(logits.flatten(0, -2), batch.target.flatten(), label_smoothing=smoothing)
        loss.backward()
        run.loss(step, loss, batch.id)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def own_loader_correct(ctx, run):
    own_loader(ctx, run, smoothing=0.0)
