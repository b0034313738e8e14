"""Ready-made cases, so a strategy test names one in a single call."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from reference.case import Case

from .data import MaskedTokens, SyntheticRegression, SyntheticTokens
from .models import NormedMLPLM, TinyTransformer, TwoLayerMLP

__all__ = [
    "OPTIMIZERS", "lm_loss", "masked_lm_case", "masked_lm_loss", "mlp_case", "normed_mlp_lm_case", "transformer_case",
    "valid_tokens", "wide_transformer_case",
]

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


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of every sequence, in float32 for
    16-bit logits and in float64 for float64 ones (``.float()`` would round a float64 run's loss
    to float32, 1e-7 relative noise, above float64 tolerances)."""
    return F.cross_entropy(logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32)), targets.flatten())


def transformer_case(
    optimizer: str = "adamw",
    *,
    steps: int = 3,
    global_batch_size: int = 8,
    micro_batches: int = 1,
    dtype: torch.dtype = torch.float32,
    dropout: float = 0.0,
    seed: int = 0,
    num_samples: int = 64,
    seq_len: int = 8,
    vocab: int = 32,
    dim: int = 16,
    heads: int = 4,
    hidden: int = 32,
    layers: int = 4,
    name: str | None = None,
) -> Case:
    """The tiny transformer on synthetic token sequences. The defaults divide by data, tensor
    and pipeline parallelism up to 4 (heads, dim, hidden by tp; layers by pp)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZERS)}")
    if seq_len > 16:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len 16")
    suffix = f"-{str(dtype).removeprefix('torch.')}" if dtype != torch.float32 else ""
    return Case(
        name=name or f"transformer-{optimizer}{suffix}" + (f"-dropout{dropout}" if dropout else ""),
        model_factory=functools.partial(
            TinyTransformer, vocab=vocab, dim=dim, heads=heads, hidden=hidden, layers=layers, max_seq_len=16, dropout=dropout
        ),
        dataset=SyntheticTokens(num_samples, seq_len, vocab),
        loss_fn=lm_loss,
        optimizer_factory=OPTIMIZERS[optimizer],
        global_batch_size=global_batch_size,
        micro_batches=micro_batches,
        steps=steps,
        seed=seed,
        dtype=dtype,
    )


def wide_transformer_case(optimizer: str = "adamw", **options: Any) -> Case:
    """The tiny transformer widened to 8 heads of 4 (dim 32, MLP 64): tensor parallelism up to
    8 ranks divides it, so its TP targets also run on 8 simulated ranks (a node's worth, seed
    001 section 5). ``options`` as :func:`transformer_case` takes them."""
    dropout = f"-dropout{options['dropout']}" if options.get("dropout") else ""
    name = options.pop("name", None) or f"transformer-wide-{optimizer}{dropout}"
    return transformer_case(optimizer, dim=32, heads=8, hidden=64, name=name, **options)


def normed_mlp_lm_case(optimizer: str = "adamw", *, steps: int = 3, global_batch_size: int = 8, micro_batches: int = 1,
                       seq_len: int = 8, seed: int = 0) -> Case:
    """:class:`~cases.models.NormedMLPLM` (2 blocks, dim 16, MLP 32) on synthetic token
    sequences: the model of the sequence-parallel examples."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZERS)}")
    return Case(
        name=f"normed-mlp-lm-{optimizer}",
        model_factory=functools.partial(NormedMLPLM, 32, 16, 32, 2),
        dataset=SyntheticTokens(64, seq_len, 32),
        loss_fn=lm_loss,
        optimizer_factory=OPTIMIZERS[optimizer],
        global_batch_size=global_batch_size,
        micro_batches=micro_batches,
        steps=steps,
        seed=seed,
    )


def masked_lm_loss(logits: torch.Tensor, targets: dict) -> torch.Tensor:
    """Next-token cross entropy averaged over the valid (unmasked) positions of the batch it is
    given: ``sum(ce * mask) / mask.sum()``, the masked loss of padded batches (Hugging Face's
    loss with ``-100`` labels computes the same)."""
    ce = F.cross_entropy(logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32)),
                         targets["labels"].flatten(), reduction="none")
    mask = targets["mask"].flatten().to(ce.dtype)
    return (ce * mask).sum() / mask.sum()


def valid_tokens(batch: Any) -> torch.Tensor:
    """The number of valid positions in a batch of :class:`~cases.data.MaskedTokens`: what
    :func:`masked_lm_loss` is a mean over."""
    return batch.targets["mask"].sum()


def masked_lm_case(
    optimizer: str = "adamw", *, steps: int = 2, global_batch_size: int = 8, micro_batches: int = 1,
    normalised: bool = False, per_replica: tuple[str, ...] = (), seed: int = 0,
) -> Case:
    """A 2-layer tiny transformer with :func:`masked_lm_loss` on :class:`~cases.data.MaskedTokens`.
    ``normalised``: the step's loss is the mean over *all* its valid tokens (``loss_normaliser``
    = :func:`valid_tokens`), else each micro-batch's masked mean weighted by its samples (the
    loss normalised per micro-batch). ``per_replica``: declared per-replica statistics."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZERS)}")
    name = f"masked-lm-{optimizer}-m{micro_batches}" + ("-token-normalised" if normalised else "") + (
        "-per-replica" if per_replica else "")
    return Case(
        name=name,
        model_factory=functools.partial(TinyTransformer, vocab=32, dim=16, heads=4, hidden=32, layers=2, max_seq_len=16),
        dataset=MaskedTokens(64, 8, 32),
        loss_fn=masked_lm_loss,
        optimizer_factory=OPTIMIZERS[optimizer],
        global_batch_size=global_batch_size,
        micro_batches=micro_batches,
        steps=steps,
        seed=seed,
        loss_normaliser=valid_tokens if normalised else None,
        per_replica=per_replica,
    )
