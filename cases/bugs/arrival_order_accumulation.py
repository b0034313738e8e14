"""Hand-written data parallelism whose micro-batch gradients accumulate in arrival order.

Real-world class: a loader or a thread pool that hands micro-batches over as they are ready,
and a loop that runs each one's backward as it arrives; or atomics, a non-deterministic scatter
kernel, a reduction split over workers by timing. Each micro-batch's loss and sample ids are
right and the sum of the gradients is the same sum, but floating-point addition is not
associative: the order, drawn here from an unseeded generator (the timing), changes the last
bits. Every value stays within rounding of one device's, so the reference comparison passes;
two runs of the same program do not repeat bitwise (``--repeat 2``), which makes every later
bitwise check (a resume, a regression against a known-good run) unreliable.
"""

from __future__ import annotations

import os
import random

from cases.catalog import mlp_case

from ._manual_dp import ManualDataParallel

EXPECTED_CODE = "nondeterministic-run"
NPROC = 2
REPEAT = 2
CASE = mlp_case("adamw", micro_batches=4)


class ArrivalOrderAccumulation(ManualDataParallel):
    name = "manual-dp-arrival-order"

    def accumulate(self, case, setup, micro_batches, **options):
        # BUG: the order the micro-batches "arrive" in is the machine's, not the program's.
        arrival = random.Random(os.urandom(8)).sample(range(len(micro_batches)), len(micro_batches))
        losses = [None] * len(micro_batches)
        for i in arrival:
            losses[i] = super().accumulate(case, setup, [micro_batches[i]], **options)[0]
        return losses


STRATEGY = ArrivalOrderAccumulation
