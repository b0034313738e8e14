"""The diagnosis report as data: what every renderer (terminal, JSON, HTML, Chrome trace) reads.

JSON schema ``harness-diagnosis/1`` (stable; fields are only ever added)::

    {
      "schema": "harness-diagnosis/1",
      "verdict": "pass" | "fail" | "hang" | "error",
      "diagnoses": [{"code": str, "summary": str, "evidence": {...}}],   # codes: README table
      "error": str,                      # launcher report for "error" / "hang", else ""
      "target": {"name", "source", "case", "strategy", "nproc", "steps", "expected_code", "description"},
      "losses": {"reference": [float|null per step], "parallel": [...],
                 "reference_micro": [[...]], "parallel_micro": [[...]],
                 "stepwise": [...]},     # the reference's loss from the run's own state per step
      "comparison": ... "mode": "stepwise" | "trajectory", "trajectory": {"line", "per_step",
                     "first_divergence", "within_tolerance"} (secondary view, not the verdict)
      "comparison": {... CompareResult.to_dict(): "passed", "tensors": [{"step", "kind", "name",
                     "passed", "max_abs", "max_rel", "scale", "worst_index", ...}],
                     "first_divergence": {"step", "entries"} | null, "structure", "samples", ...} | null,
      "samples": {"reference": {"<step>": [ids]}, "ranks": {"<rank>": {"<step>": [[ids per micro-batch]]}}},
      "mesh": [{"rank", "dp_rank", "dp_size", "stages", "num_stages", "holds_loss", "mesh": {dim: coord}, "groups": {name: [ranks]}}],
      "collectives": {"events": {"<rank>": [{"seq", "op", "group", "group_ranks", "shapes", "dtypes",
                      "reduce_op", "peer", "call_site", "step", "start_us", "end_us"}]},
                      "summary": [{"step", "group", "op", "count", "bytes"}]} | null,
      "timing": {"elapsed_s": float, "phases": {"reference_s", "ranks_s", "calibration_s", "replay_s", "comparison_s", "trajectory_view_s", "diagnosis_s": float}},
      "recorded": {"records": [{"path", "complete", "steps"}], "trace_parts": [path],
                   "unfinished": [path]},  # a failed or hung run: what it left, and where
      "repeat": {"runs", "identical", "steps", "ranks", "compared": {what: int}, "first_difference":
                 {"what", "step", "rank", "kind", "name", "first", "second"} | null, "differences": int,
                 "pins": {...}, "pins_differ": [pin], "workdirs": [dir]} | {"runs", "skipped"} | {},  # --repeat N
      "resume": {"at", "into": {"target", "nproc"}, "saved_record", "resumed_record", "checkpoint", "same_layout",
                 "saved_world", "world", "load_exact", "passed", "compared": {what: int},
                 "gate": [{"code", "what", "name", "rank", "detail", "line"}], "not_transferable":
                 [{"state", "saved_world", "world", "why"}], "continuation": {"compared", "last_step",
                 "first_difference": {"step", "what", ...} | absent}, "lines": [str]} | {"at", "skipped"} | {},  # --resume-at K
      "ranks": [{"rank", "state", "op", "seq", "group", "group_ranks", "site", "last_completed"}]  # a hang or failure: where each rank was
    }
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.codes import Diagnosis, Verdict, jsonable, verdict_for

__all__ = ["SCHEMA", "DiagnosisReport", "build_report", "entry_name"]

SCHEMA = "harness-diagnosis/1"


def entry_name(kind: str, name: str) -> str:
    """A compared value as a sentence names it: "the loss", "micro-batch 1's loss", "grad fc1.weight"."""
    if kind == "loss":
        return "the loss" if name == "loss" else f"micro-batch {name.removeprefix('micro.')}'s loss"
    return f"{kind} {name}"


@dataclass
class DiagnosisReport:
    verdict: Verdict
    target: dict[str, Any]
    losses: dict[str, Any] = field(default_factory=dict)
    comparison: dict[str, Any] | None = None
    comparison_summary: str = ""
    samples: dict[str, Any] = field(default_factory=dict)
    mesh: list[dict[str, Any]] = field(default_factory=list)
    collectives: dict[str, Any] | None = None
    timing: dict[str, Any] = field(default_factory=dict)
    workdir: str = ""
    recorded: dict[str, Any] = field(default_factory=dict)  # what a failed run left on disk
    # The determinism gate (--repeat N): what the runs on fresh ranks were compared by, the
    # first difference, the pins (harness.analysis.determinism.RepeatComparison.to_dict).
    repeat: dict[str, Any] = field(default_factory=dict)
    # The resume check (--resume-at K): the load gate's differences, what could not be carried
    # to the resumed layout, the continuation (harness.analysis.resume.ResumeCheck.to_dict).
    resume: dict[str, Any] = field(default_factory=dict)
    # A hung or failed run: where each rank was when it was stopped (harness.launch.failure_text.rank_states).
    ranks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def diagnoses(self) -> list[Diagnosis]:
        return self.verdict.diagnoses

    @property
    def codes(self) -> list[str]:
        return self.verdict.codes

    @property
    def exit_code(self) -> int:
        """CLI exit status: 0 pass, 1 a diagnosis (or an error while running), 3 hang."""
        return {"pass": 0, "fail": 1, "hang": 3, "error": 1}[self.verdict.verdict]

    def to_json(self) -> dict[str, Any]:
        return jsonable(
            {
                "schema": SCHEMA,
                "verdict": self.verdict.verdict,
                "diagnoses": [d.to_dict() for d in self.diagnoses],
                "error": self.verdict.error,
                "target": self.target,
                "losses": self.losses,
                "comparison": self.comparison,
                "samples": self.samples,
                "mesh": self.mesh,
                "collectives": self.collectives,
                "timing": self.timing,
                "recorded": self.recorded,
                "repeat": self.repeat,
                "resume": self.resume,
                "ranks": self.ranks,
            }
        )

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        from reference.files import write_atomic

        return write_atomic(path, json.dumps(self.to_json(), indent=2))


def _collectives(trace: Any) -> dict[str, Any] | None:
    """The trace's collective events and per-step summary in the report's schema."""
    if trace is None:
        return None
    to_report = getattr(trace, "to_report", None)
    if callable(to_report):
        return to_report()
    data = trace.to_dict() if hasattr(trace, "to_dict") else None
    return data if isinstance(data, dict) else None


def build_report(
    *,
    target: Any,
    case: Any,
    nproc: int,
    comparison: Any = None,
    reference: Any = None,
    actual: Any = None,
    stepwise: Any = None,
    trace: Any = None,
    diagnoses: list[Diagnosis] | None = None,
    error: str = "",
    hang: bool = False,
    elapsed_s: float | None = None,
    recorded: dict[str, Any] | None = None,
) -> DiagnosisReport:
    passed = bool(comparison is not None and comparison.passed)
    verdict = verdict_for(diagnoses or [], passed=passed, hang=hang, error=error)
    if comparison is None and not hang and not diagnoses and not error:
        verdict = Verdict("error", [], "no comparison was produced")
    info = {
        "name": target.name,
        "source": target.source,
        "description": target.description,
        "case": case.name,
        "strategy": target.strategy.name if target.strategy is not None else "custom",
        "nproc": nproc,
        "steps": case.steps,
        "expected_code": target.expected_code,
    }
    losses: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    if reference is not None:
        losses["reference"] = [s.loss for s in reference.steps]
        losses["reference_micro"] = [list(s.micro_losses) for s in reference.steps]
        samples["reference"] = {str(s.step): list(s.sample_ids) for s in reference.steps}
    if stepwise is not None:
        losses["stepwise"] = [s.loss for s in stepwise.steps]
    if actual is not None:
        losses["parallel"] = [s.loss for s in actual.steps]
        losses["parallel_micro"] = [list(s.micro_losses) for s in actual.steps]
        ranks: dict[str, dict[str, Any]] = {}
        for s in actual.steps:
            for rank, micro in s.rank_sample_ids.items():
                ranks.setdefault(str(rank), {})[str(s.step)] = [list(m) for m in micro]
        samples["ranks"] = ranks
    return DiagnosisReport(
        verdict=verdict,
        target=info,
        losses=losses,
        comparison=comparison.to_dict() if comparison is not None else None,
        comparison_summary=comparison.summary() if comparison is not None else "",
        samples=samples,
        mesh=list(actual.meta.get("ranks", [])) if actual is not None else [],
        collectives=_collectives(trace),
        timing={"elapsed_s": elapsed_s} if elapsed_s is not None else {},
        recorded=dict(recorded or {}),
    )
