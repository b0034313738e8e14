"""DDP whose sampler drops the last sample of every replica's shard.

Real-world class: an off-by-one in a hand-written sampler (``indices[start:end - 1]``), or
``drop_last`` applied per replica: some samples are never trained on, silently, every epoch.
"""

from __future__ import annotations

from reference.case import collate
from reference.schedule import replica_micro_batch_indices

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy

EXPECTED_CODE = "dropped-samples"
NPROC = 2
CASE = mlp_case("adamw")


class TruncatingSamplerDDP(DDPStrategy):
    name = "ddp-truncating-sampler"

    def local_batches(self, case, setup, step):
        layout = setup.layout
        shards = replica_micro_batch_indices(case, step, layout.dp_rank, layout.dp_size)
        # BUG: off by one - the last index of each micro-batch shard is never used
        return [collate(case.dataset, idx[:-1], device=setup.device, dtype=case.dtype) for idx in shards]


STRATEGY = TruncatingSamplerDDP
