"""A resume that restores model and optimizer but not the lr scheduler: warm-up starts over.

Real-world class: an app state with ``model`` and ``optim`` only (the scheduler built fresh
after the load), reported as "the LR scheduler is back at step 0 after resume". The loaded
param groups carry the saved lr, so the first resumed loss is bitwise right; the next
``scheduler.step()`` computes the lr of warm-up step 1 again and the run leaves its schedule.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy

EXPECTED_CODE = "resume-scheduler-not-restored"
NPROC = 2
RESUME_AT = 2
CASE = dataclasses.replace(
    mlp_case("adamw", steps=4),
    lr_scheduler_factory=functools.partial(torch.optim.lr_scheduler.LinearLR, start_factor=0.25, total_iters=3),
)


class SchedulerNotRestored(DDPStrategy):
    name = "ddp-scheduler-not-restored"

    def load_checkpoint_state(self, case, setup, state):
        state["rank"].pop("lr_scheduler", None)  # BUG: the scheduler keeps the state it was built with
        super().load_checkpoint_state(case, setup, state)


STRATEGY = SchedulerNotRestored
