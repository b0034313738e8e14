"""DDP with gradient accumulation whose micro-batch losses are not divided by the number of
accumulation steps.

Real-world class: adding ``loss.backward()`` in an accumulation loop without scaling the loss
by ``1 / accumulation_steps``. Gradients come out accumulation_steps (here 4) times too large.
"""

from __future__ import annotations


from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy

EXPECTED_CODE = "grad-scaled"
NPROC = 2
CASE = mlp_case("adamw", micro_batches=4)


class UndividedAccumulation(DDPStrategy):
    name = "ddp-accumulation-undivided"

    def forward_backward(self, case, setup, micro_batches):
        # BUG: the weight is the one of a whole replica batch, not of one of its micro-batches
        return self.accumulate(case, setup, micro_batches, scale=len(micro_batches),
                               sync=lambda last: None if last else setup.model.no_sync())


STRATEGY = UndividedAccumulation
