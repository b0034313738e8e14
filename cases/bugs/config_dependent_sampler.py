"""DDP with a hand-written sampler that truncates the dataset to a multiple of the replicas
before shuffling, instead of padding it as ``DistributedSampler`` does.

Real-world class: "avoid DistributedSampler's padding (it repeats samples when the dataset
does not divide the replicas) by dropping the remainder": ``usable = len(ds) - len(ds) % world``
and a permutation of ``range(usable)``. The last ``len(ds) % world`` samples are then never
trained on, in any epoch, and the shuffled order is a different one from the sampler the rest
of the stack assumes. When the dataset size divides the replicas nothing is dropped and the
strategy is exactly DDP, so a fixed grid of "nice" sizes (64 samples on 2 or 4 ranks) never
sees it; the config search finds it and shrinks it to 2 ranks, a batch of 2 and 3 samples.
"""

from __future__ import annotations

import torch

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy
from harness.strategy import RankSetup
from reference.case import Batch, Case, collate

EXPECTED_CODE = "dropped-samples"
NPROC = 2
CASE = mlp_case("adamw", num_samples=63)  # 63 % 2 != 0: the bug shows


class RemainderDroppingSamplerDDP(DDPStrategy):
    name = "ddp-drops-remainder"

    def local_batches(self, case: Case, setup: RankSetup, step: int) -> list[Batch]:
        replicas, replica = setup.layout.dp_size, setup.layout.dp_rank
        usable = len(case.dataset) - len(case.dataset) % replicas  # BUG: the tail is dropped
        epoch, k = divmod(step, case.steps_per_epoch)
        if case.shuffle:
            g = torch.Generator()
            g.manual_seed(case.seed + epoch)
            order = torch.randperm(usable, generator=g).tolist()
        else:
            order = list(range(usable))
        start = k * case.global_batch_size
        mine = order[start + replica : start + case.global_batch_size : replicas]  # strided, as DistributedSampler
        per = len(mine) // case.micro_batches
        return [
            collate(case.dataset, mine[m * per : (m + 1) * per], device=setup.device, dtype=case.dtype)
            for m in range(case.micro_batches)
        ]


STRATEGY = RemainderDroppingSamplerDDP


def make_strategy(config: object) -> RemainderDroppingSamplerDDP:
    """Factory for :mod:`harness.search` (a search config needs nothing else from it)."""
    return RemainderDroppingSamplerDDP()
