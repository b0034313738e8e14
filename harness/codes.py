"""The diagnosis codes (the product's contract, see README) and the finding type every check
returns. Checks in :mod:`harness.tracing` and the engine in :mod:`harness.analysis.diagnose` speak
:class:`Diagnosis`; reports render them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

__all__ = ["CODES", "Diagnosis", "UnknownCodeError", "Verdict", "jsonable", "verdict_for"]

# code -> one-line meaning. Stable strings: never rename one, only add.
CODES: dict[str, str] = {
    "duplicate-samples": "two data-parallel replicas consumed the same sample in one epoch",
    "dropped-samples": "samples that should have been consumed in the epoch were not",
    "batch-size-mismatch": "an optimizer step consumed another number of samples than the case's global batch (the loop's accumulation or batch size differs from the case's)",
    "inconsistent-replica-inputs": "ranks that must see the same batch (one TP group, one pipeline) saw different ones",
    "grad-double-averaged": "gradients are reference / world size: averaged twice",
    "grad-not-averaged": "gradients are reference x N: summed, never averaged",
    "grad-scaled": "gradients off by another constant factor (accumulation steps, micro-batches)",
    "missing-grad-sync": "some parameters' gradients were never synchronized across replicas (or, for parameters TP keeps replicated, over the TP group)",
    "replica-divergence": "parameters (or gradients) that should be identical on replicas, or on the TP ranks of one replica, differ",
    "missing-shard-contribution": "part of a sharded tensor never reached the loss or the reduction",
    "tp-partial-sum": "a row-parallel output was used without its all-reduce",
    "rng-desync": "dropout / random masks differ where they must match (or match where they must differ)",
    "swapped-mesh-dims": "process groups were built along the wrong mesh dimension",
    "pp-stage-coverage": "a layer is missing from, or duplicated across, pipeline stages",
    "pp-loss-scaling": "pipeline loss not (or twice) divided by the number of micro-batches",
    "collective-mismatch": "ranks of one group issued different collectives at the same position",
    "collective-missing": "a rank never issued a collective its group waits in (hang)",
    "shard-layout": "a gathered tensor's shape or element order differs from the reference",
    "state-structure": "missing / extra / renamed state-dict or optimizer-state entries",
    "per-replica-statistic": "the run computes a batch statistic per data-parallel replica (BatchNorm, router loss, per-replica normaliser): it matches the per-replica reference, not one device's",
    "numeric-mismatch": "a mismatch above tolerance that matches no pattern above",
    "nondeterministic-run": "two runs of the same target on fresh ranks (same layout, threads, seeds) differ bitwise: the first step, rank and tensor are named with the pins",
    "resume-state-missing": "after loading a checkpoint, parameters or optimizer state that were saved are absent (the optimizer or a module not loaded)",
    "resume-step-reset": "after loading a checkpoint, the optimizer's step counters are below the saved ones (bias correction starts over)",
    "resume-scheduler-not-restored": "after loading a checkpoint, the lr scheduler's state differs from the saved one (its epoch or lr back at the start)",
    "resume-rng-not-restored": "after loading a checkpoint, a rank's RNG state differs from the one it saved (its first resumed draw differs)",
    "resume-data-position-lost": "the first resumed step re-uses samples the run consumed before the checkpoint (the data position was not restored)",
    "resume-chunks-permuted": "a loaded tensor equals the saved one up to a permutation of its shard chunks (resharded in the wrong order)",
    "resume-value-differs": "a loaded tensor or hyperparameter differs from the saved one otherwise",
    "resume-continuation-departs": "the load was exact but the resumed run departs from the uninterrupted one (bitwise on the same layout, beyond the stepwise tolerance on another)",
}


class UnknownCodeError(ValueError):
    pass


@dataclass
class Diagnosis:
    """One named cause with its evidence.

    ``summary`` is one human sentence ("sample 1003 consumed by ranks 0 and 1 at step 0");
    ``evidence`` is JSON-serializable detail (ids, ranks, steps, factors, call sites) that the
    JSON and HTML reports show as is."""

    code: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise UnknownCodeError(f"unknown diagnosis code {self.code!r}; allowed: {', '.join(CODES)}")

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "summary": self.summary, "evidence": self.evidence}


@dataclass
class Verdict:
    """The overall outcome: ``verdict`` is "pass", "fail", "hang" or "error"."""

    verdict: str
    diagnoses: list[Diagnosis] = field(default_factory=list)
    error: str = ""

    @property
    def codes(self) -> list[str]:
        return [d.code for d in self.diagnoses]

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "diagnoses": [d.to_dict() for d in self.diagnoses], "error": self.error}


def verdict_for(diagnoses: Sequence[Diagnosis], *, passed: bool, hang: bool = False, error: str = "") -> Verdict:
    """A hang is a hang whatever else was found; an error with no finding is the harness's or the
    user's error, not a diagnosis; findings fail a run that otherwise matched."""
    if hang:
        return Verdict("hang", list(diagnoses), error)
    if error and not diagnoses:
        return Verdict("error", [], error)
    if passed and not diagnoses:
        return Verdict("pass", [])
    return Verdict("fail", list(diagnoses), error)


def jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it (evidence, comparison results, reports): dict keys as
    strings, tuples and sets as lists, non-finite floats as strings, anything else by repr."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)
