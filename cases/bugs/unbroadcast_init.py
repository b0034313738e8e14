"""Hand-written data parallelism whose replicas start from different weights.

Real-world class: each rank initializes the model from its own RNG state (seeded with the
rank for "diversity", or not seeded at all) and the initial parameters are never broadcast
from rank 0 - DDP does this broadcast at construction, hand-written loops forget it.
Gradients are averaged correctly, so the replicas never converge to one model.
"""

from __future__ import annotations

import torch

from cases.catalog import mlp_case

from ._manual_dp import ManualDataParallel

EXPECTED_CODE = "replica-divergence"
NPROC = 2
CASE = mlp_case("adamw")


class UnbroadcastInit(ManualDataParallel):
    name = "manual-dp-unbroadcast-init"

    def build_model(self, case, ctx):
        model = case.build_model(ctx.device)
        if ctx.rank != 0:  # BUG: rank-dependent initialization and no broadcast from rank 0
            with torch.no_grad():
                generator = torch.Generator().manual_seed(ctx.rank)
                for p in model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=generator).to(p))
        return model


STRATEGY = UnbroadcastInit
