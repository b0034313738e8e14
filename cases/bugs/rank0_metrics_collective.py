"""DDP that all-reduces the loss for logging on rank 0 only, through a metrics process group.

Real-world class: a collective behind ``if rank == 0:`` (logging, checkpointing, evaluation):
rank 0 waits in it forever while the other ranks move on and wait in their next collective -
the job hangs with no error, and each rank's stack alone does not say who is missing.
"""

from __future__ import annotations

import torch.distributed as dist

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy

EXPECTED_CODE = "collective-missing"
NPROC = 2
# It hangs at step 0: the hang is named once no rank has made progress for STALL_WINDOW s, however
# long the ranks took to reach it on a loaded machine; TIMEOUT only caps a run that never stalls.
TIMEOUT = 120
STALL_WINDOW = 3
CASE = mlp_case("adamw", steps=2)


class Rank0MetricsDDP(DDPStrategy):
    name = "ddp-rank0-metrics"

    def setup(self, case, ctx):
        setup = super().setup(case, ctx)
        setup.state["metrics_group"] = dist.new_group(list(range(ctx.world_size)), group_desc="metrics")
        return setup

    def forward_backward(self, case, setup, micro_batches):
        losses = super().forward_backward(case, setup, micro_batches)
        if dist.get_rank() == 0:  # BUG: a collective only one rank issues
            logged = losses[-1].clone()
            dist.all_reduce(logged, group=setup.state["metrics_group"])
        return losses


STRATEGY = Rank0MetricsDDP
