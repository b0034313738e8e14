"""DDP where every rank iterates the whole global batch instead of its shard.

Real-world class: a DataLoader built without ``DistributedSampler`` (or with
``num_replicas=1``): every replica trains on the same samples, so the effective batch holds
each sample N times and an epoch is N times shorter than it should be.
"""

from __future__ import annotations

from reference.case import collate
from reference.schedule import micro_batch_indices

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy

EXPECTED_CODE = "duplicate-samples"
NPROC = 2
CASE = mlp_case("adamw")


class UnshardedSamplerDDP(DDPStrategy):
    name = "ddp-unsharded-sampler"

    def local_batches(self, case, setup, step):
        # BUG: the global batch's micro-batches, not this replica's shard of them
        return [collate(case.dataset, idx, device=setup.device, dtype=case.dtype) for idx in micro_batch_indices(case, step)]


STRATEGY = UnshardedSamplerDDP
