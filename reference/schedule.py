"""The batch schedule: which dataset indices each step, micro-batch and replica consumes.

The global order is ``torch.utils.data.DistributedSampler``'s: per epoch a permutation from
``torch.randperm(len, generator seeded with seed + epoch)`` (or ``arange`` without shuffle);
step ``k`` of an epoch takes positions ``[k*B, (k+1)*B)``. Replica ``r`` of ``W`` takes every
W-th position (``indices[r::W]``, exactly what DistributedSampler hands that rank), so the union
of the replicas' step-``k`` batches is the reference's step-``k`` batch, and replica micro-batch
``m`` (a contiguous chunk of its local batch) lies inside the reference's micro-batch ``m``.
"""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler

from .case import Batch, Case, CaseError, collate

__all__ = ["batch_weight", "global_batch_indices", "micro_batch_indices", "replica_micro_batch_indices", "step_normaliser"]


def _epoch_and_offset(case: Case, step: int) -> tuple[int, int]:
    if step < 0:
        raise CaseError(f"step must be >= 0, got {step}")
    epoch, k = divmod(step, case.steps_per_epoch)
    return epoch, k * case.global_batch_size


def _epoch_order(case: Case, epoch: int) -> list[int]:
    n = len(case.dataset)
    if not case.shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(case.seed + epoch)  # DistributedSampler's seeding
    return torch.randperm(n, generator=g).tolist()


def global_batch_indices(case: Case, step: int) -> list[int]:
    """Dataset indices of the whole global batch of ``step`` (all replicas together)."""
    epoch, start = _epoch_and_offset(case, step)
    return _epoch_order(case, epoch)[start : start + case.global_batch_size]


def micro_batch_indices(case: Case, step: int) -> list[list[int]]:
    """The global batch of ``step`` split into ``case.micro_batches`` contiguous chunks."""
    idx = global_batch_indices(case, step)
    size = case.micro_batch_size
    return [idx[m * size : (m + 1) * size] for m in range(case.micro_batches)]


def replica_micro_batch_indices(
    case: Case, step: int, replica: int, num_replicas: int
) -> list[list[int]]:
    """The micro-batches data-parallel replica ``replica`` of ``num_replicas`` consumes at
    ``step``, taken from a real ``DistributedSampler``."""
    if not 0 <= replica < num_replicas:
        raise CaseError(f"replica {replica} is outside 0..{num_replicas - 1}")
    per_replica, rem = divmod(case.global_batch_size, num_replicas * case.micro_batches)
    if rem:
        raise CaseError(
            f"case {case.name!r}: global_batch_size {case.global_batch_size} is not divisible "
            f"by replicas x micro_batches = {num_replicas} x {case.micro_batches}"
        )
    epoch, start = _epoch_and_offset(case, step)
    sampler = DistributedSampler(
        case.dataset,  # type: ignore[arg-type]
        num_replicas=num_replicas,
        rank=replica,
        shuffle=case.shuffle,
        seed=case.seed,
        drop_last=False,
    )
    sampler.set_epoch(epoch)
    local = list(sampler)
    local_batch = case.global_batch_size // num_replicas
    first = start // num_replicas
    mine = local[first : first + local_batch]
    return [mine[m * per_replica : (m + 1) * per_replica] for m in range(case.micro_batches)]


def step_normaliser(case: Case, step: int) -> float:
    """The total of :meth:`Case.normaliser` over ``step``'s global batch: its global batch size
    without a ``loss_normaliser``, else its valid tokens (or whatever the normaliser counts)."""
    if case.loss_normaliser is None:
        return float(case.global_batch_size)
    cache = case.__dict__.setdefault("_step_normalisers", {})  # frozen dataclass: a cache beside the fields
    if step not in cache:
        cache[step] = sum(case.normaliser(collate(case.dataset, idx, dtype=case.dtype, step=step))
                          for idx in micro_batch_indices(case, step))
    return cache[step]


def batch_weight(case: Case, batch: Batch, replicas: int = 1, *, grad_reduction: str = "mean", step: int | None = None) -> float:
    """:meth:`Case.loss_weight` for ``batch``: its samples' share of the global batch, or with a
    ``loss_normaliser`` its count's share of the step's (``step`` defaults to the one the
    harness collated the batch for)."""
    if case.loss_normaliser is None:
        return case.loss_weight(len(batch), replicas, grad_reduction=grad_reduction)
    step = batch.step if step is None else step
    if step is None:
        raise CaseError(f"case {case.name!r} has a loss_normaliser: weighting a batch needs its step (collate it with "
                        "step=..., or use run.batches(step))")
    total = step_normaliser(case, step)
    if not total:
        return 0.0
    # loss_weight with the batch's count for its samples and the step's for the global batch.
    per_sync = case.loss_weight(1, replicas, grad_reduction=grad_reduction) * case.global_batch_size
    per_loss = case.normaliser(batch) if case.loss_reduction == "mean" else 1.0
    return per_loss * per_sync / total
