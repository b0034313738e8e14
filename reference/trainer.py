"""The single-device reference trainer: what a correct parallel run must reproduce.

It follows the batch schedule of :mod:`reference.schedule` (the global batch of every step, in
the same micro-batches a parallel run's replicas use together) and the same accumulation
semantics: each micro-batch's mean loss is weighted by its share of the global batch, so the
step's gradient is that of the mean loss over the global batch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .case import Case, CaseError, cast_floating, check_dataset, collate, to_batch_values
from .record import (
    Record,
    RecordWriter,
    optimizer_param_groups,
    optimizer_state_items,
)
from .schedule import batch_weight, global_batch_indices, micro_batch_indices, replica_micro_batch_indices

__all__ = [
    "NonFiniteReferenceError",
    "ReferenceVariant",
    "dropout_info",
    "train_reference",
]


class NonFiniteReferenceError(CaseError):
    """The reference itself produced NaN/inf, so there is nothing sound to compare against."""


@dataclass(frozen=True)
class ReferenceVariant:
    """A mathematically equivalent way to train the same case, used to measure the
    reference's own numerical noise (see :mod:`harness.analysis.tolerance`).

    - ``upcast``: start from the case-dtype weights and inputs, then compute in this dtype
      (e.g. float64: the "exact" answer for the case's starting point).
    - ``micro_batches``: split each global batch into this many micro-batches instead.
    - ``reverse``: feed each micro-batch's samples in reverse order (changes the order of the
      batch-dimension reductions, not their result in exact arithmetic).
    - ``replicas``: the per-replica reference of a data-parallel layout: each micro-batch is
      split as that many replicas take it (``DistributedSampler``) and every replica's piece runs
      forward on its own, its loss weighted by its own share (what a program computing batch
      statistics per replica computes; equal to the one-device reference for a program that
      computes none).
    """

    upcast: torch.dtype | None = None
    micro_batches: int | None = None
    reverse: bool = False
    replicas: int | None = None

    def describe(self) -> dict[str, Any]:
        data = asdict(self)
        data["upcast"] = str(self.upcast) if self.upcast is not None else None
        return data


def dropout_info(model: nn.Module) -> dict[str, Any]:
    """Which dropout modules are active (p > 0 in training mode)."""
    active = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0 and module.training
    ]
    return {"active": bool(active), "modules": active}


def _check_finite(finite: bool, step: int, kind: str, name: str, case: Case) -> None:
    if not finite:
        raise NonFiniteReferenceError(
            f"case {case.name!r}: the reference produced NaN/inf in {kind} {name!r} at step "
            f"{step}; a case whose reference is not finite cannot be compared (lower the "
            "learning rate, check the loss or the data)"
        )


def step_gradients(case: Case, variant: ReferenceVariant, step: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and gradients of ``step``'s batch from the case's initial weights, computed as
    ``variant`` computes them (its dtype, micro-batch split and order), nothing written: what the
    calibration compares to tell a reordering from a change of meaning."""
    from types import SimpleNamespace

    with torch.random.fork_rng(devices=[]):
        model = case.build_model("cpu")
        if variant.upcast is not None:
            model = cast_floating(model, variant.upcast)
        training = _Training(case, variant, model, None, None, torch.device("cpu"))  # type: ignore[arg-type]
        torch.manual_seed(case.seed)
        rec = SimpleNamespace(micro_losses=[], micro_sample_ids=[], sample_ids=[], loss=None)
        training.forward_backward(step, rec)
    return float(rec.loss), {n: p.grad.detach().clone() for n, p in training.named if p.grad is not None}


def train_reference(
    case: Case,
    path: str | os.PathLike[str],
    *,
    device: torch.device | str = "cpu",
    variant: ReferenceVariant | None = None,
    overwrite: bool = False,
    meta: Mapping[str, Any] | None = None,
) -> Record:
    """Train ``case`` on one device and write its record at ``path``.

    Raises :class:`CaseError` for a case that cannot be compared (non-deterministic model
    factory, dataset without ids) and :class:`NonFiniteReferenceError` when the reference
    goes NaN/inf; in that case the steps recorded so far are kept with ``complete: false``.
    """
    variant = variant or ReferenceVariant()
    case.validate()
    case.check_model_factory()
    used = [i for s in range(case.steps) for i in global_batch_indices(case, s)]
    check_dataset(case.dataset, sorted(set(used)))

    run = _Training.open(case, path, device=device, variant=variant, source="reference", meta=meta, overwrite=overwrite)
    return run.train(lambda step: run.step(step), case.steps)


