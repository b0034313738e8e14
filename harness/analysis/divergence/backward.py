"""Where a failing run departs in the backward: the probed backward's module-output gradients
and the autograd node between the last that matched and the first that did not, else the first
failing gathered gradient in backward order (see :mod:`harness.analysis.divergence`)."""

from __future__ import annotations

from typing import Any

import torch

from reference.case import Case

from harness.analysis.compare import CompareResult
from harness.analysis.divergence.steps import first_failing_step
from harness.analysis.divergence.values import (Judged, aligned, corresponding, group_sum, judge, peer_sum,
                                                placement_kind, same_on_every_rank, tolerance, tp_of)
from harness.analysis.probe_checks import reference_backward, reference_grads
from harness.record.probe import GRAD_MARKER, OUTPUT, OpCapture, ProbeData

__all__ = ["activation_backward_location", "gathered_backward_location"]


def activation_backward_location(comparison: CompareResult, probe: ProbeData | None, case: Case) -> dict[str, Any] | None:
    """Step 0's loss matches and some of its gradients do not: the probed micro-batch's
    backward on each rank against the reference's on the same inputs and targets, by the
    gradients of the module outputs in the order they arrived (the model's output first). A
    rank's loss weight (1/N, 1/micro-batches, a token share) scales all of them alike, so the
    scale is fitted where the backward starts (the first gradient compared, the model's
    output's) and every later one is compared with the reference's times that scale, by its
    placement as the forward's outputs are. The first that departs is where the backward left
    the reference: in the backward of what consumed that output, between the last gradient
    that matched and it. A gradient of a whole (replicated) activation that matches only summed
    over the tensor-parallel group is a partial sum no all-reduce completed: every backward is
    linear in its incoming gradient, so it stays partial upstream and never "departs" by
    itself; the first such gradient is the location. A scale or sync bug after the backward
    leaves every activation gradient right: no location from here."""
    first_step = first_failing_step(comparison)
    if probe is None or first_step is None or first_step[0] != probe.step:
        return None
    step, at_step = first_step
    if any(t.kind == "loss" and not t.passed for t in at_step) or not any(t.kind == "grad" and not t.passed for t in at_step):
        return None
    rtol, atol = tolerance(case.dtype)
    by_rank = {r["rank"]: r for r in probe.ranks}
    if probe.step > 0 and any(c.p for r in probe.ranks for c in r["captures"].values()):
        return None  # a later step's backward goes through masks the replay cannot draw alike
    first: dict[str, Any] | None = None
    for rank, entry in sorted(by_rank.items()):
        order = entry.get("grad_order") or []
        if not order or entry["input"] is None or entry["stages"] not in (None, [0]):
            continue
        ref = reference_grads(probe, rank, case)
        if not ref:
            continue
        coord, group = tp_of(entry)
        scale: float | None = None
        last_within: str | None = None
        for position, name in enumerate(order):
            cap = entry["captures"].get(name)
            if name not in ref or cap is None or cap.grad is None:
                continue

            def grads_summed(name: str = name, cap: Any = cap) -> torch.Tensor | None:
                return group_sum(by_rank, group, name, cap.grad.shape, "grad")

            if scale is None:
                pieces = corresponding(cap.grad, cap.grad_placements, ref[name], coord, group, grads_summed)
                if pieces is None:
                    continue
                held, expected = pieces[0].double(), pieces[1].double()
                norm = float((expected * expected).sum())
                if norm == 0.0:
                    break  # no gradient reaches this rank's output (it computes no loss)
                scale = float((held * expected).sum()) / norm
            judged = judge(cap.grad, cap.grad_placements, ref[name] * scale, coord, group, grads_summed, rtol, atol)
            if judged is None:
                continue
            declared_partial = placement_kind(cap.grad_placements)[0] == "partial"
            if judged.status == "partial" and not declared_partial and same_on_every_rank(cap.grad, grads_summed(), group, rtol, atol):
                # Every rank holds the same 1/N of the reference's: not a split awaiting its
                # all-reduce but a value scaled where it should not be (averaged, not summed).
                judged = Judged("departs", judged.max_abs, judged.max_rel, f"whole (every rank of {group} holds 1/{len(group)} of it)")
            if judged.status == "within" or (judged.status == "partial" and declared_partial):
                # The model's output is often its last module's output too (one tensor, two
                # names): the module names where the backward is.
                last_within = name if name != OUTPUT or last_within is None else last_within
                continue
            if first is not None and position >= first["position"]:
                break
            # None: the very first gradient compared is not the reference's up to a scale - the
            # loss's own backward departs.
            after = "<loss>" if last_within is None else "<model output>" if last_within == OUTPUT else last_within
            found = {"phase": "backward", "module": after, "module_type": None, "op": None, "rank": rank, "step": probe.step,
                     "grad_of": "<model output>" if name == OUTPUT else name, "max_abs": judged.max_abs,
                     "max_rel": judged.max_rel, "tolerance": {"rtol": rtol, "atol": atol, "of": "max |reference gradient|"},
                     "compared": f"{judged.compared}, against the reference's times {scale:.6g} (this rank's loss weight, "
                                 "fitted where its backward starts)",
                     "loss_scale": scale, "position": position, "activation": True}
            held_module = entry["captures"].get(after)
            if held_module is not None:
                found["module_type"] = held_module.module_type
            if judged.status == "partial":
                found["partial_over"] = group
            try:
                node = _backward_op(probe, case, rank, last_within, name, partial=judged.status == "partial",
                                    scale=scale, rtol=rtol, atol=atol)
                if "max_abs" in node:
                    found["module_max_abs"] = found["max_abs"]
                found.update(node)
            except Exception as exc:  # noqa: BLE001 - the stretch of modules is evidence enough without its node
                found["op_note"] = f"the node of the backward was not located: {type(exc).__name__}: {exc}"
            first = found
            break
    if first is None:
        return None
    first.pop("position")
    return first


