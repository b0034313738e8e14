"""Compare a parallel run's record with the reference's, step by step and tensor by tensor.

Structure first (deepdiff of names, shapes, dtypes and optimizer hyperparameters: missing,
extra or renamed entries), then sample ids, then values: per step the loss and micro-batch
losses, every gradient (before the optimizer step: AdamW hides a constant gradient scale from
the parameters, only the gradients show it), every parameter and every optimizer-state tensor,
judged by ``torch.testing.assert_close`` under a recorded tolerance. The result is data
(:class:`CompareResult`) for the diagnosis and the reports; nothing is raised for a mismatch.

Two tensors at a time are in memory (one from each record).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from deepdiff import DeepDiff

from reference.record import KINDS, Record
from reference.trainer import NonFiniteReferenceError

from harness.codes import jsonable
from harness.analysis.tolerance import DefaultTolerances, Tolerance, TolerancePolicy, adaptive_sign_noise, reference_dtype
from harness.report.model import entry_name

__all__ = [
    "COMPARE_KINDS",
    "CompareResult",
    "Divergence",
    "SampleIssue",
    "StructureIssue",
    "TensorComparison",
    "compare",
    "compare_tensors",
    "trajectory_view",
]

COMPARE_KINDS: tuple[str, ...] = ("loss", *KINDS)


@dataclass
class TensorComparison:
    """One tensor (or loss) at one step. ``scale`` is the least-squares factor c with
    actual ~= c * expected (1.0 when right; 0.5 for a gradient averaged twice on 2 ranks)."""

    step: int
    kind: str
    name: str
    passed: bool
    shape: tuple[int, ...]
    dtype: str
    max_abs: float
    max_rel: float
    worst_index: tuple[int, ...] | None
    expected_at_worst: float | None
    actual_at_worst: float | None
    mismatched: int
    numel: int
    scale: float | None
    tolerance: Tolerance
    message: str = ""
    # Elements beyond tolerance accepted as an adaptive optimizer's sign noise (see
    # ``adaptive_sign_noise``): a parameter whose reference gradient was within rounding of 0.
    excused: int = 0
    ref_max: float = 0.0  # the reference tensor's largest magnitude

    @property
    def drift(self) -> float:
        """Largest error relative to the reference tensor's largest magnitude."""
        if self.ref_max > 0:
            return self.max_abs / self.ref_max
        return 0.0 if self.max_abs == 0 else math.inf

    def line(self) -> str:
        where = f"{self.kind} {self.name} step {self.step}"
        at = f" at {list(self.worst_index)}" if self.worst_index else ""
        vals = (
            f" (expected {self.expected_at_worst:.6g}, got {self.actual_at_worst:.6g})"
            if self.expected_at_worst is not None and self.actual_at_worst is not None
            else ""
        )
        verdict = "ok" if self.passed else f"MISMATCH {self.mismatched}/{self.numel}"
        if self.passed and self.excused:
            verdict = f"ok ({self.excused} elements within AdamW sign noise of a near-zero gradient)"
        scale = f", scale {self.scale:.4g}" if self.scale is not None and not self.passed else ""
        return (
            f"{where}: {verdict}, max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}{at}{vals}"
            f"{scale} [rtol {self.tolerance.rtol:g}, atol {self.tolerance.atol:.3g}, {self.tolerance.source}]"
        )


@dataclass
class StructureIssue:
    """A structural difference. ``category``: missing | extra | shape | dtype | steps |
    param_groups | incomplete."""

    category: str
    step: int | None
    kind: str | None
    name: str | None
    expected: Any = None
    actual: Any = None

    def line(self) -> str:
        where = " ".join(
            p for p in (f"step {self.step}" if self.step is not None else "", self.kind or "", repr(self.name) if self.name else "") if p
        ) or "record"
        if self.category == "steps":
            where = "whole step" + (f" {self.step}" if self.step is not None else "")
            return f"{where}: " + ("missing in the parallel run" if self.actual == "absent" else "not in the reference")
        if self.category == "missing":
            return f"{where}: missing in the parallel run"
        if self.category == "extra":
            return f"{where}: not in the reference"
        return f"{where}: {self.category} differs: reference {self.expected!r}, parallel {self.actual!r}"


