"""Hand-written Megatron-style vocab-parallel LM head and cross entropy on the tiny transformer
(the rest replicated): the 31-token vocabulary is padded to 32 (a multiple of 8 x tp) in the
head's forward, so rank 0 holds 16 real rows and rank 1 its 15 plus a zero pad row. The loss
is computed from the local logits with all-reduces (max, sum of exponentials, target logit) and
the pad columns must be -inf before the normaliser; the bug leaves them at 0, so every token's
normaliser gains exp(0 - max) and the loss and all gradients leave the unpadded reference's."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cases.catalog import transformer_case
from harness.parallel_dims import ParallelDims

VOCAB = 31  # odd: two ranks cannot split it evenly
CASE = transformer_case("adamw", steps=2, vocab=VOCAB, layers=2, name="transformer-vocab31-adamw")
NPROC = 2
BUG = True
DIVISIBLE_BY = 8  # Megatron's make_vocab_size_divisible_by (per tensor-parallel rank)


class _ReducePartial(torch.autograd.Function):
    """Per-rank partial sums -> their sum, used identically on every rank: backward passes the
    gradient through."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class _CopyToShards(torch.autograd.Function):
    """Replicated input of a vocab-parallel (column-parallel) linear: backward sums the ranks'
    gradients."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class VocabParallelHead(nn.Module):
    """This rank's rows of the head (the unpadded shard, the reference's rows), padded with zero
    rows to ``padded // world`` in forward: returns the local logits."""

    def __init__(self, full, rank, world):
        super().__init__()
        multiple = DIVISIBLE_BY * world
        self.per_rank = -(-full.out_features // multiple) * multiple // world
        self.start = rank * self.per_rank
        self.real = max(0, min(full.out_features - self.start, self.per_rank))
        rows = slice(self.start, self.start + self.real)
        self.weight = nn.Parameter(full.weight[rows].detach().clone())
        self.bias = nn.Parameter(full.bias[rows].detach().clone())

    def forward(self, x):
        pad = self.per_rank - self.real
        weight = F.pad(self.weight, (0, 0, 0, pad))
        bias = F.pad(self.bias, (0, pad))
        return F.linear(_CopyToShards.apply(x), weight, bias)


def vocab_parallel_cross_entropy(logits, targets, head, bug, target_offset=True):
    """Mean cross entropy over every position, from each rank's slice of the (padded) vocab."""
    logits = logits.flatten(0, -2).float()
    targets = targets.flatten()
    if not bug:  # BUG when skipped: the pad columns stay in the normaliser
        pad = torch.arange(logits.shape[-1], device=logits.device) >= head.real
        logits = logits.masked_fill(pad, float("-inf"))
    top = logits.detach().max(-1, keepdim=True).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    shifted = logits - top
    sum_exp = _ReducePartial.apply(shifted.exp().sum(-1))
    # BUG when not target_offset: each rank reads the target's logit at the global index in its
    # local slice (no shift by the slice's start), so rank 1 picks the wrong tokens' logits.
    local = targets - head.start if target_offset else targets
    mine = (local >= 0) & (local < head.real)
    picked = shifted.gather(1, torch.where(mine, local, 0)[:, None]).squeeze(1)
    target_logit = _ReducePartial.apply(torch.where(mine, picked, torch.zeros_like(picked)))
    return (sum_exp.log() - target_logit).mean()


def train(ctx, run, bug=None, target_offset=True):
    bug = BUG if bug is None else bug
    model = CASE.build_model(ctx.device)
    model.head = VocabParallelHead(model.head, ctx.rank, ctx.world_size)
    run.shard(model.head.weight, 0, group=dist.group.WORLD); run.shard(model.head.bias, 0, group=dist.group.WORLD)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, ParallelDims(tp=ctx.world_size).layout(ctx.rank))
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = vocab_parallel_cross_entropy(model(batch.inputs), batch.targets, model.head, bug, target_offset)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss if run.layout.holds_loss else None, batch.ids)
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, bug=False)


def target_not_offset(ctx, run):
    """The pad columns masked (that bug fixed), but the target's logit read without the slice's offset."""
    train(ctx, run, bug=False, target_offset=False)
