"""DDP whose loss is also divided by the world size, so gradients are averaged twice.

Real-world class: "normalize the loss by the number of GPUs" copied from a sum-reduce recipe
into DDP code, whose all-reduce already averages. Every gradient comes out 1/N of the right
one; AdamW hides most of it in the parameters, so only a gradient check shows it.
"""

from __future__ import annotations

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy
from harness.strategy import RankSetup
from reference.case import Batch, Case

EXPECTED_CODE = "grad-double-averaged"
NPROC = 2
CASE = mlp_case("adamw")


class DoubleAveragedDDP(DDPStrategy):
    name = "ddp-double-averaged"

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]):
        return self.accumulate(case, setup, micro_batches, scale=1 / setup.layout.dp_size)  # BUG: DDP averages already


STRATEGY = DoubleAveragedDDP
