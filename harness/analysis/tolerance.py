"""Tolerances: defaults per dtype, or calibrated from the reference's own numerical noise.

Every comparison records which tolerance it used and why (:class:`Tolerance`).

Calibration retrains the reference in mathematically equivalent ways (a float64 run from the
same rounded start, and a run with a different micro-batch split and sample order, i.e. a
different reduction order) and measures how far those land from the reference: that is the
noise a correct parallel run cannot avoid. With ``stepwise`` (the default comparison, see
:mod:`reference.replay`) each equivalent run takes every step from the reference's own state,
so the noise measured is that of one step's loss and gradients, not a compounded trajectory;
parameters and optimizer state are then checked as an update from identical inputs, which has
no reduction noise to calibrate (per-dtype defaults).

A tensor's tolerance is ``safety x max(its own measured noise, typical relative noise of its
kind x its magnitude)``. The typical relative noise is the *median* over the step's tensors of
that kind: it keeps a tensor whose own rerun happened to be lucky from being held to a tighter
bound than its siblings, and, unlike the maximum, it is not blown up by a tensor that is pure
noise (a gradient that is exactly zero in exact arithmetic, such as an attention key bias,
measures noise as large as itself), which would otherwise blind the whole kind.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from reference.cache import cached_noise_replay, cached_reference
from reference.case import Case
from reference.record import Record, dtype_from_str
from reference.draws import forward_draws_random_numbers
from reference.trainer import ReferenceVariant, step_gradients

__all__ = [
    "DEFAULT_TOLERANCES",
    "CalibratedTolerances",
    "DefaultTolerances",
    "Tolerance",
    "TolerancePolicy",
    "calibrate",
    "calibration_variants",
    "reference_dtype",
]

# (rtol, atol) per dtype, where atol is *relative to the reference tensor's largest
# magnitude*: rounding errors of sums scale with the values summed, so an absolute atol would be
# blind on tiny tensors (Adam's exp_avg_sq ~ 1e-8) and too strict on large ones. float32 is
# looser than torch.testing.assert_close's single-op default (1.3e-6) because a parallel run
# sums the batch in another order and a few optimizer steps compound it; bf16/fp16 keep
# torch's rtol and are meant to be used with calibration.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}
# Below this the scale-relative atol bottoms out (all-zero tensors are compared exactly-ish).
ABS_FLOOR: dict[torch.dtype, float] = {
    torch.float64: 1e-15,
    torch.float32: 1e-12,
    torch.bfloat16: 1e-6,
    torch.float16: 1e-7,
}


@dataclass(frozen=True)
class Tolerance:
    """What a comparison allowed: ``|actual - expected| <= atol + rtol * |expected|``."""

    rtol: float
    atol: float
    source: str  # "default" | "calibrated" | "override"
    reason: str


class TolerancePolicy(Protocol):
    def for_tensor(self, step: int, kind: str, name: str, dtype: torch.dtype, scale: float) -> Tolerance:
        """``scale``: the reference tensor's largest magnitude."""
        ...

    def describe(self) -> dict[str, Any]: ...


def _default(dtype: torch.dtype) -> tuple[float, float, float]:
    """(rtol, scale-relative atol, absolute floor) for ``dtype``."""
    if dtype in DEFAULT_TOLERANCES:
        return (*DEFAULT_TOLERANCES[dtype], ABS_FLOOR[dtype])
    if not dtype.is_floating_point:
        return (0.0, 0.0, 0.0)
    raise ValueError(f"no default tolerance for {dtype}; allowed: {list(DEFAULT_TOLERANCES)}")


@dataclass
class DefaultTolerances:
    """Per-dtype defaults; ``overrides`` maps a dtype to ``(rtol, atol)``."""

    overrides: Mapping[torch.dtype, tuple[float, float]] = field(default_factory=dict)

    def for_tensor(self, step: int, kind: str, name: str, dtype: torch.dtype, scale: float) -> Tolerance:
        if dtype in self.overrides:
            rtol, atol = self.overrides[dtype]
            return Tolerance(rtol, atol, "override", f"user override for {dtype}: rtol {rtol:g}, atol {atol:g}")
        if not dtype.is_floating_point:
            return Tolerance(0.0, 0.0, "default", f"{dtype} is exact: equality required")
        rtol, rel_atol, floor = _default(dtype)
        atol = max(floor, rel_atol * scale)
        return Tolerance(
            rtol, atol, "default",
            f"per-dtype default for {dtype}: rtol {rtol:g}, atol {rel_atol:g} x max|reference| {scale:.3g} (floor {floor:g})",
        )

    def describe(self) -> dict[str, Any]:
        table = {str(d): {"rtol": r, "atol_x_scale": a} for d, (r, a) in DEFAULT_TOLERANCES.items()}
        table.update({str(d): {"rtol": r, "atol": a} for d, (r, a) in self.overrides.items()})
        return {"mode": "default", "per_dtype": table}


