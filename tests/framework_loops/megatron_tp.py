"""Megatron-Core's tensor-parallel layers (ColumnParallelLinear -> RowParallelLinear) on the
MLP over 2 TP ranks, weights copied from the reference model. The harness reads the layers' own
shard declarations (``tensor_model_parallel``, ``partition_dim``): the loop declares no shard.
The bug: a hand-written forward that applies the row-parallel layer's weight itself, skipping
the layer's all-reduce, so each rank's output is its partial sum."""
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

from cases.catalog import mlp_case
from harness.parallel_dims import ParallelDims

CASE = mlp_case("adamw", steps=2)
NPROC = 2


class MegatronMLP(nn.Module):
    def __init__(self, full, tp_rank, tp, reduce=True):
        super().__init__()
        config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
        init = nn.init.zeros_
        self.fc1 = ColumnParallelLinear(8, 16, config=config, init_method=init, bias=True, gather_output=False)
        self.fc2 = RowParallelLinear(16, 4, config=config, init_method=init, bias=True, input_is_parallel=True,
                                     skip_bias_add=False)
        n = 16 // tp
        with torch.no_grad():
            self.fc1.weight.copy_(full.fc1.weight[tp_rank * n:(tp_rank + 1) * n])
            self.fc1.bias.copy_(full.fc1.bias[tp_rank * n:(tp_rank + 1) * n])
            self.fc2.weight.copy_(full.fc2.weight[:, tp_rank * n:(tp_rank + 1) * n])
            self.fc2.bias.copy_(full.fc2.bias)
        self.reduce = reduce

    def forward(self, x):
        h, _ = self.fc1(x)
        h = torch.relu(h)
        if self.reduce:
            return self.fc2(h)[0]
        return F.linear(h, self.fc2.weight, self.fc2.bias)  # BUG: the row-parallel all-reduce skipped


def train(ctx, run, reduce=False):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=ctx.world_size)
    dims = ParallelDims(tp=ctx.world_size)
    model = MegatronMLP(CASE.build_model(ctx.device), parallel_state.get_tensor_model_parallel_rank(), ctx.world_size, reduce)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, dims.layout(ctx.rank))                               # harness
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss if run.layout.holds_loss else None, batch.ids)        # harness
        run.before_step(step)                                                         # harness
        optimizer.step()
        run.after_step(step)                                                          # harness
        optimizer.zero_grad()
    parallel_state.destroy_model_parallel()


def correct(ctx, run):
    train(ctx, run, reduce=True)