def _stretch(events: list[OpCapture], after: str | None, until: str) -> list[OpCapture] | None:
    """The nodes of a backward log between the arrival of ``after``'s output gradient (None:
    the start) and ``until``'s; None where a marker is missing."""
    marks = {e.module: i for i, e in reversed(list(enumerate(events))) if e.op == GRAD_MARKER}
    if until not in marks or (after is not None and after not in marks):
        return None
    start = marks[after] + 1 if after is not None else 0
    return [e for e in events[start:marks[until]] if e.op != GRAD_MARKER]


def _backward_op(probe: ProbeData, case: Case, rank: int, after: str | None, until: str, *, partial: bool, scale: float,
                 rtol: float, atol: float) -> dict[str, Any]:
    """The autograd node where the backward departs, between the gradients of ``after``'s and
    ``until``'s outputs: the rank's nodes there (:class:`harness.record.probe.BackwardLog`)
    aligned with the reference's by name as the forward's ops are, each node's gradient along
    the activation path compared with the reference's times ``scale``, by its placement. For a
    departure, the first node beyond the rule; for a partial sum, the node where the gradient
    first matches only summed over the group, and the last node of the stretch, which passed
    it on unreduced."""
    by_rank = {r["rank"]: r for r in probe.ranks}
    entry = by_rank[rank]
    held = _stretch(entry.get("backward_ops") or [], after, until)
    ref = _stretch(reference_backward(probe, rank, case), after, until)
    if not held or ref is None:
        return {"op_note": "no backward node log of this stretch"}
    coord, group = tp_of(entry)
    peers_sum = peer_sum(by_rank, group, "backward_ops", entry.get("backward_ops") or [])

    rows: list[dict[str, Any]] = []
    partial_at: OpCapture | None = None
    for mine, theirs, how in aligned(held, ref):
        judged = judge(mine.output, mine.placements, theirs.output * scale, coord, group, lambda: peers_sum(mine), rtol, atol)
        if judged is None:
            continue
        if judged.status == "partial" and placement_kind(mine.placements)[0] != "partial" and \
                same_on_every_rank(mine.output, peers_sum(mine), group, rtol, atol):
            judged = Judged("departs", judged.max_abs, judged.max_rel, f"whole (every rank of {group} holds 1/{len(group)} of it)")
        rows.append({"op": mine.op, "module": f"backward after {after or 'the loss'}", "reference_op": theirs.op,
                     "status": judged.status, "max_abs": judged.max_abs, "compared": judged.compared, "aligned": how})
        if judged.status == "departs" and not partial:
            return {"op": mine.op, "op_module": until, "op_placements": mine.placements, "ops_compared": len(rows),
                    "op_rows": rows[-12:], "max_abs": judged.max_abs, "max_rel": judged.max_rel,
                    "compared": f"{judged.compared}, against the reference's {theirs.op} times {scale:.6g}; node aligned {how}"}
        if judged.status == "partial" and partial and partial_at is None and placement_kind(mine.placements)[0] != "partial":
            partial_at = mine
    if partial and partial_at is not None:
        last = held[-1]
        return {"op": last.op, "op_module": until, "op_placements": last.placements, "ops_compared": len(rows),
                "op_rows": rows[-12:], "partial_from": partial_at.op,
                "passed_unreduced": [o.op for o in held[held.index(partial_at) + 1:]]}
    paired = {id(mine) for mine, _, _ in aligned(held, ref)}
    if not partial and id(held[-1]) not in paired:
        # Every node aligned with the reference's matches (or is a partial sum on its way), and
        # the stretch's gradient departs: the node that produced it, one the reference has no
        # counterpart of (a hand-written Function's backward), is where.
        return {"op": held[-1].op, "op_module": until, "op_placements": held[-1].placements, "ops_compared": len(rows),
                "op_rows": rows[-12:], "unpaired": True}
    return {"op_note": f"no single node of the backward between {after or 'the loss'!r} and {until!r} departs by itself "
                       f"({len(rows)} compared)"}


def gathered_backward_location(comparison: CompareResult) -> dict[str, Any] | None:
    """The first failing step's loss matches and only some of its gradients do not: the first
    failing one in backward order (the record's parameter order reversed: the last module's
    gradients are computed first, and a wrong backward in one module spoils its own gradients
    and those of every module before it). Every gradient off (a scale or sync bug after the
    backward) is no local departure: no location."""
    first_step = first_failing_step(comparison)
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
