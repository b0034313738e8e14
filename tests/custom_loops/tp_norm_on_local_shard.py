"""Hand-written TP of a pre-norm MLP language model whose residual stream is sharded by
features: each of the two ranks holds half of the hidden features (the embedding's columns, the
norms' weights, ``down``'s output rows), ``up`` and the head are row-parallel (partial sums
all-reduced) and ``down`` is column-parallel. A LayerNorm over sharded features needs the mean
and the variance over all of them (their sums all-reduced over the tensor-parallel group); the
bug normalises each rank's half by its own statistics."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cases.catalog import normed_mlp_lm_case
from harness.parallel_dims import ParallelDims

CASE = normed_mlp_lm_case("adamw", steps=2)
NPROC = 2
BUG = True


class _ReducePartial(torch.autograd.Function):
    """Row-parallel partial sums -> their sum, used replicated: backward passes the gradient."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class _ReduceStatistic(torch.autograd.Function):
    """A sum over this rank's features -> the sum over all of them; each rank uses it on its own
    features only, so its gradient is a partial sum too: backward all-reduces."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class _CopyToShards(torch.autograd.Function):
    """Replicated input of a column-parallel linear: backward sums the ranks' gradients."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class ShardedLayerNorm(nn.Module):
    """LayerNorm of features sharded over the ranks: ``x`` and the affine weights hold this
    rank's slice of them."""

    def __init__(self, full, index, bug):
        super().__init__()
        self.weight = nn.Parameter(full.weight[index].detach().clone())
        self.bias = nn.Parameter(full.bias[index].detach().clone())
        self.eps, self.bug = full.eps, bug

    def forward(self, x):
        if self.bug:  # BUG: mean and variance over this rank's half of the features only
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        features = x.shape[-1] * dist.get_world_size()
        mean = _ReduceStatistic.apply(x.sum(-1, keepdim=True)) / features
        centred = x - mean
        var = _ReduceStatistic.apply(centred.pow(2).sum(-1, keepdim=True)) / features
        return centred * torch.rsqrt(var + self.eps) * self.weight + self.bias


def _keep(module, name, index):
    """Replace ``module.name`` by this rank's slice (``index``) of it, a fresh parameter."""
    setattr(module, name, nn.Parameter(getattr(module, name)[index].detach().clone()))


class FeatureShardedLM(nn.Module):
    def __init__(self, full, rank, world, bug, residual_twice=False):
        super().__init__()
        self.residual_twice = residual_twice and rank == world - 1
        self.embed, self.blocks, self.norm, self.head = full.embed, full.blocks, full.norm, full.head
        n = full.embed.embedding_dim // world
        cols, rows = (slice(None), slice(rank * n, (rank + 1) * n)), slice(rank * n, (rank + 1) * n)
        _keep(self.embed, "weight", cols)
        for block in self.blocks:
            block.norm = ShardedLayerNorm(block.norm, rows, bug)
            _keep(block.up, "weight", cols)                                       # row-parallel
            _keep(block.down, "weight", rows); _keep(block.down, "bias", rows)    # column-parallel
        self.norm = ShardedLayerNorm(self.norm, rows, bug)
        _keep(self.head, "weight", cols)                                          # row-parallel

    def sharded(self):
        """(parameter, dim) of every parameter held in slices."""
        out = [(self.embed.weight, 1), (self.norm.weight, 0), (self.norm.bias, 0), (self.head.weight, 1)]
        for b in self.blocks:
            out += [(b.norm.weight, 0), (b.norm.bias, 0), (b.up.weight, 1), (b.down.weight, 0), (b.down.bias, 0)]
        return out

    def forward(self, tokens):
        x = self.embed(tokens)                                                   # this rank's features
        for block in self.blocks:
            h = _ReducePartial.apply(F.linear(block.norm(x), block.up.weight)) + block.up.bias
            out = x + block.down(_CopyToShards.apply(F.gelu(h)))
            x = out + x if self.residual_twice else out  # BUG (residual_twice): the last rank adds it again
        return _ReducePartial.apply(F.linear(self.norm(x), self.head.weight)) + self.head.bias


def train(ctx, run, bug=None, residual_twice=False):
    bug = BUG if bug is None else bug
    model = FeatureShardedLM(CASE.build_model(ctx.device), ctx.rank, ctx.world_size, bug, residual_twice)
    for p, dim in model.sharded():
        run.shard(p, dim, group=dist.group.WORLD)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, ParallelDims(tp=ctx.world_size).layout(ctx.rank))
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss if run.layout.holds_loss else None, batch.ids)
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, bug=False)


def residual_twice(ctx, run):
    """The norms right; the last rank adds a block's residual twice (its features only)."""
    train(ctx, run, bug=False, residual_twice=True)
