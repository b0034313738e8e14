"""One process, no parallelism: the model as the case builds it, the case's optimizer.

What a resumed checkpoint of a parallel run is loaded into when the user wants the plain model
back (evaluation, export, a single-device fine-tune): ``python -m harness diagnose fsdp
--resume-at 2 --resume-into plain`` checks that a sharded checkpoint loads into it bitwise.
"""

from __future__ import annotations

from harness.parallel_dims import RankLayout
from harness.strategy import DistContextLike, RankSetup, StrategyBase
from reference.case import Case

__all__ = ["PlainStrategy"]


class PlainStrategy(StrategyBase):
    name = "plain"

    def setup(self, case: Case, ctx: DistContextLike) -> RankSetup:
        if ctx.world_size != 1:
            raise ValueError(f"the plain strategy runs on 1 process, not {ctx.world_size}: pass --nproc 1 (--resume-nproc 1)")
        model = case.build_model(ctx.device)
        return RankSetup(model=model, optimizer=case.build_optimizer(model.parameters()),
                         layout=RankLayout.data_parallel(0, 1), device=ctx.device)
