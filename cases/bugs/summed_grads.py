"""Hand-written data parallelism that all-reduces gradients with SUM and never divides.

Real-world class: ``dist.all_reduce(p.grad)`` copied from a tutorial without the
``/ world_size`` that follows it (all_reduce's default op is SUM). Gradients are N times the
right ones: with SGD the step is N times too large; with Adam it mostly hides.
"""

from __future__ import annotations

import torch.distributed as dist

from cases.catalog import mlp_case

from ._manual_dp import ManualDataParallel

EXPECTED_CODE = "grad-not-averaged"
NPROC = 2
CASE = mlp_case("adamw")


class SummedGradients(ManualDataParallel):
    name = "manual-dp-summed"

    def sync_grads(self, model, world_size):
        for p in model.parameters():
            dist.all_reduce(p.grad)  # BUG: SUM over replicas, never divided by world_size


STRATEGY = SummedGradients
