"""Only the reported loss differs: a reading of the loop's numbers, not a training bug.

The loss a loop hands ``run.loss`` is what it *says* of a micro-batch; what it trains on is its
gradients and, through them, its parameters and optimizer state. When every one of those
matches the reference at every step and only the reported loss does not, the training is the
reference's and the difference is in how the reported numbers are read: what each one is a mean
over (``normaliser=``), or a value that is already a share of the step (what a loop normalising
by the step's global token count backpropagates). The harness combines each rank's pieces by
the weight it was given (``normaliser=``, else the case's ``loss_normaliser`` of the samples,
else their number); :func:`read_reported_loss` recomputes the step's loss under the other usual
readings from the same pieces, says which one gives the reference's loss, and the glue that
states it. The run then passes, with that said.

A loss comparison is excused only with that evidence: no structure or sample difference, and
at every step whose loss departs, gradients and parameters compared and all within tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ReportedLoss", "read_reported_loss"]

_READINGS = {
    "given": "as the harness reads them (each a mean over the normaliser it was given)",
    "samples": "as means over their samples",
    "units": "as means over the case's loss_normaliser of their samples (e.g. their valid tokens)",
    "shares": "as shares of the step's loss, summed (each already divided by the step's count)",
    "equal": "averaged with equal weights",
}

_GLUE = {
    "samples": "the loop's loss is a mean over its samples: say so with run.loss(step, loss, ids, normaliser=len(ids))",
    "units": "the loop's loss is a mean over the case's loss_normaliser of its samples (e.g. its valid tokens): call "
             "run.loss(step, loss, ids) without normaliser=, or pass normaliser= that count",
    "shares": "the loop reports what it backpropagates, its share of the step: report the micro-batch's own mean "
              "instead (its sum over its own count), or pass normaliser= what the reported number is a mean over",
    "equal": "the loop's pieces are weighted equally: pass the same normaliser= for every micro-batch (e.g. 1)",
}


@dataclass
class ReportedLoss:
    """What :func:`read_reported_loss` found: per departing step the reference's loss and the
    step's loss under each reading; ``matching``: the readings that give the reference's loss
    at every such step (within the loss's tolerance)."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    matching: list[str] = field(default_factory=list)

    def sentence(self) -> str:
        first = self.steps[0]
        head = (f"only the reported loss differs: every gradient and parameter matches the reference at every step, so "
                f"the training itself passed. At step {first['step']} the reference's loss is {first['reference']:.6g}; the "
                f"loop's reported numbers give {first['readings']['given']:.6g} {_READINGS['given']}")
        if self.matching:
            best = self.matching[0]
            return (f"{head}, and {first['readings'][best]:.6g} {_READINGS[best]}: the reference's, at every step. "
                    f"{_GLUE[best][0].upper()}{_GLUE[best][1:]}.")
        others = "; ".join(f"{first['readings'][k]:.6g} {_READINGS[k]}" for k in first["readings"] if k != "given")
        return (f"{head}; no other usual reading gives the reference's loss ({others}): the number the loop reports is not "
                "the loss it trains on; pass run.loss the micro-batch's unweighted mean as CASE.loss_fn returns it")

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "matching": self.matching, "readings": {k: _READINGS[k] for k in self.steps[0]["readings"]},
                "glue": _GLUE.get(self.matching[0], "") if self.matching else ""}


def loss_only(result: Any) -> bool:
    """Whether ``result`` (a :class:`~harness.analysis.compare.CompareResult`) departs in its
    reported losses alone, with gradients and parameters compared and matching at each step
    whose loss departs."""
    failing = [t for t in result.tensors if not t.passed]
    if result.structure or result.samples or not failing or any(t.kind != "loss" for t in failing):
        return False
    compared = {(t.step, t.kind) for t in result.tensors}
    return all((t.step, "grad") in compared and (t.step, "param") in compared for t in failing)


def read_reported_loss(result: Any, record: Any, reference: Any, case: Any) -> ReportedLoss | None:
    """The readings of a run whose reported losses alone depart (None otherwise, or where the
    record has no pieces to read: a record of another version, a case whose loss is a sum)."""
    if not loss_only(result) or getattr(case, "loss_reduction", "mean") != "mean":
        return None
    out = ReportedLoss()
    departing = sorted({t.step for t in result.tensors if not t.passed})
    tolerances = {t.step: t.tolerance for t in result.tensors if t.kind == "loss" and t.name == "loss"}
    for step in departing:
        pieces = [p for ranks in record.step(step).extra.get("loss_pieces", {}).values() for p in ranks]
        expected = reference.step(step).loss
        if not pieces or expected is None:
            return None
        readings = {"given": _combine([(loss, weight) for loss, _, weight in pieces]),
                    "samples": _combine([(loss, len(ids)) for loss, ids, _ in pieces])}
        if case.loss_normaliser is not None:
            try:
                readings["units"] = _combine([(loss, case.normaliser(case.collate_ids(ids, step=step))) for loss, ids, _ in pieces])
            except Exception:  # noqa: BLE001 - ids the dataset cannot collate: that reading is not offered
                pass
        readings["shares"] = float(sum(loss for loss, _, _ in pieces))
        readings["equal"] = _combine([(loss, 1.0) for loss, _, _ in pieces])
        tol = tolerances.get(step)
        allowed = {k: tol is not None and abs(v - expected) <= tol.atol + tol.rtol * abs(expected) for k, v in readings.items()}
        out.steps.append({"step": step, "reference": expected, "readings": readings, "match": allowed})
    out.matching = [k for k in out.steps[0]["readings"] if k != "given" and all(s["match"].get(k) for s in out.steps)]
    return out


def _combine(pieces: list[tuple[float, float]]) -> float:
    total = sum(w for _, w in pieces)
    return float(sum(loss * w for loss, w in pieces) / total) if total else float("nan")