class _Training:
    """One reference training run, step by step, writing into ``writer``."""

    def __init__(
        self,
        case: Case,
        variant: ReferenceVariant,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        writer: RecordWriter,
        device: torch.device,
    ):
        self.case = case
        self.schedule = case.replace(micro_batches=variant.micro_batches) if variant.micro_batches else case
        self.variant = variant
        self.model = model
        self.optimizer = optimizer
        self.writer = writer
        self.device = device
        self.dtype = variant.upcast or case.dtype
        self.named = list(model.named_parameters())
        self.param_names = {id(p): n for n, p in self.named}
        self.draw_replay: Any = None  # a reference.draws.DrawReplay while a step replays a run's draws
        # Stepped after each optimizer step (no optimizer: a measurement of gradients alone).
        self.lr_scheduler = case.build_lr_scheduler(optimizer) if optimizer is not None else None

    @classmethod
    def open(
        cls,
        case: Case,
        path: str | os.PathLike[str],
        *,
        device: torch.device | str,
        variant: ReferenceVariant,
        source: str,
        meta: Mapping[str, Any] | None,
        overwrite: bool,
    ) -> "_Training":
        """The case's model (in the variant's dtype), its optimizer and a record writer."""
        device = torch.device(device)
        model = case.build_model(device)
        if variant.upcast is not None:
            model = cast_floating(model, variant.upcast)
        writer = RecordWriter(
            path,
            {
                "source": source,
                "case": case.describe(),
                "device": str(device),
                "dtype": str(variant.upcast or case.dtype),
                "variant": variant.describe(),
                "world_size": 1,
                "dropout": dropout_info(model),
                **(meta or {}),
            },
            overwrite=overwrite,
        )
        return cls(case, variant, model, case.build_optimizer(model.parameters()), writer, device)

    def train(self, step_fn: Any, steps: int) -> Record:
        """Run ``step_fn(step)`` for each step from the case seed and publish the record; a
        failed run still publishes the steps it recorded (nothing recorded is lost)."""
        self.case.seed_training()
        try:
            for step in range(steps):
                step_fn(step)
        except BaseException:
            try:
                self.writer.finish(complete=False)
            except Exception:
                self.writer.abort()
            raise
        return self.writer.finish(complete=True)

    def step(self, step: int) -> None:
        rec = self.writer.step(step)
        self.forward_backward(step, rec)
        self.case.clip_gradients(self.model.parameters())
        self.record_grads(step)
        self.optimizer_step()
        self.record_update(step, rec)

    def optimizer_step(self) -> None:
        """The optimizer step, then the case's lr schedule (the lr of the next step)."""
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def forward_backward(self, step: int, rec: Any) -> None:
        """Forward and backward over the step's micro-batches; records losses and sample ids.
        An upcast variant runs under :class:`~reference.upcast.UpcastFallback`: an op with no
        kernel for the wider dtype runs in the case dtype, and the record lists it
        (``meta["upcast_fallback"]``)."""
        if self.variant.upcast is None:
            self._forward_backward(step, rec)
            return
        from .upcast import UpcastFallback

        with UpcastFallback(self.variant.upcast, self.case.dtype) as mode:
            self._forward_backward(step, rec)
        if mode.fell_back and self.writer is not None:
            known = set(self.writer.meta.get("upcast_fallback", []))
            self.writer.meta["upcast_fallback"] = sorted(known | mode.fell_back)

    def micro_batch_pieces(self, step: int) -> list[list[list[int]]]:
        """Per micro-batch of ``step``, the index lists that run forward on their own: the whole
        micro-batch, or with ``variant.replicas`` each replica's piece of it."""
        if not self.variant.replicas:
            return [[indices] for indices in micro_batch_indices(self.schedule, step)]
        per_replica = [replica_micro_batch_indices(self.schedule, step, r, self.variant.replicas) for r in range(self.variant.replicas)]
        return [[mine[m] for mine in per_replica] for m in range(self.schedule.micro_batches)]

    def _forward_backward(self, step: int, rec: Any) -> None:
        case = self.case
        everything: list[tuple[float, float]] = []  # (micro-batch loss, its share of the step)
        for m, micro in enumerate(self.micro_batch_pieces(step)):
            pieces: list[tuple[float, float]] = []
            ids: list[int] = []
            for indices in micro:
                if self.variant.reverse:
                    indices = indices[::-1]
                batch = collate(case.dataset, indices, device=self.device, dtype=case.dtype, step=step)
                if self.draw_replay is not None:
                    self.draw_replay.begin_forward(m, batch.ids)
                loss = case.compute_loss(case.call_model(self.model, self._cast(batch.inputs)), self._cast(batch.targets))
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise CaseError(
                        f"case {case.name!r}: the loss must be a scalar tensor (the {case.loss_reduction} over the "
                        f"micro-batch), got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
                    )
                # One device weights each micro-batch by its share of the step; the per-replica
                # reference weights each replica's piece by its samples, as averaging the
                # replicas' gradients does whatever each loss is normalised by.
                weight = case.loss_weight(len(batch)) if self.variant.replicas else batch_weight(case, batch, step=step)
                (loss * weight).backward()
                pieces.append((loss.detach().item(), case.normaliser(batch)))
                ids += batch.ids
            rec.micro_losses.append(case.combine_losses(pieces))
            rec.micro_sample_ids.append(ids)
            rec.sample_ids.extend(ids)
            share = sum(n for _, n in pieces) if case.loss_normaliser is not None else float(len(ids))
            everything.append((rec.micro_losses[-1], share))
        rec.loss = case.mean_loss(case.combine_losses(everything), sum(n for _, n in everything))
        _check_finite(math.isfinite(rec.loss), step, "loss", "loss", case)

    def record_grads(self, step: int) -> None:
        for name, param in self.named:
            if param.grad is not None:
                self._add(step, "grad", name, param.grad)

    def record_update(self, step: int, rec: Any) -> None:
        """Parameters and optimizer state after the optimizer step; clears the gradients."""
        for name, param in self.named:
            self._add(step, "param", name, param)
        for name, value in optimizer_state_items(self.optimizer, self.named):
            self._add(step, "optim", name, value)
        rec.param_groups = optimizer_param_groups(self.optimizer, self.param_names)
        self.optimizer.zero_grad(set_to_none=True)

    def _add(self, step: int, kind: str, name: str, tensor: torch.Tensor) -> None:
        _check_finite(self.writer.add_tensor(step, kind, name, tensor).finite, step, kind, name, self.case)

    def _cast(self, value: Any) -> Any:
        # Inputs are rounded to the case dtype first, so an upcast run starts from the same values.
        return to_batch_values(value, dtype=self.dtype)
