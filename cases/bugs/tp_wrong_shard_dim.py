"""Hand-written tensor parallelism that declares the row-parallel weight sharded along the
wrong dimension.

Real-world class: checkpoint / state-dict code that concatenates shards along dim 0 for
every layer, although row-parallel weights are split along dim 1: the saved model has the
wrong shape (or, for square weights, silently scrambled values).
"""

from __future__ import annotations

from cases.catalog import mlp_case
from cases.strategies.manual_tp import ManualTensorParallel, RowParallelLinear

EXPECTED_CODE = "shard-layout"
NPROC = 2
CASE = mlp_case("adamw")


class WrongDimRowParallel(RowParallelLinear):
    def __init__(self, full, group, index, parts):
        super().__init__(full, group, index, parts, weight_shard_dim=0)  # BUG: split along dim 1


class WrongShardDimTP(ManualTensorParallel):
    name = "manual-tp-wrong-shard-dim"
    row_cls = WrongDimRowParallel


STRATEGY = WrongShardDimTP
