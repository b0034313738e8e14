"""A loop whose data cursor is not in the checkpoint: after the resume it serves the epoch's
first batches again.

Real-world class: an iterator over a DataLoader (or a stateful loader whose ``state_dict`` is
never saved) in a loop that restores model and optimizer only: the first resumed step trains on
samples already consumed before the save, and the samples after the save point are never
seen in that epoch.
"""

from __future__ import annotations

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy
from harness.strategy import StrategyBase

EXPECTED_CODE = "resume-data-position-lost"
NPROC = 2
RESUME_AT = 2
CASE = mlp_case("adamw")


class DataCursorLost(DDPStrategy):
    name = "ddp-data-cursor-lost"

    def setup(self, case, ctx):
        setup = super().setup(case, ctx)
        setup.state["cursor"] = 0  # the number of steps' batches this loop has served
        return setup

    def local_batches(self, case, setup, step):
        batches = StrategyBase.local_batches(self, case, setup, setup.state["cursor"])  # the loop's own position
        setup.state["cursor"] += 1
        return batches

    def checkpoint_state(self, case, setup):
        state = super().checkpoint_state(case, setup)
        state["rank"]["strategy"] = {"cursor": setup.state["cursor"]}
        return state

    def load_checkpoint_state(self, case, setup, state):
        super().load_checkpoint_state(case, setup, state)  # BUG: the saved cursor is never put back


STRATEGY = DataCursorLost
