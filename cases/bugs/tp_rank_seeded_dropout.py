"""Tensor parallelism where each rank reseeds its RNG with its rank before training.

Real-world class: "seed every rank differently" (``torch.manual_seed(seed + rank)``) applied
to a tensor-parallel job: ranks of one TP group hold the *same* replicated activations and
must draw the *same* dropout masks, so their copies silently diverge and the row-parallel
sums mix activations dropped differently.
"""

from __future__ import annotations

import torch

from cases.catalog import wide_transformer_case
from cases.strategies.tp import TensorParallelStrategy

EXPECTED_CODE = "rng-desync"
NPROC = 2
CASE = wide_transformer_case(dropout=0.1)  # 8 heads: also on 8 simulated ranks


class RankSeededTP(TensorParallelStrategy):
    name = "tp-rank-seeded-dropout"

    def forward_backward(self, case, setup, micro_batches):
        if not setup.state.get("seeded"):
            setup.state["seeded"] = True
            torch.manual_seed(case.seed + torch.distributed.get_rank())  # BUG: TP peers must share masks
        return super().forward_backward(case, setup, micro_batches)


STRATEGY = RankSeededTP
