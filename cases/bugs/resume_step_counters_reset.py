"""A resume that loads the Adam moments but starts the step counters at 0.

Real-world class: a converter between checkpoint formats that carries ``exp_avg`` and
``exp_avg_sq`` and drops or zeroes ``step`` (or a loop that rebuilds the optimizer and copies
the moments in). Bias correction starts over: the first resumed update is larger than the
uninterrupted run's by the factor a first step has, while the weights, the moments and the
first resumed loss are all bitwise right.
"""

from __future__ import annotations

import torch

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy

EXPECTED_CODE = "resume-step-reset"
NPROC = 2
RESUME_AT = 2
CASE = mlp_case("adamw")


class StepCountersReset(DDPStrategy):
    name = "ddp-step-counters-reset"

    def load_checkpoint_state(self, case, setup, state):
        super().load_checkpoint_state(case, setup, state)
        with torch.no_grad():
            for entry in setup.optimizer.state.values():
                entry["step"].zero_()  # BUG: the counters of the loaded state back at 0


STRATEGY = StepCountersReset
