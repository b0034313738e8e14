"""A resume that does not restore the RNG: dropout masks after the resume are not the ones the
uninterrupted run draws.

Real-world class: a checkpoint without ``torch.get_rng_state()`` (and ``torch.cuda``'s), or a
loop that re-seeds with the run's seed after loading. Each resumed run repeats the masks of
the run's first steps; a bitwise regression test after a restart fails, and per-rank
dropout streams can coincide with ones already used.
"""

from __future__ import annotations

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy

EXPECTED_CODE = "resume-rng-not-restored"
NPROC = 2
RESUME_AT = 2
CASE = mlp_case("adamw", dropout=0.1)


class RngNotRestored(DDPStrategy):
    name = "ddp-rng-not-restored"

    def load_checkpoint_state(self, case, setup, state):
        state["rank"].pop("rng", None)  # BUG: the generator stays where setup left it
        super().load_checkpoint_state(case, setup, state)


STRATEGY = RngNotRestored
