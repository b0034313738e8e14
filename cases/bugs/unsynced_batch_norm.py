"""DDP over an MLP with a BatchNorm that was never converted to SyncBatchNorm.

Real-world class: a vision or tabular model moved from one GPU to data parallelism; each
replica normalises with the mean and variance of its own samples, so the run computes another
function than one device does - not a rounding difference, and no gradient is scaled or
unsynchronized. The per-replica reference (each replica's samples forward on their own)
matches it, and the BatchNorm is the module whose per-sample output moves with the split.
``Case(per_replica=("bn",))`` declares it intended; ``nn.SyncBatchNorm`` fixes it.
"""

from __future__ import annotations

import torch.nn.functional as F

from cases.catalog import OPTIMIZERS
from cases.data import SyntheticRegression
from cases.models import BatchNormMLP
from cases.strategies.ddp import DDPStrategy
from reference.case import Case

EXPECTED_CODE = "per-replica-statistic"
NPROC = 2
CASE = Case("bn-mlp-adamw", BatchNormMLP, SyntheticRegression(64, 8, 4), F.mse_loss, OPTIMIZERS["adamw"],
            global_batch_size=16, steps=2)
STRATEGY = DDPStrategy