@dataclass
class CalibratedTolerances:
    """Tolerances from measured noise: ``noise[(step, kind, name)] = (max abs noise, scale)``
    where scale is the reference tensor's max magnitude."""

    noise: dict[tuple[int, str, str], tuple[float, float]]
    variants: list[str]
    safety: float = 4.0
    stepwise: bool = False  # measured one step at a time from the reference's own state
    # Variants measured but not used as noise, each with why (a split that changes what the
    # loss computes; a difference beyond the dtype's rounding): see :func:`calibrate`.
    rejected: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        per_kind: dict[tuple[int, str], list[float]] = {}
        for (step, kind, _), (abs_noise, scale) in self.noise.items():
            if scale > 0:
                per_kind.setdefault((step, kind), []).append(abs_noise / scale)
        self._relative: dict[tuple[int, str], float] = {key: _median(rels) for key, rels in per_kind.items()}

    def for_tensor(self, step: int, kind: str, name: str, dtype: torch.dtype, scale: float) -> Tolerance:
        key = (step, kind, name)
        if not dtype.is_floating_point or key not in self.noise:
            fallback = DefaultTolerances().for_tensor(step, kind, name, dtype, scale)
            why = "not calibrated"
            if self.stepwise and kind in ("param", "optim"):
                why = "an update from the same parameters, optimizer state and gradients (no reduction noise)"
            return Tolerance(fallback.rtol, fallback.atol, fallback.source, f"{why}; {fallback.reason}")
        rtol, _, floor = _default(dtype)
        abs_noise, _ = self.noise[key]
        rel = self._relative.get((step, kind), 0.0)
        measured = max(abs_noise, rel * scale)
        atol = max(floor, self.safety * measured)
        why = (
            f"calibrated: {self.safety:g} x max(own noise {abs_noise:.3g}, worst {kind} noise "
            f"{rel:.3g} x scale {scale:.3g}) against {', '.join(self.variants)}; floor {floor:g}; "
            f"rtol {rtol:g} ({dtype} default)"
        )
        return Tolerance(rtol, atol, "calibrated", why)

    def describe(self) -> dict[str, Any]:
        return {
            "mode": "calibrated",
            "stepwise": self.stepwise,
            "variants": self.variants,
            "rejected": self.rejected,
            "safety": self.safety,
            "relative_noise": {f"{s}:{k}": v for (s, k), v in sorted(self._relative.items())},
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "variants": self.variants,
            "rejected": self.rejected,
            "safety": self.safety,
            "stepwise": self.stepwise,
            "noise": [[s, k, n, a, sc] for (s, k, n), (a, sc) in self.noise.items()],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "CalibratedTolerances":
        return cls(
            noise={(int(s), k, n): (float(a), float(sc)) for s, k, n, a, sc in data["noise"]},
            variants=list(data["variants"]),
            safety=float(data["safety"]),
            stepwise=bool(data.get("stepwise", False)),
            rejected=list(data.get("rejected", [])),
        )


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def calibration_variants(case: Case) -> list[ReferenceVariant]:
    """The equivalent reruns used to measure noise: float64 from the same rounded start, and
    a different reduction order (twice the micro-batches where the batch allows it, each fed
    in reverse). A model whose forward draws random numbers (dropout) gets no reordered rerun:
    its masks would land on other samples, which is not the same computation."""
    variants = [ReferenceVariant(upcast=torch.float64)] if case.dtype != torch.float64 else []
    if not forward_draws_random_numbers(case):
        doubled = case.micro_batches * 2
        micro = doubled if case.global_batch_size % doubled == 0 else None
        variants.append(ReferenceVariant(micro_batches=micro, reverse=True))
    return variants


def _variant_label(v: ReferenceVariant) -> str:
    if v.upcast is not None:
        return f"{str(v.upcast).removeprefix('torch.')} rerun"
    return "reordered reduction" + (f" ({v.micro_batches} micro-batches, reversed)" if v.micro_batches else " (reversed)")


def _loss_entries(record: Record, step: int, with_micro: bool) -> dict[str, float | None]:
    s = record.step(step)
    entries: dict[str, float | None] = {"loss": s.loss}
    if with_micro:
        entries.update({f"micro.{i}": v for i, v in enumerate(s.micro_losses)})
    return entries


def _measure(
    reference: Record,
    other: Record,
    same_micro: bool,
    noise: dict[tuple[int, str, str], tuple[float, float]],
    kinds: Sequence[str] = ("grad", "param", "optim"),
) -> None:
    def add(key: tuple[int, str, str], abs_noise: float, scale: float) -> None:
        old = noise.get(key, (0.0, scale))
        noise[key] = (max(old[0], abs_noise), scale)

    for step in range(min(reference.num_steps, other.num_steps)):
        ref_loss = _loss_entries(reference, step, True)
        other_loss = _loss_entries(other, step, same_micro)
        for name, value in ref_loss.items():
            if value is None:
                continue
            if name in other_loss and other_loss[name] is not None:
                add((step, "loss", name), abs(float(other_loss[name]) - value), abs(value))
            else:
                add((step, "loss", name), 0.0, abs(value))
        for kind in kinds:
            other_names = set(other.step(step).names(kind))
            for name in reference.step(step).names(kind):
                ref = reference.tensor(step, kind, name).double()
                scale = float(ref.abs().max()) if ref.numel() else 0.0
                if name not in other_names:
                    add((step, kind, name), 0.0, scale)
                    continue
                diff = (other.tensor(step, kind, name).double() - ref).abs()
                add((step, kind, name), float(diff.max()) if diff.numel() else 0.0, scale)


# Reordering a reduction changes a float64 result by rounding only, ~1e-16 of the magnitudes
# summed. A split variant whose float64 twin moves the loss or a gradient by more than
# SEMANTIC_MARGIN x what reversing the samples inside each micro-batch moves it (the same
# computation reordered: its float64 rounding, or coarser where parts of the program compute in
# float32 even then - a model's own loss cast to float32, an op without a float64 kernel), and
# by at least FLOAT64_INVARIANCE of the largest magnitude, computes something else.
FLOAT64_INVARIANCE = 1e-9
SEMANTIC_MARGIN = 100.0
# A reordered run in the case dtype differs from the reference by two draws of the rounding the
# float64 rerun measures (reference vs exact, variant vs exact): a median relative gradient
# noise beyond this many times the float64 rerun's is not rounding.
ROUNDING_BOUND = 100.0


def _step_distance(a: tuple[float, dict[str, torch.Tensor]], b: tuple[float, dict[str, torch.Tensor]]) -> float:
    """Largest difference between two (loss, gradients) of one step, relative to the loss and
    to the largest gradient magnitude."""
    (la, ga), (lb, gb) = a, b
    worst = abs(la - lb) / max(abs(la), 1e-30)
    scale = max((float(t.abs().max()) for t in ga.values() if t.numel()), default=0.0)
    for name, ta in ga.items():
        tb = gb.get(name)
        if tb is not None and ta.shape == tb.shape and ta.numel():
            worst = max(worst, float((ta.double() - tb.double()).abs().max()) / max(scale, 1e-30))
    return worst


def grad_distance(a: Record, b: Record) -> float:
    """Largest difference between two records' losses and gradients, relative to the largest
    magnitude of its kind (losses, gradients) over every step."""
    worst = 0.0
    for step in range(min(a.num_steps, b.num_steps)):
        la, lb = a.step(step).loss, b.step(step).loss
        if la is not None and lb is not None:
            worst = max(worst, abs(la - lb) / max(abs(la), 1e-30))
        names = [n for n in a.step(step).names("grad") if n in set(b.step(step).names("grad"))]
        scale = max((float(a.tensor(step, "grad", n).abs().max()) for n in names if a.info(step, "grad", n).shape), default=0.0)
        for n in names:
            ta, tb = a.tensor(step, "grad", n).double(), b.tensor(step, "grad", n).double()
            if ta.shape == tb.shape and ta.numel():
                worst = max(worst, float((ta - tb).abs().max()) / max(scale, 1e-30))
    return worst


def calibrate(
    case: Case,
    reference: Record,
    *,
    cache: str | os.PathLike[str] | None = None,
    device: torch.device | str = "cpu",
    variants: Sequence[ReferenceVariant] | None = None,
    safety: float = 4.0,
    stepwise: bool = False,
) -> CalibratedTolerances:
    """Measure ``reference``'s numerical noise by retraining ``case`` in equivalent ways (cached
    like the reference) and turn it into per-tensor tolerances. ``stepwise``: each equivalent
    run takes every step from the reference's own state and only the loss and gradients are
    measured (the noise of one step, for the same-start comparison).

    A variant is noise only if it computes the same thing. Each reordered variant is checked
    against its float64 twin: when reordering in float64 moves the loss or a gradient by more
    than rounding can (:data:`FLOAT64_INVARIANCE`), the split changes the program's meaning (a
    loss normalised per micro-batch: masked means, token means, per-batch statistics) and the
    variant is rejected - never learnt as noise - in favour of one that keeps the micro-batches
    (samples reversed inside each). A kept variant's noise is bounded by what the dtype's
    rounding produces, measured by the float64 rerun (:data:`ROUNDING_BOUND`)."""
    variants = list(variants) if variants is not None else calibration_variants(case)

    def run(variant: ReferenceVariant) -> Record:
        if stepwise:
            return cached_noise_replay(case, variant, cache=cache, device=device)
        return cached_reference(case, cache=cache, device=device, variant=variant)

    def exact(variant: ReferenceVariant) -> tuple[float, dict[str, torch.Tensor]]:
        """Step 0's loss and gradients under ``variant`` in float64 (the meaning of a program
        does not change from step to step: one step tells a reordering from another loss)."""
        return step_gradients(case, ReferenceVariant(upcast=torch.float64, micro_batches=variant.micro_batches,
                                                     reverse=variant.reverse))

    kinds = ("grad",) if stepwise else ("grad", "param", "optim")
    noise: dict[tuple[int, str, str], tuple[float, float]] = {}
    labels: list[str] = []
    rejected: list[str] = []
    rounding: dict[tuple[int, str], float] | None = None
    suffix = ", one step from the reference's state" if stepwise else ""
    for variant in variants:
        if variant.upcast is None:  # a reordering: does it compute the same thing?
            variant, why = _semantics_keeping(variant, case, exact, rejected)
            if variant is None:
                continue
        other = run(variant)
        measured: dict[tuple[int, str, str], tuple[float, float]] = {}
        _measure(reference, other, variant.micro_batches in (None, case.micro_batches), measured, kinds=kinds)
        label = _variant_label(variant) + suffix
        if other.meta.get("upcast_fallback"):
            label += (f" (ops without a {str(variant.upcast).removeprefix('torch.')} kernel ran in "
                      f"{str(case.dtype).removeprefix('torch.')}: {', '.join(other.meta['upcast_fallback'])})")
        if variant.upcast is not None:
            rounding = _median_relative(measured)
        elif rounding is not None:
            beyond = _beyond_rounding(measured, rounding)
            if beyond:
                rejected.append(f"{label}: {beyond}, more than {ROUNDING_BOUND:g} x what the float64 rerun measured "
                                f"{str(case.dtype).removeprefix('torch.')} rounding to produce: not used as noise")
                continue
        labels.append(label)
        for key, (abs_noise, scale) in measured.items():
            old = noise.get(key, (0.0, scale))
            noise[key] = (max(old[0], abs_noise), scale)
    return CalibratedTolerances(noise, labels, safety, stepwise=stepwise, rejected=rejected)


def _semantics_keeping(
    variant: ReferenceVariant, case: Case, exact: Any, rejected: list[str]
) -> tuple[ReferenceVariant | None, str]:
    """``variant`` when it keeps the program's meaning, else the reversal of the samples inside
    the case's own micro-batches (which keeps it: a sum or mean over a batch does not depend on
    its order); a rejection is noted in ``rejected``. A split's meaning is kept when its float64
    twin lands as close to the float64 reference as the reversal's twin does (within
    ``SEMANTIC_MARGIN``, floor ``FLOAT64_INVARIANCE``)."""
    if variant.micro_batches in (None, case.micro_batches):
        return variant, ""
    base = exact(ReferenceVariant())
    floor = _step_distance(base, exact(ReferenceVariant(reverse=True)))
    distance = _step_distance(base, exact(variant))
    bound = max(FLOAT64_INVARIANCE, SEMANTIC_MARGIN * floor)
    if distance <= bound:
        return variant, ""
    rejected.append(
        f"{_variant_label(variant)}: splitting each micro-batch in two changes what is computed - in float64 the loss or a "
        f"gradient moves by {distance:.3g} of its largest magnitude, where reordering the same samples moves it by {floor:.3g}: "
        "the loss is not invariant to splitting the batch (normalised per micro-batch: a masked or token mean, a batch "
        "statistic); not used as noise, the samples reversed inside each micro-batch instead"
    )
    return ReferenceVariant(reverse=True), ""


def _median_relative(measured: Mapping[tuple[int, str, str], tuple[float, float]]) -> dict[tuple[int, str], float]:
    per_kind: dict[tuple[int, str], list[float]] = {}
    for (step, kind, _), (abs_noise, scale) in measured.items():
        if scale > 0:
            per_kind.setdefault((step, kind), []).append(abs_noise / scale)
    return {key: _median(v) for key, v in per_kind.items()}


def _beyond_rounding(measured: Mapping[tuple[int, str, str], tuple[float, float]], rounding: Mapping[tuple[int, str], float]) -> str:
    """'' when ``measured``'s median relative gradient noise per step is within
    ``ROUNDING_BOUND`` x the float64 rerun's; else what exceeded it."""
    for key, rel in sorted(_median_relative(measured).items()):
        if key[1] != "grad":
            continue
        bound = rounding.get(key)
        if bound is not None and bound > 0 and rel > ROUNDING_BOUND * bound:
            return f"its median relative {key[1]} noise at step {key[0]} is {rel:.3g} against {bound:.3g} from float64"
    return ""


def reference_dtype(record: Record) -> torch.dtype:
    return dtype_from_str(str(record.meta.get("dtype", "torch.float32")))


# -- the adaptive optimizer's sign noise ----------------------------------------------------

# An adaptive step moves an element by at most about lr (|m_hat / sqrt(v_hat)| <= ~1); a sign
# flip of its gradient therefore costs at most ~2 lr per step. The margin covers weight decay
# and bias correction at the first steps.
_SIGN_FLIP_STEP = 2.5


def adaptive_sign_noise(
    reference: Record,
    actual: Record,
    result: Any,
    param: Any,
    counts: dict[str, tuple[int, torch.Tensor]] | None = None,
) -> int | None:
    """How many of ``param``'s out-of-tolerance elements an adaptive optimizer's sign noise
    explains, or None when it does not explain all of them. ``param`` is the parameter's
    :class:`~harness.analysis.compare.TensorComparison` in ``result`` (a
    :class:`~harness.analysis.compare.CompareResult`, read for the gradient tolerances).

    Adam-family optimizers (an ``exp_avg_sq`` in the state) move an element by about +-lr
    whatever its gradient's size. Where the reference gradient is within the comparison's own
    gradient tolerance of 0 - so a correct run may see the other sign - the step's direction is
    rounding noise and a correct run lands up to 2 lr away (common in bf16). An element is
    explained when it differs by at most ~2 lr for each step up to this one at which its
    gradient was sign-uncertain, and there was at least one; gradients, loss and optimizer
    state are still compared as usual, so a real bug (which moves gradients, or elements whose
    gradient is clearly non-zero, or by more than the bound) still fails.

    ``counts`` carries each parameter's count of sign-uncertain steps from one call to the next
    (:func:`compare` passes one per comparison), so a parameter that stays off step after step
    is counted once per step, not from step 0 again."""
    step, name = param.step, param.name
    if param.kind != "param" or f"{name}.exp_avg_sq" not in reference.step(step).names("optim"):
        return None
    lrs = [g.get("lr") for g in reference.step(step).param_groups if name in g.get("params", [])]
    if len(lrs) != 1 or not isinstance(lrs[0], (int, float)) or lrs[0] <= 0:
        return None
    counts = {} if counts is None else counts
    counted, uncertain_steps = counts.get(name, (-1, None))
    for j in range(counted + 1, step + 1):
        try:
            grad_tol = result.get(j, "grad", name).tolerance
        except KeyError:
            return None
        g = reference.tensor(j, "grad", name).double().abs()
        uncertain = (g <= grad_tol.atol + grad_tol.rtol * g).to(torch.int64)
        uncertain_steps = uncertain if uncertain_steps is None else uncertain_steps + uncertain
        counts[name] = (j, uncertain_steps)
    assert uncertain_steps is not None
    a, e = actual.tensor(step, "param", name).double(), reference.tensor(step, "param", name).double()
    diff = (a - e).abs()
    differs = ~(diff <= param.tolerance.atol + param.tolerance.rtol * e.abs())  # NaN differs
    explained = (uncertain_steps > 0) & (diff <= _SIGN_FLIP_STEP * float(lrs[0]) * uncertain_steps)
    if not bool((~differs | explained).all()):
        return None
    return int(differs.sum())
