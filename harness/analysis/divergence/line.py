"""Where a run departs, as the one sentence the terminal prints."""

from __future__ import annotations

from typing import Any

__all__ = ["location_line"]


def location_line(loc: dict[str, Any]) -> str:
    """One sentence for the terminal, ending on the user's line that ran the op where known."""
    line = _sentence(loc)
    if loc.get("site"):
        from harness.tracing.random_ops import hooks_short

        line += f" - at {hooks_short(loc['site'])}"
    return line


def _sentence(loc: dict[str, Any]) -> str:
    if loc["phase"] == "optimizer":
        on = f" on rank {loc['rank']}" if loc.get("rank") is not None else ""
        return (f"departs in the optimizer step of step {loc['step']}{on} ({loc['op']}): {loc['compared']}; first "
                f"{loc['module']!r} (max abs {loc['max_abs']:.3g})")
    if loc["phase"] == "input" and loc["module"] == "<data>":
        again = ""
        if loc.get("same_as_reference_step") is not None:
            again = (f"; they are exactly the reference's step {loc['same_as_reference_step']} batch (an epoch order "
                     "repeated: is the sampler's set_epoch called?)" if loc["same_as_reference_step"] < loc["step"] else
                     f"; they are exactly the reference's step {loc['same_as_reference_step']} batch")
        return f"departs before the model, in the samples it read, at step {loc['step']}: {loc['compared']}{again}"
    if loc["phase"] == "input":
        return (f"departs before the model, in its input, at step {loc['step']} on rank {loc['rank']}: {loc['compared']} differ by "
                f"max abs {loc['max_abs']:.3g} (an augmentation, noise or cast applied to the batch)")
    if loc["phase"] == "loss":
        where = "in the loss computation after the model's forward" if loc.get("model_output_compared") else \
            f"between {loc['module'].removeprefix('after ')!r} and the loss (the model's output itself could not be compared)"
        line = f"departs {where} at step {loc['step']} on rank {loc['rank']}: {loc['compared']}"
        if loc.get("op") and "op_max_abs" in loc:
            line += (f"; the first op of the loss beyond the rule: {loc['op']} (max abs {loc['op_max_abs']:.3g}, "
                     f"{loc['op_max_rel']:.3g} of its largest value; compared with the reference's {loc['op_compared']})")
            if loc.get("last_matched"):
                line += f"; the last op that matched before it: {loc['last_matched']['op']}"
            if loc.get("unpaired_before"):
                line += (f"; computed between them, with no counterpart in the reference's loss: "
                         f"{', '.join(loc['unpaired_before'])}")
        elif loc.get("op") and loc.get("unpaired"):
            line += (f"; every op of the loss compared matches the reference's up to {loc['last_matched']['op']}, after "
                     f"which the rank computes what the reference's loss has not: {', '.join(loc['unpaired_after'])}")
        elif loc.get("op"):
            line += f"; the values change at {loc['op']}" + (f" ({loc['op_note']})" if loc.get("op_note") else "")
        return line
    if loc["phase"] == "backward" and loc.get("activation"):
        if loc["module"] == "<loss>":
            return (f"departs in the backward of step {loc['step']} on rank {loc['rank']}, in the loss's own backward: the gradient "
                    f"of {loc['grad_of']!r}'s output is not the reference's up to a scale (max abs {loc['max_abs']:.3g}), "
                    f"compared with the reference's {loc['compared']}")
        after = "the model's output" if loc["module"] == "<model output>" else repr(loc["module"])
        what = (f"is a partial sum over the tensor-parallel group {loc['partial_over']} (the reference's only summed): "
                "an all-reduce of the backward is missing there" if loc.get("partial_over") else
                f"departs by max abs {loc['max_abs']:.3g} ({loc['max_rel']:.3g} of its largest value; allowed rtol "
                f"{loc['tolerance']['rtol']:.3g}, atol {loc['tolerance']['atol']:.3g} of it)")
        node = ""
        if loc.get("op") and loc.get("partial_from"):
            through = f", then through {', '.join(loc['passed_unreduced'])}" if loc.get("passed_unreduced") else ""
            node = f"; the gradient is a partial sum from node {loc['partial_from']} on{through}: {loc['op']} passes it on unreduced"
        elif loc.get("op") and loc.get("unpaired"):
            node = (f"; every node aligned with the reference's matches, and {loc['op']} (the reference has no such node) "
                    "produced the departing gradient")
        elif loc.get("op"):
            node = f"; the first node beyond the rule: {loc['op']}"
        elif loc.get("op_note"):
            node = f" ({loc['op_note']})"
        return (f"departs in the backward of step {loc['step']} on rank {loc['rank']}, after the gradient of {after}'s output (it "
                f"matches): the gradient of {loc['grad_of']!r}'s output {what}, compared with the reference's "
                f"{loc['compared']}{node}")
    if loc["phase"] == "backward":
        return (f"departs in the gradients of step {loc['step']} at module {loc['module']!r}: {loc['compared']} "
                f"(max abs {loc['max_abs']:.3g}); the loss and the gradients of the modules after it match")
    if loc.get("stage_input"):
        return (f"departs between pipeline stages at step {loc['step']}, before any module of {loc['module'][10:-1]} on "
                f"rank {loc['rank']}: {loc['compared']} differ by max abs {loc['max_abs']:.3g} ({loc['max_rel']:.3g} of its "
                "largest value) - the send, the receive, or a cast or buffer between them")
    if loc.get("eval_mode"):
        skipped = f": the reference's {loc['op']} never ran" if loc.get("op") else ""
        return (f"departs in the forward of step {loc['step']} at module {loc['module']!r} ({loc['module_type']}) on rank "
                f"{loc['rank']}: it ran in eval mode (no mask drawn{skipped}) where the reference trains it - a model.eval() "
                "not undone by model.train()?")
    tol = loc["tolerance"]
    at = f"module {loc['module']!r} ({loc['module_type']})"
    if loc.get("op"):
        inner = "" if loc.get("op_module") in (None, loc["module"]) else f" (in {loc['op_module']!r})"
        at = f"op {loc['op']}{inner} of {at}"
        if loc.get("inline_before"):
            at += f", inline in its forward before its submodule {loc['inline_before']!r}"
    if loc.get("unpaired") and loc.get("last_matched"):
        return (f"departs in the forward of step {loc['step']} at {at} on rank {loc['rank']}: an op the reference's forward "
                f"has no counterpart of, and it changes the value the last matching op before it "
                f"({loc['last_matched']['op']}) left - max abs {loc['max_abs']:.3g} ({loc['max_rel']:.3g} of its largest "
                f"value; allowed rtol {tol['rtol']:.3g}, atol {tol['atol']:.3g} of it) against the reference's value there, "
                f"{loc['compared']}")
    if loc.get("consumed_by"):
        return (f"departs in the forward of step {loc['step']} at {at} on rank {loc['rank']}: "
                f"its output is a partial sum over the tensor-parallel group {loc['partial_over']} (the reference's only "
                f"summed), used unreduced - {loc['consumed_by']!r} departs next, by max abs {loc['max_abs']:.3g} "
                f"({loc['max_rel']:.3g} of its largest value; allowed rtol {tol['rtol']:.3g}, atol {tol['atol']:.3g} of it)")
    line = (f"departs in the forward of step {loc['step']} at {at} on rank {loc['rank']}: "
            f"max abs {loc['max_abs']:.3g} ({loc['max_rel']:.3g} of the output's largest value; allowed rtol {tol['rtol']:.3g}, "
            f"atol {tol['atol']:.3g} of it), compared with the reference's {loc['compared']}")
    if loc.get("after_partial"):
        p = loc["after_partial"]
        line += (f"; its input, {p['op']} in {p['module']!r}, is a partial sum over the tensor-parallel group {p['over']} "
                 "that was never reduced before it")
    if loc.get("after_collective"):
        c = loc["after_collective"]
        line += f"; the collective before it: {c['op']} in {c['module']!r}"
    if loc.get("inline_unpaired"):
        line += (f"; before it, the rank's forward computed inline what the reference's has not: "
                 f"{', '.join(loc['inline_unpaired'])}")
    return line + (f" ({loc['op_note']})" if loc.get("op_note") else "")
