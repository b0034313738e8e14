"""Hand-written data parallelism (no DDP) shared by several bug cases: every rank builds the
model from the case's seed, runs its shard of the batch, and ``sync_grads`` all-reduces and
averages gradients. Each bug case overrides one piece."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.parallel_dims import RankLayout
from harness.strategy import DistContextLike, RankSetup, StrategyBase
from reference.case import Batch, Case


class ManualDataParallel(StrategyBase):
    name = "manual-dp"

    def build_model(self, case: Case, ctx: DistContextLike) -> torch.nn.Module:
        return case.build_model(ctx.device)

    def setup(self, case: Case, ctx: DistContextLike) -> RankSetup:
        model = self.build_model(case, ctx)
        return RankSetup(model=model, optimizer=case.build_optimizer(model.parameters()),
                         layout=RankLayout.data_parallel(ctx.rank, ctx.world_size), device=ctx.device)

    def sync_grads(self, model: torch.nn.Module, world_size: int) -> None:
        for _, p in model.named_parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
        losses = self.accumulate(case, setup, micro_batches)
        self.sync_grads(setup.model, setup.layout.dp_size)
        return losses
