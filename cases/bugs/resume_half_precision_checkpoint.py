"""A checkpoint whose weights went through bfloat16 to save space.

Real-world class: a save path that casts the model to half precision (``model.half()`` or a
bf16 state dict for export) reused for resuming a float32 run. The loaded weights are the
saved ones rounded to 8 bits of mantissa: small differences everywhere, no pattern a
comparison of losses could tell from noise a few steps later.
"""

from __future__ import annotations

import torch

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy

EXPECTED_CODE = "resume-value-differs"
NPROC = 2
RESUME_AT = 2
CASE = mlp_case("adamw")


class HalfPrecisionCheckpoint(DDPStrategy):
    name = "ddp-bf16-checkpoint"

    def load_checkpoint_state(self, case, setup, state):
        super().load_checkpoint_state(case, setup, state)
        with torch.no_grad():
            for p in setup.model.parameters():
                p.copy_(p.to(torch.bfloat16))  # BUG: the weights as a bf16 file holds them


STRATEGY = HalfPrecisionCheckpoint
