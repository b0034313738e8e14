"""A checkpoint that holds the model only: the optimizer starts over after the resume.

Real-world class: a save path written for export or evaluation (``get_model_state_dict`` alone,
torchtitan's model-only checkpoint, ``torch.save(model.state_dict())``) reused for resuming.
The first resumed loss is bitwise the uninterrupted run's (the weights are right); the Adam
moments and step counters are gone, so the next update is a first step's, and the loss curve
jumps a few steps later.
"""

from __future__ import annotations

from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy
from harness.strategy import rng_state, set_rng_state

EXPECTED_CODE = "resume-state-missing"
NPROC = 2
RESUME_AT = 2
CASE = mlp_case("adamw")


class ModelOnlyCheckpoint(DDPStrategy):
    name = "ddp-model-only-checkpoint"

    def checkpoint_state(self, case, setup):
        # BUG: only the model goes into the checkpoint (the optimizer is never asked for its state).
        return {"model": get_model_state_dict(setup.model), "optim": {}, "rank": {"rng": rng_state()}}

    def load_checkpoint_state(self, case, setup, state):
        set_model_state_dict(setup.model, state["model"])
        set_rng_state(state["rank"]["rng"])


STRATEGY = ModelOnlyCheckpoint
