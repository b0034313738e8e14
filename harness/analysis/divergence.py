"""Where a failing run departs: the first module whose forward output leaves the reference's;
else the optimizer step when the gradients match and the update does not; else the first
failing gradient in backward order when only some of a step's gradients fail.

Only for a run whose comparison failed (a correct run never gets a location). The forward
location comes from the activation probe (:mod:`harness.record.probe`): every rank's module
outputs of the first micro-batch of step 0, against the reference model replayed on that
rank's own input (same weights, same step-0 state). Modules are visited in the order their
forward finished, so the first one that differs is the innermost, earliest place the values
leave the reference; what a module computes inline (a norm over a local shard, a matmul in the
parent's forward) shows at the module that contains it. Each rank's output is compared by
what it holds:

- a plain tensor, or a DTensor whose placements are all ``Replicate``: the reference's whole;
- a DTensor ``Shard(d)`` (or a plain tensor whose one differing dim is the reference's split
  by the tensor-parallel group): the reference's ``torch.chunk`` at the rank's coordinate;
- a DTensor ``Partial``: the sum over the rank's tensor-parallel group. A plain tensor that
  matches the reference only summed over its group is a partial sum some later module may
  reduce: not a departure by itself; when the module that contains it (or the model's output)
  is the next to depart, the partial was used unreduced, and the location is that child, with
  ``consumed_by`` naming where it showed.

The tolerance is the probe's rule - ``|a - e| <= rtol |e| + atol * max|e|`` with rtol 2e-3 and
atol 2e-4 for float32, widened for 16-bit dtypes by their machine epsilon's ratio to float32's over 4096 (bfloat16:
16x, float16: 2x): a
forward reassociated across ranks differs from the reference by a few ulps of each value's
magnitude, and a bug that changes what is computed by far more. A dropout module is compared too:
the reference replays its draw from the case's seed, so a mask that differs is where the values
depart (whether the ranks should have drawn it alike, the random-draw checks say)."""

from __future__ import annotations

from typing import Any

import torch

from reference.case import Case

from harness.analysis.compare import CompareResult, TensorComparison
from harness.analysis.probe_checks import PROBE_ATOL, PROBE_RTOL, reference_outputs
from harness.record.probe import OUTPUT, ProbeData

__all__ = ["first_divergence_location", "location_line"]

def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    widen = max(1.0, torch.finfo(dtype).eps / torch.finfo(torch.float32).eps / 4096) if dtype.is_floating_point else 1.0
    return PROBE_RTOL * widen, PROBE_ATOL * widen


def _difference(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float, float]:
    """(within, max_abs, max_rel) of ``actual`` against ``expected`` under the rule above."""
    a, e = actual.double(), expected.double()
    diff = (a - e).abs()
    scale = max(float(e.abs().max()), 1e-6) if e.numel() else 1.0
    within = bool((diff <= rtol * e.abs() + atol * scale).all()) and bool(torch.isfinite(a).all() or not torch.isfinite(e).all())
    max_abs = float(diff.max()) if diff.numel() else 0.0
    return within, max_abs, max_abs / scale


def _placement_kind(placements: str | None) -> tuple[str, int | None]:
    """``("whole" | "shard" | "partial" | "other", dim)`` of a capture's placements string."""
    if placements is None:
        return "plain", None
    parts = [p.strip() for p in placements.strip("()").split("),") if p.strip()]
    kinds = [p for p in parts if not p.startswith("Replicate")]
    if not kinds:
        return "whole", None
    if len(kinds) > 1:
        return "other", None
    only = kinds[0]
    if only.startswith("Shard"):
        digits = "".join(ch for ch in only.split("=")[-1] if ch.isdigit())
        return ("shard", int(digits)) if digits else ("other", None)
    if only.startswith("Partial"):
        return "partial", None
    return "other", None


def _tp(entry: dict[str, Any]) -> tuple[int | None, list[int]]:
    group = list(entry["groups"].get("tp") or [])
    coord = entry["mesh"].get("tp")
    return (int(coord) if coord is not None else None), group


def _group_sum(by_rank: dict[int, dict[str, Any]], group: list[int], name: str, shape: torch.Size) -> torch.Tensor | None:
    """The sum of module ``name``'s outputs over the ranks of ``group``, or None where one of
    them has no capture of that shape."""
    peers = [by_rank[r]["captures"].get(name) for r in group if r in by_rank]
    if not group or any(p is None or p.output.shape != shape for p in peers):
        return None
    return torch.stack([p.output for p in peers]).sum(0)


