"""Hand-written tensor parallelism whose row-parallel layer skips the all-reduce.

Real-world class: a Megatron-style RowParallelLinear whose ``reduce`` was removed or guarded
by a wrong flag (``if sequence_parallel``): each rank continues with its partial sum of the
output, so the forward is wrong by a pattern that only adds up across the group.
"""

from __future__ import annotations

from cases.catalog import mlp_case
from cases.strategies.manual_tp import ManualTensorParallel, RowParallelLinear

EXPECTED_CODE = "tp-partial-sum"
NPROC = 2
CASE = mlp_case("adamw")


class UnreducedRowParallel(RowParallelLinear):
    def reduce(self, partial):
        return partial  # BUG: no all-reduce over the tensor-parallel group


class MissingAllReduceTP(ManualTensorParallel):
    name = "manual-tp-missing-allreduce"
    row_cls = UnreducedRowParallel


STRATEGY = MissingAllReduceTP
