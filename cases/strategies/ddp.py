"""Data parallelism with ``DistributedDataParallel``.

Every rank holds the whole model and consumes its ``DistributedSampler`` shard of each global
batch. Gradients are all-reduced and *averaged* by DDP, so each micro-batch's mean loss is
weighted by ``num_samples * world_size / global_batch_size`` (:meth:`Case.loss_weight`);
with several micro-batches, all but the last run under ``no_sync()`` so gradients are
all-reduced once per step.
"""

from __future__ import annotations


import torch
from torch.nn.parallel import DistributedDataParallel

from harness.parallel_dims import RankLayout
from harness.strategy import DistContextLike, RankSetup, StrategyBase
from reference.case import Batch, Case

__all__ = ["DDPStrategy"]


class DDPStrategy(StrategyBase):
    name = "ddp"

    def setup(self, case: Case, ctx: DistContextLike) -> RankSetup:
        model = case.build_model(ctx.device)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        return RankSetup(
            model=ddp,
            optimizer=case.build_optimizer(ddp.parameters()),
            layout=RankLayout.data_parallel(ctx.rank, ctx.world_size),
            device=ctx.device,
        )

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
        ddp = setup.model
        assert isinstance(ddp, DistributedDataParallel)
        # DDP's reducer all-reduces during the last micro-batch's backward only.
        return self.accumulate(case, setup, micro_batches, sync=lambda last: None if last else ddp.no_sync())