@dataclass
class SampleIssue:
    """Sample ids of a step (or of one micro-batch) differ from the reference's."""

    step: int
    micro: int | None
    missing: list[int]
    extra: list[int]
    duplicated: list[int]

    def line(self) -> str:
        where = f"step {self.step}" + (f" micro-batch {self.micro}" if self.micro is not None else "")
        parts = [
            f"{label} {ids[:10]}{'...' if len(ids) > 10 else ''}"
            for label, ids in (("missing", self.missing), ("unexpected", self.extra), ("duplicated", self.duplicated))
            if ids
        ]
        return f"{where}: sample ids differ: " + ", ".join(parts)


@dataclass
class Divergence:
    """The earliest step where anything differs, and what differed there (in step order:
    samples, loss, gradients, parameters, optimizer state)."""

    step: int
    entries: list[tuple[str, str]]  # (kind, name); kind "samples" / "structure" included

    def line(self) -> str:
        shown = ", ".join(entry_name(k, n) for k, n in self.entries[:6])
        more = f" (+{len(self.entries) - 6} more)" if len(self.entries) > 6 else ""
        return f"first divergence at step {self.step}: {shown}{more}"


@dataclass
class CompareResult:
    reference: str
    actual: str
    label: str
    steps: int
    structure: list[StructureIssue] = field(default_factory=list)
    structure_text: str = ""
    samples: list[SampleIssue] = field(default_factory=list)
    tensors: list[TensorComparison] = field(default_factory=list)
    tolerance: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # "stepwise": ``reference`` is the same-start replay of this run (reference.replay);
    # "trajectory": the reference's own trajectory.
    mode: str = "trajectory"
    # Secondary view in stepwise mode: the run's whole trajectory against the reference's
    # (see :func:`trajectory_view`); never part of ``passed``.
    trajectory: dict[str, Any] = field(default_factory=dict)
    # Seconds spent per phase of the comparison (calibration_s, replay_s, comparison_s,
    # trajectory_view_s): what a long run costs, and where (tests/bench/bench_long_runs.py).
    timing: dict[str, float] = field(default_factory=dict)
    # The per-replica reference of a data-parallel run (each replica's micro-batches on their
    # own, harness.analysis.per_replica): "contract" when the case declares per-replica
    # statistics and it is ``reference``; else, for a run that failed, whether it matches that
    # one instead ("passed"), and how far the two references are apart ("references_differ_by").
    per_replica: dict[str, Any] = field(default_factory=dict)
    # Recorded name -> reference name, proposed from the shapes where the names differ but a
    # one-to-one renaming explains every difference of the structure: the values were compared
    # under it (the names are still reported as structure).
    renamed: dict[str, str] = field(default_factory=dict)
    # Only the reported loss departs, with gradients and parameters matching at those steps:
    # the readings of the loop's numbers (harness.analysis.loss_reading.ReportedLoss.to_dict);
    # those loss comparisons are then not failures - the training passed.
    reported_loss: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.structure and not self.samples and not self.failures()

    def failures(self) -> list[TensorComparison]:
        return [t for t in self.tensors if not t.passed and not (self.reported_loss and t.kind == "loss")]

    def get(self, step: int, kind: str, name: str) -> TensorComparison:
        # An index by (step, kind, name), extended as comparisons are appended: a long run's
        # lookups (the sign-noise excuse asks one per parameter and step) stay O(1), not O(steps).
        # It is not a field: to_dict and equality see the comparisons only.
        key = (step, kind, name)
        index: dict[tuple[int, str, str], int] = self.__dict__.setdefault("_index", {})
        pos = index.get(key)
        if pos is not None and (pos >= len(self.tensors) or _key(self.tensors[pos]) != key):
            index.clear()  # the list was reordered or cut: index it again
            pos = None
        if pos is None:
            for i in range(self.__dict__.get("_indexed", 0) if index else 0, len(self.tensors)):
                index.setdefault(_key(self.tensors[i]), i)
            self.__dict__["_indexed"] = len(self.tensors)
            pos = index.get(key)
        if pos is None:
            raise KeyError(f"no comparison for {kind} {name!r} at step {step}")
        return self.tensors[pos]

    @property
    def first_divergence(self) -> Divergence | None:
        candidates: list[tuple[int, int, str, str]] = []
        order = {k: i for i, k in enumerate(("structure", "samples", *COMPARE_KINDS))}
        for s in self.structure:
            if s.step is not None:
                candidates.append((s.step, order["structure"], "structure", f"{s.category} {s.kind} {s.name}"))
        for s in self.samples:
            candidates.append((s.step, order["samples"], "samples", "ids" if s.micro is None else f"micro-batch {s.micro}"))
        for t in self.failures():
            candidates.append((t.step, order[t.kind], t.kind, t.name))
        if not candidates:
            return None
        step = min(c[0] for c in candidates)
        at_step = sorted((c for c in candidates if c[0] == step), key=lambda c: c[1])  # stable: keeps tensor order
        return Divergence(step, [(kind, name) for _, _, kind, name in at_step])

    def summary(self, max_lines: int = 12) -> str:
        lines = [f"{'PASS' if self.passed else 'FAIL'}: {self.label} ({self.steps} steps, {len(self.tensors)} comparisons)"]
        div = self.first_divergence
        if div is not None:
            lines.append("  " + div.line())
        if self.structure:
            lines.append("  structure differs from the reference:")
            grouped = self._structure_lines()
            lines += ["    " + line for line in grouped[:max_lines]]
            if len(grouped) > max_lines:
                lines.append(f"    ... {len(grouped) - max_lines} more")
        if self.samples:
            lines.append("  sample ids:")
            lines += ["    " + s.line() for s in self.samples[:max_lines]]
        failures = self.failures()
        if failures:
            lines.append(f"  {len(failures)} tensor mismatches (earliest first):")
            lines += ["    " + t.line() for t in failures[:max_lines]]
            if len(failures) > max_lines:
                lines.append(f"    ... {len(failures) - max_lines} more")
        lines.append(f"  tolerance: {self._tolerance_line()}")
        if self.mode == "stepwise":
            lines.append("  compared: each step from this run's own state (stepwise)")
        if self.trajectory:
            lines.append(f"  trajectory (secondary, not part of the verdict): {self.trajectory.get('line', '')}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _structure_lines(self) -> list[str]:
        """One line per issue, with the steps it occurs at folded together."""
        steps: dict[str, list[int]] = {}
        for issue in self.structure:
            text = StructureIssue(issue.category, None, issue.kind, issue.name, issue.expected, issue.actual).line()
            steps.setdefault(text, []).append(issue.step if issue.step is not None else -1)
        return [f"{text} (steps {_ranges(s)})" if s != [-1] else text for text, s in steps.items()]

    def _tolerance_line(self) -> str:
        mode = self.tolerance.get("mode", "?")
        if mode == "calibrated":
            return f"calibrated from the reference's own noise against {', '.join(self.tolerance.get('variants', []))} (safety x{self.tolerance.get('safety')})"
        table = ", ".join(
            f"{d.removeprefix('torch.')} rtol {v['rtol']:g} atol {v['atol_x_scale']:g} x max|ref|" if "atol_x_scale" in v
            else f"{d.removeprefix('torch.')} rtol {v['rtol']:g} atol {v['atol']:g} (override)"
            for d, v in self.tolerance.get("per_dtype", {}).items()
        )
        return f"{mode}: {table}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (non-finite floats as strings)."""
        data = asdict(self)
        data["passed"] = self.passed
        div = self.first_divergence
        data["first_divergence"] = asdict(div) if div else None
        return jsonable(data)


def _key(t: TensorComparison) -> tuple[int, str, str]:
    return (t.step, t.kind, t.name)


def trajectory_view(result: CompareResult) -> dict[str, Any]:
    """The secondary, whole-trajectory view of a run: how far its trajectory drifts from the
    reference's, per step and kind (largest error relative to each tensor's magnitude, tensors
    beyond ``result``'s tolerance). It is informative only: rounding differences compound along a trajectory
    (an adaptive optimizer turns a near-zero gradient's sign noise into a +-lr step), so a
    correct run may drift; the verdict is the stepwise check."""
    per_step: dict[tuple[int, str], dict[str, Any]] = {}
    for t in result.tensors:
        entry = per_step.setdefault((t.step, t.kind), {"step": t.step, "kind": t.kind, "drift": 0.0, "beyond_tolerance": 0, "tensors": 0})
        entry["tensors"] += 1
        entry["drift"] = max(entry["drift"], t.drift)
        entry["beyond_tolerance"] += 0 if t.passed else 1
    div = result.first_divergence
    if div is None:
        line = f"within {result._tolerance_line()} of the reference's trajectory at every step"
    else:
        worst = max((e["drift"] for e in per_step.values() if e["kind"] == "param"), default=0.0)
        line = (f"drifts from the reference's trajectory from step {div.step} "
                f"({len(result.failures())} tensors beyond {result.tolerance.get('mode', '?')} tolerance; "
                f"largest parameter drift {worst:.3g} of the parameter's magnitude)")
    return jsonable({
        "reference": result.reference,
        "within_tolerance": result.passed,
        "first_divergence": {"step": div.step, "entries": [list(e) for e in div.entries[:20]]} if div else None,
        "per_step": list(per_step.values()),
        # Parameter elements the trajectory comparison accepted as AdamW sign noise.
        "excused": sum(t.excused for t in result.tensors),
        "line": line,
    })


def _ranges(steps: list[int]) -> str:
    steps = sorted(set(steps))
    spans, start = [], steps[0]
    for prev, cur in zip(steps, steps[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(spans)


# -- tensors -------------------------------------------------------------------------------


def compare_tensors(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerance: Tolerance,
    *,
    step: int = 0,
    kind: str = "tensor",
    name: str = "",
) -> TensorComparison:
    """Compare one pair with ``torch.testing.assert_close`` and measure the errors."""
    if actual.shape != expected.shape:
        raise ValueError(f"{kind} {name!r} step {step}: shapes {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    diff = (a - e).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)  # NaN counts as worst
    allowed = tolerance.atol + tolerance.rtol * e.abs()
    # assert_close's own rule, |a - e| <= atol + rtol |e| with NaN never equal, decides; its
    # message is only built for a failure (it costs more than the comparison itself).
    passed = not bool((~(diff <= allowed)).any())
    message = ""
    if not passed:
        try:
            torch.testing.assert_close(
                actual, expected, rtol=tolerance.rtol, atol=tolerance.atol, check_dtype=False,
                check_device=False, equal_nan=False,
            )
            passed = True  # float64 rounding of the bound: assert_close, the contract, accepts it
        except AssertionError as exc:
            message = " ".join(str(exc).split("\n")[:3])
    rel = torch.where(e != 0, diff / e.abs(), torch.where(diff > 0, math.inf, 0.0))
    numel = diff.numel()
    worst_index: tuple[int, ...] | None = None
    exp_w = act_w = None
    if numel:
        ratio = diff / torch.where(allowed > 0, allowed, torch.full_like(allowed, math.ulp(0.0)))
        flat = int(torch.argmax(torch.nan_to_num(ratio, nan=math.inf, posinf=1e308)))
        worst_index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
        exp_w, act_w = float(e.reshape(-1)[flat]), float(a.reshape(-1)[flat])
    denom = float((e * e).sum())
    scale = float((a * e).sum()) / denom if denom > 0 and torch.isfinite(a).all() else None
    return TensorComparison(
        step=step, kind=kind, name=name, passed=passed, shape=tuple(expected.shape),
        dtype=str(expected.dtype).removeprefix("torch."),
        max_abs=float(diff.max()) if numel else 0.0,
        max_rel=float(rel.max()) if numel else 0.0,
        worst_index=worst_index, expected_at_worst=exp_w, actual_at_worst=act_w,
        mismatched=int((diff > allowed).sum()), numel=numel, scale=scale,
        tolerance=tolerance, message=message, ref_max=float(e.abs().max()) if numel else 0.0,
    )


# -- structure -----------------------------------------------------------------------------


def _structure(record: Record) -> dict[str, Any]:
    steps: dict[int, Any] = {}
    for s in record.steps:
        entry: dict[str, Any] = {
            kind: {n: {"shape": str(tuple(i.shape)), "dtype": i.dtype.removeprefix("torch.")} for n, i in s.tensors.get(kind, {}).items()}
            for kind in KINDS
        }
        entry["param_groups"] = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": sorted(g.get("params", []))}
            for g in s.param_groups
        ]
        steps[s.step] = entry
    return {"steps": steps}


def _structure_issues(diff: DeepDiff) -> list[StructureIssue]:
    issues: list[StructureIssue] = []
    seen: set[tuple[Any, ...]] = set()
    for change, items in diff.tree.items():
        for item in items:
            path = item.path(output_format="list")
            step = path[1] if len(path) > 1 else None
            kind = path[2] if len(path) > 2 else None
            removed = "removed" in change
            if len(path) == 2:  # a whole step
                issue = StructureIssue("steps", step, None, None,
                                       "present" if removed else "absent", "absent" if removed else "present")
            elif kind == "param_groups":
                issue = StructureIssue("param_groups", step, "param_groups", None, _brief(item.t1), _brief(item.t2))
            elif len(path) == 4:
                issue = StructureIssue("missing" if removed else "extra", step, kind, path[3])
            elif len(path) >= 5 and path[4] in ("shape", "dtype"):
                issue = StructureIssue(path[4], step, kind, path[3], item.t1, item.t2)
            elif len(path) == 3 and isinstance(item.t1, dict) and isinstance(item.t2, dict):
                # DeepDiff reports a kind's whole table as changed when no name is left in
                # common (every parameter renamed): spell it out entry by entry.
                expanded = [StructureIssue("missing", step, kind, n) for n in item.t1 if n not in item.t2]
                expanded += [StructureIssue("extra", step, kind, n) for n in item.t2 if n not in item.t1]
                for n in (n for n in item.t1 if n in item.t2):
                    for field_name in ("shape", "dtype"):
                        if item.t1[n].get(field_name) != item.t2[n].get(field_name):
                            expanded.append(StructureIssue(field_name, step, kind, n, item.t1[n].get(field_name), item.t2[n].get(field_name)))
                for issue in expanded:
                    key = (issue.category, issue.step, issue.kind, issue.name)
                    if key not in seen:
                        seen.add(key)
                        issues.append(issue)
                continue
            else:
                issue = StructureIssue("other", step, kind, None, _brief(item.t1), _brief(item.t2))
            key = (issue.category, issue.step, issue.kind, issue.name)
            if key not in seen:
                seen.add(key)
                issues.append(issue)
    issues.sort(key=lambda i: (i.step if i.step is not None else -1, str(i.kind), str(i.name)))
    return issues


def _brief(value: Any) -> Any:
    text = repr(value)
    return value if len(text) <= 200 else text[:200] + "..."


def _rename_hints(
    issues: Iterable[StructureIssue], expected: dict[str, Any], actual: dict[str, Any]
) -> tuple[list[str], dict[str, str]]:
    """Pair each missing parameter with the extra one of the same shape and dtype (or its
    transpose), and propose the whole mapping as ``run.watch(..., names={...})`` takes it:
    the hints, and the proposal (recorded name -> reference name; pairs of one candidate)."""
    hints = []
    missing = [i for i in issues if i.category == "missing" and i.name and i.step == 0 and i.kind == "param"]
    extra = [i for i in issues if i.category == "extra" and i.name and i.step == 0 and i.kind == "param"]
    proposal: dict[str, str] = {}
    for m in missing:
        want = expected["steps"][0]["param"][m.name]
        same = [x for x in extra if actual["steps"][0]["param"][x.name] == want and x.name not in proposal]
        flipped = [x for x in extra if x.name not in proposal and _transposed(actual["steps"][0]["param"][x.name], want)]
        if len(same) == 1:
            proposal[same[0].name] = m.name
            hints.append(f"param {m.name!r} may have been renamed to {same[0].name!r} (same shape {want['shape']})")
        elif not same and len(flipped) == 1:
            hints.append(f"param {m.name!r} may have been renamed to {flipped[0].name!r} and transposed "
                         f"({actual['steps'][0]['param'][flipped[0].name]['shape']} vs {want['shape']}): record it in the "
                         "reference's layout")
        elif len(same) > 1:
            hints.append(f"param {m.name!r} may have been renamed to one of {[x.name for x in same]} (same shape)")
    if proposal:
        hints.append(f"renamed parameters, proposed from their shapes: run.watch(model, optimizer, layout, names={proposal!r})")
    return hints[:12], proposal


def _explains(proposal: dict[str, str], actual: Record, expected_structure: dict[str, Any]) -> bool:
    return bool(proposal) and _structure(actual.renamed(proposal)) == expected_structure


def proposed_renaming(reference: Record, actual: Record) -> dict[str, str]:
    """Recorded name -> reference name, when the two records differ only by a one-to-one
    renaming of parameters that their shapes and dtypes propose (each pair the only candidate);
    else empty. Whatever compares or replays ``actual`` by name reads it through
    ``actual.renamed(...)`` of this."""
    expected_structure, actual_structure = _structure(reference), _structure(actual)
    if expected_structure == actual_structure:
        return {}
    issues = _structure_issues(DeepDiff(expected_structure, actual_structure, verbose_level=2))
    _, proposal = _rename_hints(issues, expected_structure, actual_structure)
    return proposal if _explains(proposal, actual, expected_structure) else {}


def _transposed(a: dict[str, Any], b: dict[str, Any]) -> bool:
    sa, sb = a.get("shape", ""), b.get("shape", "")
    return a.get("dtype") == b.get("dtype") and sa != sb and sa.strip("(),").split(", ")[::-1] == sb.strip("(),").split(", ")


# -- samples -------------------------------------------------------------------------------


def _id_issue(step: int, micro: int | None, expected: list[int], actual: list[int]) -> SampleIssue | None:
    e, a = Counter(expected), Counter(actual)
    if e == a:
        return None
    over = a - e
    return SampleIssue(
        step=step, micro=micro,
        missing=sorted((e - a).elements()),
        extra=sorted(i for i in over if i not in e),
        duplicated=sorted(i for i in over if i in e),  # consumed more often than the reference did
    )


# -- records -------------------------------------------------------------------------------


def compare(
    reference: Record,
    actual: Record,
    tolerance: TolerancePolicy | None = None,
    *,
    label: str | None = None,
) -> CompareResult:
    """Compare ``actual`` (a parallel run) with ``reference`` step by step.

    Raises :class:`NonFiniteReferenceError` when the reference holds NaN/inf (there is then
    nothing sound to compare against) and ``ValueError`` for an incomplete reference."""
    policy = tolerance or DefaultTolerances()
    if not reference.complete:
        raise ValueError(f"reference record {reference.path} is incomplete (its training failed); retrain it")
    _check_reference_finite(reference)
    result = CompareResult(
        reference=str(reference.path), actual=str(actual.path),
        label=label or f"{actual.source} vs {reference.source}",
        steps=reference.num_steps, tolerance=policy.describe(),
    )
    result.notes += _randomness_notes(reference)
    if not actual.complete:
        result.notes.append(f"the parallel run's record is incomplete (it failed after {actual.num_steps} steps)")
    result.notes += [f"calibration: {why}" for why in result.tolerance.get("rejected", [])]
    if renamed := actual.meta.get("renamed_by_prefix"):
        strip, add = renamed["strip"], renamed["add"]
        how = f"without the prefix {strip!r}" if strip else f"with the prefix {add!r}"
        result.notes.append(
            f"parameter names: every name of the run differs from the reference's by one prefix ({how}), shapes one to "
            "one; compared under the reference's names (declare run.watch(..., names=...) to say so yourself)"
        )

    expected_structure, actual_structure = _structure(reference), _structure(actual)
    # DeepDiff only where the structures differ: on identical ones it costs a third of a comparison.
    diff = DeepDiff(expected_structure, actual_structure, verbose_level=2) if expected_structure != actual_structure else None
    if diff:
        result.structure = _structure_issues(diff)
        result.structure_text = diff.pretty()
        hints, proposal = _rename_hints(result.structure, expected_structure, actual_structure)
        result.notes += hints
        # A renaming that explains the whole difference: compare the values under it, so a
        # naming mismatch never hides what the values show (the names stay reported).
        if _explains(proposal, actual, expected_structure):
            result.renamed = proposal
            actual = actual.renamed(proposal)
            result.notes.append(
                f"values compared under the names proposed from the shapes ({len(proposal)} renamed parameters)"
            )

    dtype = reference_dtype(reference)
    sign_uncertain_counts: dict[str, tuple[int, torch.Tensor]] = {}  # see adaptive_sign_noise
    for step in range(min(reference.num_steps, actual.num_steps)):
        step_start = len(result.tensors)
        ref_s, act_s = reference.step(step), actual.step(step)
        issue = _id_issue(step, None, ref_s.sample_ids, act_s.sample_ids)
        if issue:
            result.samples.append(issue)
        elif len(ref_s.micro_sample_ids) == len(act_s.micro_sample_ids):
            for m, (e_ids, a_ids) in enumerate(zip(ref_s.micro_sample_ids, act_s.micro_sample_ids)):
                if (mi := _id_issue(step, m, e_ids, a_ids)) is not None:
                    result.samples.append(mi)

        # Losses (scalars kept in the record's JSON).
        losses = [("loss", ref_s.loss, act_s.loss)]
        if len(ref_s.micro_losses) == len(act_s.micro_losses) and len(ref_s.micro_losses) > 1:
            losses += [(f"micro.{i}", e, a) for i, (e, a) in enumerate(zip(ref_s.micro_losses, act_s.micro_losses))]
        for name, e, a in losses:
            if e is None:
                continue
            if a is None or not isinstance(a, (int, float)):
                result.structure.append(StructureIssue("missing", step, "loss", name))
                continue
            tol = policy.for_tensor(step, "loss", name, dtype, abs(float(e)))
            result.tensors.append(
                compare_tensors(torch.tensor(float(a), dtype=torch.float64), torch.tensor(float(e), dtype=torch.float64), tol,
                                step=step, kind="loss", name=name)
            )
        for kind in KINDS:
            act_entries = act_s.tensors.get(kind, {})
            for name, info in ref_s.tensors.get(kind, {}).items():
                other = act_entries.get(name)
                if other is None or other.shape != info.shape:
                    continue  # reported as structure
                expected = reference.tensor(step, kind, name)
                floating = expected.is_floating_point() and expected.numel() > 0
                scale = float(expected.detach().double().abs().max()) if floating else 0.0
                tol = policy.for_tensor(step, kind, name, info.torch_dtype, scale)
                result.tensors.append(
                    compare_tensors(actual.tensor(step, kind, name), expected, tol, step=step, kind=kind, name=name)
                )
        _excuse_sign_noise(reference, actual, result, step, step_start, sign_uncertain_counts)
    return result


def _excuse_sign_noise(
    reference: Record, actual: Record, result: CompareResult, step: int, start: int,
    counts: dict[str, tuple[int, torch.Tensor]],
) -> None:
    # This step's comparisons only (from ``start``): a long run's earlier steps are not walked again.
    for i in range(start, len(result.tensors)):
        t = result.tensors[i]
        if t.step != step or t.kind != "param" or t.passed:
            continue
        count = adaptive_sign_noise(reference, actual, result, t, counts)
        if count:
            result.tensors[i] = replace(t, passed=True, excused=count, message="")
            result.notes.append(
                f"param {t.name!r} at step {step}: {count} elements differ by up to 2 lr where the reference gradient "
                "is within rounding of 0; an adaptive optimizer (AdamW) turns such a gradient into a +-lr step whose "
                "sign is noise, so they are accepted"
            )


def _randomness_notes(reference: Record) -> list[str]:
    """What the reference did with the run's random numbers: replayed them (the stepwise
    reference of a run that recorded its draws), could not (and why), or drew its own."""
    replays = [(s.step, s.extra["draw_replay"]) for s in reference.steps if "draw_replay" in s.extra]
    if replays:
        failed = [(step, r["failed"]) for step, r in replays if r.get("failed")]
        ops = sum(r.get("replayed", 0) for _, r in replays)
        if not failed:
            return [f"randomness replayed: the reference computed every step with the random numbers each rank drew "
                    f"({ops} random ops over {len(replays)} steps, assembled along the layout)"]
        step, why = failed[0]
        return [f"randomness not replayed from step {step}: {why}; the reference drew its own random numbers from there "
                "(values then match only if the ranks drew what one device draws)"]
    dropout = reference.meta.get("dropout", {})
    if dropout.get("active"):
        return ["the reference trained with dropout active "
                f"({', '.join(dropout.get('modules', []))}) and the run recorded no draws to replay; values match only "
                "if the parallel run draws the same masks"]
    return []


def _check_reference_finite(reference: Record) -> None:
    for s in reference.steps:
        if s.loss is not None and not math.isfinite(s.loss):
            raise NonFiniteReferenceError(
                f"reference {reference.path} has a non-finite loss ({s.loss}) at step {s.step}; "
                "a case whose reference is not finite cannot be compared"
            )
        for kind, entries in s.tensors.items():
            for name, info in entries.items():
                if not info.finite:
                    raise NonFiniteReferenceError(
                        f"reference {reference.path} has NaN/inf in {kind} {name!r} at step {s.step}; "
                        "a case whose reference is not finite cannot be compared"
                    )
