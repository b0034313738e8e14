"""Where a failing run departs: the samples of the first failing step, when they are not the
reference's; else the first module whose forward output leaves the reference's (and the op
inside it); else the loss, when the forward matches and step 0's loss does not; else the
optimizer step when the gradients match and the update does not; else the first module output
whose gradient leaves the reference's in the probed backward (and the autograd node there);
else the first failing gradient in backward order when only some of a step's gradients fail.

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

from harness.analysis.compare import CompareResult
from harness.analysis.divergence.backward import activation_backward_location, gathered_backward_location
from harness.analysis.divergence.forward import forward_location, input_location, loss_location
from harness.analysis.divergence.line import location_line
from harness.analysis.divergence.steps import first_failing_step, optimizer_location, samples_location
from harness.record.probe import ProbeData

__all__ = ["first_divergence_location", "location_line", "reference_state", "step_to_probe"]


def step_to_probe(comparison: CompareResult | None, probe: ProbeData | None, actual: Any = None,
                  reference: Any = None) -> int | None:
    """The first failing step, where it is after step 0 and a probe of it could say where the
    run departs: its loss fails (the forward or the loss computes something else from weights
    that matched after the step before), its samples are the reference's (else they are the
    location) and step 0's probe holds the run's forward (a pipeline's later stages, or a run
    the probe never saw, would hold nothing at that step either). None otherwise."""
    if comparison is None or comparison.passed or probe is None:
        return None
    first = first_failing_step(comparison)
    if first is None or first[0] == 0:
        return None
    step, at_step = first
    if not any(t.kind == "loss" and not t.passed for t in at_step):
        return None
    if not any(r.get("captures") for r in probe.ranks) or samples_location(comparison, actual, reference) is not None:
        return None
    return step


def reference_state(reference: Any, step: int) -> dict[str, torch.Tensor] | None:
    """The reference's parameters at the start of ``step`` (its record's after the step
    before); None where the record holds none."""
    try:
        return {name: tensor for name, tensor in reference.iter_tensors(step - 1, "param")} or None
    except Exception:  # noqa: BLE001 - a record without that step: the later probe is not replayed
        return None


def first_divergence_location(comparison: CompareResult | None, probe: ProbeData | None, case: Case | None,
                              actual: Any = None, reference: Any = None) -> dict[str, Any] | None:
    """Where a failed run departs (module docstring), or None: a passed run, or no evidence.
    ``actual`` and ``reference`` (the run's and the reference's records) give each step's
    sample ids."""
    if comparison is None or comparison.passed or case is None:
        return None
    matched: list[str] = []
    found = samples_location(comparison, actual, reference)
    if found is not None:
        found["line"] = location_line(found)
        return found
    if probe is not None and probe.later is not None:
        # The first failing step came after step 0 and was probed on its own: its replay starts
        # from the reference's parameters after the step before.
        if probe.later.state is None and reference is not None:
            probe.later.state = reference_state(reference, probe.later.step)
        if probe.later.state is not None:
            probe = probe.later
    if probe is not None:
        found = input_location(probe, case)
        if found is not None:
            found["line"] = location_line(found)
            return found
        found = forward_location(probe, case, matched)
        if found is not None:
            found["line"] = location_line(found)
            return found
    found = (loss_location(comparison, probe, case, matched) or optimizer_location(comparison, case)
             or activation_backward_location(comparison, probe, case) or gathered_backward_location(comparison))
    if found is not None:
        found["line"] = location_line(found)
    return found
