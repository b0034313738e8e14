"""Hand-written data parallelism whose ranks all-reduce the gradients in different orders.

Real-world class: iterating a container whose order differs between processes (a ``set`` of
parameters, a dict filled as gradients become ready) to issue collectives: position k on one
rank is a different tensor than position k on another, so the ranks mix up tensors of
different shapes - a hang or garbage, depending on the backend.
"""

from __future__ import annotations

import torch.distributed as dist

from cases.catalog import mlp_case

from ._manual_dp import ManualDataParallel

EXPECTED_CODE = "collective-mismatch"
NPROC = 2
TIMEOUT = 120  # a cap only: a hang is named after STALL_WINDOW s without progress
STALL_WINDOW = 3
CASE = mlp_case("adamw", steps=2)


class RankOrderedSync(ManualDataParallel):
    name = "manual-dp-rank-ordered-sync"

    def sync_grads(self, model, world_size):
        params = list(model.parameters())
        if dist.get_rank() % 2:  # BUG: odd ranks walk the parameters backwards
            params.reverse()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= world_size


STRATEGY = RankOrderedSync
