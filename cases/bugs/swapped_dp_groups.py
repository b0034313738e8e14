"""A 2 x 2 (dp x tp) job whose hand-built data-parallel groups run along the tensor-parallel
dimension.

Real-world class: building groups by hand with ``rank // tp`` where ``rank % tp`` was meant
(or a mesh built with its dims in the wrong order): gradients of *different* tensor-parallel
shards are averaged with each other and every data-parallel replica trains alone. No hang,
no error - only wrong numbers.
"""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist

from cases.catalog import mlp_case
from cases.strategies.manual_tp import ManualTPMLP
from harness.parallel_dims import ParallelDims
from harness.strategy import RankSetup, StrategyBase

EXPECTED_CODE = "swapped-mesh-dims"
NPROC = 4
CASE = mlp_case("adamw")


class SwappedGroupsDPxTP(StrategyBase):
    name = "dp-tp-swapped-groups"

    def setup(self, case, ctx):
        dims = ParallelDims(dp=2, tp=2)
        mesh = dims.build_mesh(ctx.device.type)
        tp_group = mesh.get_group("tp")
        full = case.build_model(ctx.device)
        model = ManualTPMLP(full, tp_group, dims.coord(ctx.rank, "tp"), dims.tp)
        # BUG: "dp" groups enumerated as consecutive ranks - that is the tp dimension
        dp_group, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
        layout = dims.layout(ctx.rank)  # the strategy declares the groups it actually built
        layout = replace(layout, groups={**layout.groups, "dp": dist.get_process_group_ranks(dp_group)})
        return RankSetup(model=model, optimizer=case.build_optimizer(model.parameters()), layout=layout,
                         device=ctx.device, state={"dp_group": dp_group, "mesh": mesh})

    def forward_backward(self, case, setup, micro_batches):
        losses = self.accumulate(case, setup, micro_batches)
        for p in setup.model.parameters():
            dist.all_reduce(p.grad, group=setup.state["dp_group"])
            p.grad /= setup.layout.dp_size
        return losses


STRATEGY = SwappedGroupsDPxTP
