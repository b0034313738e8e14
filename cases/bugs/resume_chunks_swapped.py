"""A load that puts one weight's dim-0 shards on the wrong ranks.

Real-world class: a hand-written resharding or format converter that maps shard files to ranks
by a wrong rank order (a mesh flattened in the other order, files sorted as strings), so rank 0
holds rank 1's rows of a weight and the other way round. Every value is one that was saved;
only their place is wrong: the gathered tensor is the saved one with its shard chunks
permuted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cases.catalog import mlp_case
from cases.strategies.fsdp import FSDPStrategy

EXPECTED_CODE = "resume-chunks-permuted"
NPROC = 2
RESUME_AT = 2
CASE = mlp_case("adamw")


class ChunksSwapped(FSDPStrategy):
    name = "fsdp-chunks-swapped"

    def load_checkpoint_state(self, case, setup, state):
        super().load_checkpoint_state(case, setup, state)
        name, param = next((n, p) for n, p in setup.model.named_parameters() if p.dim() == 2)
        local = param.to_local()
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, local.contiguous())
        with torch.no_grad():  # BUG: each rank takes the shard of the rank before it
            local.copy_(pieces[(dist.get_rank() - 1) % dist.get_world_size()])


STRATEGY = ChunksSwapped
