"""Hand-written Megatron-style sequence parallelism on a pre-norm MLP language model: each
tensor-parallel rank holds its quarter of the positions between the blocks' column- and
row-parallel linears (all-gather along the sequence before ``up``, reduce-scatter after
``down``). The norms and ``down``'s bias stay replicated but each rank computes them on its
own positions, so their gradients are partial sums: Megatron all-reduces them over the
tensor-parallel group (its ``sequence_parallel`` parameters). The bug forgets that."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cases.catalog import normed_mlp_lm_case
from harness.parallel_dims import ParallelDims

CASE = normed_mlp_lm_case("adamw", steps=2)
NPROC = 2


class _ToSequenceShard(torch.autograd.Function):
    """Replicated -> this rank's positions; backward all-gathers the positions' gradients."""

    @staticmethod
    def forward(ctx, x):
        world, rank = dist.get_world_size(), dist.get_rank()
        return x.chunk(world, dim=1)[rank].contiguous()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, g.contiguous())
        return torch.cat(parts, dim=1)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence; backward reduce-scatters (sum, then this rank's positions)."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()


class _GatherSequenceForReplicated(torch.autograd.Function):
    """All-gather along the sequence before replicated work (the head): every rank's gradient
    is the whole one, so backward only keeps this rank's positions."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()


class _ScatterSequence(torch.autograd.Function):
    """Partial sums over the whole sequence -> their sum at this rank's positions (a
    reduce-scatter); backward all-gathers."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous().clone()
        dist.all_reduce(x)
        return x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, g.contiguous())
        return torch.cat(parts, dim=1)


def shard_block(block, rank, world):
    """Cut ``up`` by rows and ``down`` by columns in place; norm and down's bias stay whole."""
    n = block.up.out_features // world
    with torch.no_grad():
        up = nn.Linear(block.up.in_features, n)
        up.weight.copy_(block.up.weight[rank * n:(rank + 1) * n]); up.bias.copy_(block.up.bias[rank * n:(rank + 1) * n])
        down = nn.Linear(n, block.down.out_features)
        down.weight.copy_(block.down.weight[:, rank * n:(rank + 1) * n]); down.bias.copy_(block.down.bias)
    block.up, block.down = up, down


class SequenceParallelLM(nn.Module):
    def __init__(self, full, rank, world):
        super().__init__()
        self.embed, self.blocks, self.norm, self.head = full.embed, full.blocks, full.norm, full.head
        for block in self.blocks:
            shard_block(block, rank, world)

    def forward(self, tokens):
        x = _ToSequenceShard.apply(self.embed(tokens))         # this rank's positions
        for block in self.blocks:
            h = _GatherSequence.apply(block.norm(x))             # the norm on local positions
            h = F.linear(F.gelu(block.up(h)), block.down.weight)  # column- then row-parallel
            x = x + _ScatterSequence.apply(h) + block.down.bias  # bias added on local positions
        return self.head(_GatherSequenceForReplicated.apply(self.norm(x)))


def sequence_parallel_params(model):
    """The replicated parameters each rank computes on its own positions."""
    return [p for b in model.blocks for p in (*b.norm.parameters(), b.down.bias)] + list(model.norm.parameters())


def train(ctx, run, bug=True):
    model = SequenceParallelLM(CASE.build_model(ctx.device), ctx.rank, ctx.world_size)
    g = dist.group.WORLD
    for block in model.blocks:
        run.shard(block.up.weight, 0, group=g); run.shard(block.up.bias, 0, group=g); run.shard(block.down.weight, 1, group=g)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, ParallelDims(tp=ctx.world_size).layout(ctx.rank))
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss if run.layout.holds_loss else None, batch.ids)
        if not bug:  # what Megatron does for its sequence_parallel parameters
            for p in sequence_parallel_params(model):
                dist.all_reduce(p.grad)
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, bug=False)
