"""A data-parallel loop around a model held by a wrapper the harness has never heard of (every
parameter name gains ``shell.``); the bug sums the gradients without averaging them."""
import torch.distributed as dist
from torch import nn

from cases.catalog import mlp_case

CASE = mlp_case("sgd", steps=2)
NPROC = 2


class Shell(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.shell = inner

    def forward(self, x):
        return self.shell(x)


def train(ctx, run, average=False):
    model = Shell(CASE.build_model(ctx.device))
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer)
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            if average:
                p.grad /= ctx.world_size  # BUG unless averaged
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, average=True)
