"""Hand-written data parallelism that synchronizes only the weight matrices' gradients.

Real-world class: a sync loop over a filtered parameter list (``if "weight" in name``, or only
the parameters of some submodules, or parameters added after the sync list was built): the
other parameters train on each replica's own data and the replicas drift apart.
"""

from __future__ import annotations

import torch.distributed as dist

from cases.catalog import mlp_case

from ._manual_dp import ManualDataParallel

EXPECTED_CODE = "missing-grad-sync"
NPROC = 2
CASE = mlp_case("adamw")


class WeightsOnlySync(ManualDataParallel):
    name = "manual-dp-weights-only"

    def sync_grads(self, model, world_size):
        for name, p in model.named_parameters():
            if name.endswith("weight"):  # BUG: biases are never synchronized
                dist.all_reduce(p.grad)
                p.grad /= world_size


STRATEGY = WeightsOnlySync
