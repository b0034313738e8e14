"""Tensor parallelism whose ranks each load a different batch.

Real-world class: a data loader sharded by the *global* rank (``DistributedSampler(rank=
dist.get_rank())``) in a job where the ranks of one tensor-parallel group must read the same
samples: every rank computes its shard of the layers on different inputs, and the row-parallel
sums add up activations of unrelated samples.
"""

from __future__ import annotations

from reference.case import collate
from reference.schedule import replica_micro_batch_indices

from cases.catalog import wide_transformer_case
from cases.strategies.tp import TensorParallelStrategy

EXPECTED_CODE = "inconsistent-replica-inputs"
NPROC = 2
CASE = wide_transformer_case()  # 8 heads: also on 8 simulated ranks


class PerRankBatchTP(TensorParallelStrategy):
    name = "tp-per-rank-batches"

    def local_batches(self, case, setup, step):
        import torch.distributed as dist

        # BUG: sharded by global rank, as if every rank were its own data-parallel replica
        shards = replica_micro_batch_indices(case, step, dist.get_rank(), dist.get_world_size())
        return [collate(case.dataset, idx, device=setup.device, dtype=case.dtype) for idx in shards]


STRATEGY = PerRankBatchTP
