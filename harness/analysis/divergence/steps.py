"""Where a failing run departs, from the records of its steps alone: the first failing step,
its samples against the reference's, and an optimizer step that departs while the gradients
match (see :mod:`harness.analysis.divergence`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from reference.case import Case

from harness.analysis.compare import CompareResult, TensorComparison

__all__ = ["first_failing_step", "optimizer_location", "optimizer_step_name", "samples_location"]


def first_failing_step(comparison: CompareResult) -> tuple[int, list[TensorComparison]] | None:
    """The first step with a tensor beyond tolerance and every comparison of that step."""
    failures = comparison.failures()
    if not failures:
        return None
    step = min(t.step for t in failures)
    return step, [t for t in comparison.tensors if t.step == step]


def samples_location(comparison: CompareResult, actual: Any, reference: Any) -> dict[str, Any] | None:
    """The first failing step's global batch - the samples its data-parallel replicas consumed,
    one replica's ranks counted once - is another multiset of sample ids than the reference's
    step of that number: the step departs before the model, in what it read (a sampler never
    told the epoch, one that repeats or drops samples). The ids the replicas reported (run.loss,
    the strategies' batches) against the reference's; where they are exactly another step's
    batch of the reference, that step is named. Ranks of one replica that read different
    samples are the forward's evidence (each rank's own batch is replayed), not this one."""
    first = first_failing_step(comparison)
    if first is None or actual is None or reference is None:
        return None
    step = first[0]
    wanted = {s.step: list(s.sample_ids) for s in getattr(reference, "steps", [])}
    if not wanted.get(step):
        return None
    try:
        held = actual.step(step)
    except Exception:  # noqa: BLE001 - a record without that step: nothing to compare
        return None
    replica = {int(r["rank"]): int(r.get("dp_rank", r["rank"])) for r in actual.meta.get("ranks", []) or []}
    by_replica: dict[int, list[int]] = {}
    for rank, micro in sorted(held.rank_sample_ids.items()):
        ids = [int(i) for m in micro for i in m]
        if not ids:
            continue  # a rank that consumed nothing itself (a pipeline stage without the data)
        rep = replica.get(int(rank), int(rank))
        if rep in by_replica and sorted(by_replica[rep]) != sorted(ids):
            return None
        by_replica.setdefault(rep, ids)
    if not by_replica:
        return None
    got = Counter(i for ids in by_replica.values() for i in ids)
    want = Counter(wanted[step])
    if got == want:
        return None
    missing, extra = sorted((want - got).elements()), sorted((got - want).elements())
    same_as = next((s for s, ids in sorted(wanted.items()) if s != step and Counter(ids) == got), None)
    show = lambda ids: f"{ids[:6]}{'...' if len(ids) > 6 else ''}"  # noqa: E731
    compared = (f"step {step}'s {sum(got.values())} samples over {len(by_replica)} replicas against the reference's "
                f"{sum(want.values())}: {len(missing)} of the reference's missing {show(missing)}, {len(extra)} not in "
                f"its step {show(extra)}")
    found = {"phase": "input", "module": "<data>", "module_type": None, "op": None, "rank": None, "step": step,
             "max_abs": float(len(missing) + len(extra)), "max_rel": (len(missing) + len(extra)) / max(1, 2 * sum(want.values())),
             "tolerance": {"rtol": 0.0, "atol": 0.0, "of": "sample ids, exactly"}, "compared": compared,
             "samples": {"missing": missing[:32], "extra": extra[:32]}}
    if same_as is not None:
        found["same_as_reference_step"] = same_as
    return found


def optimizer_step_name(case: Case | None) -> str:
    """'AdamW.step': the case's optimizer's step, as a location's op names it."""
    factory = getattr(case, "optimizer_factory", None)
    if factory is None:
        return "optimizer.step"
    return f"{getattr(getattr(factory, 'func', factory), '__name__', type(factory).__name__)}.step"


def optimizer_location(comparison: CompareResult, case: Case) -> dict[str, Any] | None:
    """The gradients of the first failing step match and a parameter does not: the update."""
    first = first_failing_step(comparison)
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
    return {"phase": "optimizer", "module": worst.name, "module_type": None, "op": optimizer_step_name(case),
            "rank": None, "step": step, "max_abs": worst.max_abs, "max_rel": worst.max_rel,
            "tolerance": {"rtol": worst.tolerance.rtol, "atol": worst.tolerance.atol, "of": "each element"},
            "compared": f"every gradient of step {step} matches; {len([t for t in at_step if t.kind == 'param'])} "
                        "parameters after the update do not"}
