"""The README's hand-written two-stage pipeline (``cases/pp_custom_example.py``) with the bugs of
a stage boundary. The default entry sends the activation in bfloat16 to save bandwidth (cast
back on arrival): stage 1's input is not what stage 0 produced, located between the stages,
before any module of stage 1. ``extra_activation``: stage 1's forward applies a GELU to what it
receives, which the model has not - located at ``fc2`` on rank 1, the GELU named as computed
inline before it. ``correct`` is the README's loop."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cases.pp_custom_example import CASE, NPROC, Stage, backward_in_order, recv_activation, train as correct  # noqa: F401
from harness.parallel_dims import ParallelDims


class GeluOnArrival(Stage):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x if hasattr(self, "fc1") else F.gelu(x))  # BUG (extra_activation)


def train(ctx, run, send_bf16=True, stage_class=Stage):
    dims = ParallelDims(pp=ctx.world_size)
    stage = dims.coords(ctx.rank)["pp"]
    first, last = stage == 0, stage == dims.pp - 1
    model = stage_class(CASE.build_model(ctx.device), stage)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, dims.layout(ctx.rank))
    for step in range(run.steps):
        held = []
        for batch in run.batches(step):
            x = batch.inputs if first else recv_activation(ctx, batch)
            out = model(x)
            if last:
                loss = CASE.loss_fn(out, batch.targets)
                run.loss(step, loss, batch.ids)
                out = loss * run.loss_weight(batch)
            else:
                sent = out.detach().bfloat16().float() if send_bf16 else out.detach()  # BUG (default): bfloat16 on the wire
                dist.send(sent, dst=ctx.rank + 1)
                run.loss(step, None, batch.ids)
            held.append((x, out))
        backward_in_order(ctx, held, first, last)
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def extra_activation(ctx, run):
    train(ctx, run, send_bf16=False, stage_class=GeluOnArrival)
