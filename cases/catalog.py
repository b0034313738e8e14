"""Ready-made cases, so a strategy test names one in a single call."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from reference.case import Case

from .data import SyntheticRegression
from .models import TwoLayerMLP

__all__ = ["OPTIMIZERS", "mlp_case"]

# Optimizers as picklable partials (a case may travel to worker processes).
OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01),
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
}


def mlp_case(
    optimizer: str = "adamw",
    *,
    steps: int = 3,
    global_batch_size: int = 16,
    micro_batches: int = 1,
    dtype: torch.dtype = torch.float32,
    dropout: float = 0.0,
    seed: int = 0,
    num_samples: int = 64,
) -> Case:
    """The two-linear-layer case of the debugging method on synthetic regression data."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZERS)}")
    return Case(
        name=f"mlp-{optimizer}" + (f"-{str(dtype).removeprefix('torch.')}" if dtype != torch.float32 else ""),
        model_factory=functools.partial(TwoLayerMLP, 8, 16, 4, dropout),
        dataset=SyntheticRegression(num_samples, 8, 4),
        loss_fn=F.mse_loss,
        optimizer_factory=OPTIMIZERS[optimizer],
        global_batch_size=global_batch_size,
        micro_batches=micro_batches,
        steps=steps,
        seed=seed,
        dtype=dtype,
    )