def _forward_location(data: ProbeData, case: Case) -> dict[str, Any] | None:
    rtol, atol = _tolerance(case.dtype)
    by_rank = {r["rank"]: r for r in data.ranks}
    first: dict[str, Any] | None = None
    for rank, entry in sorted(by_rank.items()):
        if entry["input"] is None or entry["stages"] not in (None, [0]):
            continue  # later pipeline stages do not see the model input
        ref = reference_outputs(data, rank, case)
        coord, group = _tp(entry)
        pending: list[str] = []  # modules whose output matched only as a partial sum, not reduced since
        for position, name in enumerate(entry["order"]):
            cap = entry["captures"][name]
            if name not in ref:
                continue
            expected, local = ref[name], cap.output
            kind, dim = _placement_kind(cap.placements)
            compared = "whole"
            if kind == "shard" or (kind == "plain" and local.shape != expected.shape):
                if kind == "plain":
                    differing = [d for d in range(local.dim()) if local.shape[d] != expected.shape[d]] \
                        if local.dim() == expected.dim() else []
                    if len(differing) != 1 or not group or expected.shape[differing[0]] != local.shape[differing[0]] * len(group):
                        continue  # not a split the layout explains: not compared
                    dim = differing[0]
                if coord is None or dim is None or dim >= expected.dim():
                    continue
                pieces = torch.chunk(expected, len(group) if group else 1, dim=dim)
                if coord >= len(pieces) or pieces[coord].shape != local.shape:
                    continue
                expected, compared = pieces[coord], f"chunk {coord} of {len(pieces)} along dim {dim}"
            elif kind == "partial":
                summed = _group_sum(by_rank, group, name, local.shape)
                if summed is None:
                    continue
                local, compared = summed, f"sum over the tensor-parallel group {group}"
            elif kind == "other" or local.shape != expected.shape:
                continue
            within, max_abs, max_rel = _difference(local, expected, rtol, atol)
            if within:
                if kind == "partial":
                    pending.append(name)
                elif name != OUTPUT:  # reduced at or inside ``name``: those partials were not the departure
                    pending = [q for q in pending if not q.startswith(name + ".")]
                continue
            if kind == "plain" and compared == "whole" and len(group) > 1:
                summed = _group_sum(by_rank, group, name, local.shape)
                if summed is not None and _difference(summed, expected, rtol, atol)[0]:
                    pending.append(name)  # a partial sum a later module may reduce (see the module docstring)
                    continue
            note = {"note": "a dropout whose mask differs from the reference's draw: whether the ranks should have "
                            "drawn it alike is the random-draw checks' to say"} if cap.p else {}
            culprit = next((q for q in pending if name == OUTPUT or q.startswith(name + ".")), None)
            if culprit is not None:
                # The departure shows in the module that used a partial sum of its own child unreduced.
                note["consumed_by"] = "<model output>" if name == OUTPUT else name
                note["partial_over"] = group
                cap = entry["captures"][culprit]
                name = culprit
            found = {**note, "phase": "forward", "module": "<model output>" if name == OUTPUT else name,
                     "module_type": cap.module_type, "op": None, "rank": rank, "step": 0, "max_abs": max_abs,
                     "max_rel": max_rel, "tolerance": {"rtol": rtol, "atol": atol, "of": "max |reference|"},
                     "compared": compared, "placements": cap.placements, "position": position}
            if first is None or position < first["position"]:
                first = found
            break
    if first is not None:
        first.pop("position")
    return first


def _first_failing_step(comparison: CompareResult) -> tuple[int, list[TensorComparison]] | None:
    """The first step with a tensor beyond tolerance and every comparison of that step."""
    failures = comparison.failures()
    if not failures:
        return None
    step = min(t.step for t in failures)
    return step, [t for t in comparison.tensors if t.step == step]


