"""DDP that runs its forward under bfloat16 autocast while the reference is fp32.

Real-world class: mixed precision switched on in the parallel job only (a launcher flag, an
``autocast`` left in the training loop): values drift by bf16 rounding, no factor or layout
explains the difference, and it is only a bug when the two runs are meant to agree.
"""

from __future__ import annotations

import torch

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy

EXPECTED_CODE = "numeric-mismatch"
NPROC = 2
CASE = mlp_case("adamw")


class AutocastDDP(DDPStrategy):
    name = "ddp-autocast-bf16"

    def forward_backward(self, case, setup, micro_batches):
        def forward(model, batch):
            with torch.autocast(setup.device.type, dtype=torch.bfloat16):  # BUG: reference is fp32
                out = case.call_model(model, batch.inputs)
            return case.compute_loss(out.float(), batch.targets)

        return self.accumulate(case, setup, micro_batches, forward=forward)


STRATEGY = AutocastDDP
