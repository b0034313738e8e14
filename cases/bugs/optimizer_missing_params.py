"""DDP whose optimizer was built over a name-filtered parameter list that lost the biases.

Real-world class: parameter groups for weight decay built by name (``if "weight" in n``)
without an "else" group: the filtered-out parameters are never updated and have no optimizer
state. Nothing crashes; the model just trains fewer parameters than it has.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy
from harness.parallel_dims import RankLayout
from harness.strategy import RankSetup

EXPECTED_CODE = "state-structure"
NPROC = 2
CASE = mlp_case("adamw")


class OptimizerMissingBiases(DDPStrategy):
    name = "ddp-optimizer-missing-biases"

    def setup(self, case, ctx):
        ddp = DistributedDataParallel(case.build_model(ctx.device))
        weights = [p for n, p in ddp.named_parameters() if n.endswith("weight")]  # BUG: biases dropped
        return RankSetup(model=ddp, optimizer=case.build_optimizer(weights),
                         layout=RankLayout.data_parallel(ctx.rank, ctx.world_size), device=ctx.device)


STRATEGY = OptimizerMissingBiases
