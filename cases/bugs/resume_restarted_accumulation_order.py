"""Loop state outside the checkpoint that restarts with the process: the resumed run is not
the uninterrupted one, bit for bit, although everything the checkpoint holds loads exactly.

Real-world class: a loader or bucketing scheme that warms up once per process (here: the first
step a process trains runs its micro-batches in reverse), a gradient-accumulation order or a
cache keyed on steps since start-up. Each run is within rounding of one device's, so the
reference check passes; but a resumed run departs from the uninterrupted one at its first
step, and every bitwise regression check across a restart fails.
"""

from __future__ import annotations

from cases.catalog import mlp_case

from ._manual_dp import ManualDataParallel

EXPECTED_CODE = "resume-continuation-departs"
NPROC = 2
RESUME_AT = 2
CASE = mlp_case("adamw", micro_batches=4)


class RestartedAccumulationOrder(ManualDataParallel):
    name = "manual-dp-restarted-order"

    def setup(self, case, ctx):
        setup = super().setup(case, ctx)
        setup.state["steps_in_process"] = 0  # BUG: process-local, never saved
        return setup

    def accumulate(self, case, setup, micro_batches, **options):
        first = setup.state["steps_in_process"] == 0
        setup.state["steps_in_process"] += 1
        order = list(reversed(range(len(micro_batches)))) if first else list(range(len(micro_batches)))
        losses = [None] * len(micro_batches)
        for i in order:
            losses[i] = super().accumulate(case, setup, [micro_batches[i]], **options)[0]
        return losses


STRATEGY = RestartedAccumulationOrder