def _optimizer_location(comparison: CompareResult, case: Case) -> dict[str, Any] | None:
    """The gradients of the first failing step match and a parameter does not: the update."""
    first = _first_failing_step(comparison)
    if first is None:
        return None
    step, compared = first
    at_step = [t for t in compared if not t.passed]
    if any(t.kind not in ("param", "optim") for t in at_step):
        return None
    grads = [t for t in compared if t.kind == "grad"]
    if not grads or not all(t.passed for t in grads):
        return None
    worst = max((t for t in at_step if t.kind == "param"), key=lambda t: t.max_rel, default=at_step[0])
    factory = case.optimizer_factory
    optimizer = getattr(getattr(factory, "func", factory), "__name__", type(factory).__name__)
    return {"phase": "optimizer", "module": worst.name, "module_type": None, "op": f"{optimizer}.step",
            "rank": None, "step": step, "max_abs": worst.max_abs, "max_rel": worst.max_rel,
            "tolerance": {"rtol": worst.tolerance.rtol, "atol": worst.tolerance.atol, "of": "each element"},
            "compared": f"every gradient of step {step} matches; {len([t for t in at_step if t.kind == 'param'])} "
                        "parameters after the update do not"}


def _backward_location(comparison: CompareResult) -> dict[str, Any] | None:
    """The first failing step's loss matches and only some of its gradients do not: the first
    failing one in backward order (the record's parameter order reversed: the last module's
    gradients are computed first, and a wrong backward in one module spoils its own gradients
    and those of every module before it). Every gradient off (a scale or sync bug after the
    backward) is no local departure: no location."""
    first_step = _first_failing_step(comparison)
    if first_step is None:
        return None
    step, at_step = first_step
    if any(t.kind == "loss" and not t.passed for t in at_step):
        return None
    grads = [t for t in at_step if t.kind == "grad"]
    failing = [t for t in grads if not t.passed]
    if not failing or len(failing) == len(grads):
        return None
    first = failing[-1]
    return {"phase": "backward", "module": first.name.rsplit(".", 1)[0] if "." in first.name else first.name,
            "module_type": None, "op": None, "rank": None, "step": step, "max_abs": first.max_abs, "max_rel": first.max_rel,
            "tolerance": {"rtol": first.tolerance.rtol, "atol": first.tolerance.atol, "of": "each element"},
            "compared": f"the gathered gradient of {first.name!r}, the first of {len(failing)} of {len(grads)} failing "
                        "gradients in backward order"}


def first_divergence_location(comparison: CompareResult | None, probe: ProbeData | None, case: Case | None) -> dict[str, Any] | None:
    """Where a failed run departs (module docstring), or None: a passed run, or no evidence."""
    if comparison is None or comparison.passed or case is None:
        return None
    if probe is not None:
        found = _forward_location(probe, case)
        if found is not None:
            found["line"] = location_line(found)
            return found
    found = _optimizer_location(comparison, case) or _backward_location(comparison)
    if found is not None:
        found["line"] = location_line(found)
    return found


def location_line(loc: dict[str, Any]) -> str:
    """One sentence for the terminal."""
    if loc["phase"] == "optimizer":
        return (f"departs in the optimizer step of step {loc['step']} ({loc['op']}): {loc['compared']}; first "
                f"{loc['module']!r} (max abs {loc['max_abs']:.3g})")
    if loc["phase"] == "backward":
        return (f"departs in the gradients of step {loc['step']} at module {loc['module']!r}: {loc['compared']} "
                f"(max abs {loc['max_abs']:.3g}); the loss and the gradients of the modules after it match")
    tol = loc["tolerance"]
    if loc.get("consumed_by"):
        return (f"departs in the forward of step 0 at module {loc['module']!r} ({loc['module_type']}) on rank {loc['rank']}: "
                f"its output is a partial sum over the tensor-parallel group {loc['partial_over']} (the reference's only "
                f"summed), used unreduced - {loc['consumed_by']!r} departs next, by max abs {loc['max_abs']:.3g} "
                f"({loc['max_rel']:.3g} of its largest value; allowed rtol {tol['rtol']:.3g}, atol {tol['atol']:.3g} of it)")
    return (f"departs in the forward of step 0 at module {loc['module']!r} ({loc['module_type']}) on rank {loc['rank']}: "
            f"max abs {loc['max_abs']:.3g} ({loc['max_rel']:.3g} of the output's largest value; allowed rtol {tol['rtol']:.3g}, "
            f"atol {tol['atol']:.3g} of it), compared with the reference's {loc['compared']}")
