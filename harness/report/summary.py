"""The report's first screen as data: what a person reads before anything else.

One :class:`Summary` per report, built once from the :class:`~harness.report.model.DiagnosisReport`
(:func:`summarize`) and drawn by each renderer: the HTML's summary card, the terminal's first
lines. It says the verdict; where the run departs (step, rank, phase, module, op and the user's
file:line); how far beyond its tolerance the first failing value is; what is known fine (samples,
collectives, the steps before the departure); the next command to run; for a PASS the headroom
(the worst value at N% of its tolerance) and what was compared; and how to run it again.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any

from harness.report.model import DiagnosisReport, entry_name

__all__ = ["HeatMap", "Summary", "divergence_positions", "first_location", "heat_map", "summarize", "tolerance_ratio", "waits_in"]


@dataclass
class Summary:
    verdict: str
    codes: list[str]
    headline: str  # the first diagnosis's sentence, or what a pass or an error means
    where: str = ""  # the location's sentence (harness.analysis.divergence), "" without one
    location: dict[str, Any] = field(default_factory=dict)  # step, rank, phase, module, op, site
    beyond: dict[str, Any] = field(default_factory=dict)  # the first failing value: kind, name, step, x tolerance
    headroom: dict[str, Any] = field(default_factory=dict)  # a pass: the worst value at its share of its tolerance
    compared: dict[str, int] = field(default_factory=dict)  # values compared, by kind
    fine: list[str] = field(default_factory=list)  # what is known right
    next_command: str = ""
    repro: str = ""
    environment: dict[str, Any] = field(default_factory=dict)


def first_location(report: DiagnosisReport) -> dict[str, Any] | None:
    """Where the run departs (harness.analysis.divergence): the first diagnosis's location."""
    return next((d.evidence["first_divergent_op"] for d in report.verdict.diagnoses
                 if isinstance(d.evidence.get("first_divergent_op"), dict)), None)


def waits_in(row: dict[str, Any], *, members: bool = False) -> str:
    """'all_reduce #3 on 1:mesh_dp' (with ``members``: and its ranks): the collective a hung
    rank waits in, from :func:`harness.launch.failure_text.rank_states`' row; "" for none."""
    if not row.get("op"):
        return ""
    seq = f" #{row['seq']}" if row.get("seq") is not None else ""
    group = f" on {row['group']}" if row.get("group") else ""
    ranks = f" {row['group_ranks']}" if members and row.get("group") and row.get("group_ranks") is not None else ""
    return f"{row['op']}{seq}{group}{ranks}"


def tolerance_ratio(row: dict[str, Any]) -> float | None:
    """A compared value's largest error over what its tolerance allowed at that element
    (``atol + rtol * |expected|``): below 1 within, above 1 beyond by that factor."""
    tol = row.get("tolerance") or {}
    expected = row.get("expected_at_worst")
    scale = abs(float(expected)) if isinstance(expected, (int, float)) else float(row.get("ref_max") or 0.0)
    allowed = float(tol.get("atol", 0.0)) + float(tol.get("rtol", 0.0)) * scale
    max_abs = row.get("max_abs")
    if not isinstance(max_abs, (int, float)):
        return None
    if allowed <= 0:
        return 0.0 if max_abs == 0 else float("inf")
    return float(max_abs) / allowed


def summarize(report: DiagnosisReport) -> Summary:
    v = report.verdict
    cmp = report.comparison or {}
    rows = cmp.get("tensors") or []
    out = Summary(verdict=v.verdict, codes=list(v.codes), headline=_headline(report))
    location = first_location(report)
    if location:
        out.where = str(location.get("line", ""))
        out.location = {k: location.get(k) for k in ("step", "rank", "phase", "module", "op", "site") if location.get(k) is not None}
    for row in rows:
        out.compared[row["kind"]] = out.compared.get(row["kind"], 0) + 1
    failing = [r for r in rows if not r.get("passed")]
    first = cmp.get("first_divergence") or {}
    if failing:
        firsts = {(first.get("step"), k, n) for k, n in first.get("entries", [])}
        lead = next((r for r in failing if (r["step"], r["kind"], r["name"]) in firsts), failing[0])
        out.beyond = {"kind": lead["kind"], "name": lead["name"], "value": entry_name(lead["kind"], lead["name"]),
                      "step": lead["step"], "max_abs": lead["max_abs"],
                      "x_tolerance": tolerance_ratio(lead)}
    elif rows:
        ratios = [(tolerance_ratio(r) or 0.0, r) for r in rows]
        share, worst = max(ratios, key=lambda p: p[0])
        out.headroom = {"kind": worst["kind"], "name": worst["name"], "value": entry_name(worst["kind"], worst["name"]),
                        "step": worst["step"], "share": share}
    out.fine = _known_fine(report, failing)
    out.next_command = _next_command(report)
    out.repro = _repro(report)
    out.environment = _environment(report)
    return out


def _headline(report: DiagnosisReport) -> str:
    v = report.verdict
    if v.diagnoses:
        return v.diagnoses[0].summary
    if v.verdict == "pass":
        return "the parallel run computes what one device computes, within tolerance, at every step compared"
    if v.error:
        return v.error.strip().splitlines()[0]
    return "no comparison was produced"


def _known_fine(report: DiagnosisReport, failing: list[dict[str, Any]]) -> list[str]:
    """What the evidence says is right: each sentence only where its own check ran."""
    cmp = report.comparison or {}
    fine: list[str] = []
    if cmp and not cmp.get("samples") and report.samples.get("ranks"):
        fine.append("sample ids: each step's match the reference's")
    collectives = report.collectives or {}
    if collectives.get("events") and not any(d.code.startswith("collective-") for d in report.diagnoses) \
            and report.verdict.verdict in ("pass", "fail"):
        fine.append("collectives: every rank issued its groups' collectives in step (no mismatch, none missing)")
    if cmp and not cmp.get("structure") and cmp.get("tensors"):
        fine.append("state structure: the same parameter and optimizer-state names and shapes as the reference")
    steps = sorted({r["step"] for r in failing})
    if steps and steps[0] > 0:
        fine.append(f"steps 0..{steps[0] - 1}: every value within tolerance")
    loss_rows = [r for r in cmp.get("tensors") or [] if r["kind"] == "loss"]
    if failing and loss_rows and all(r.get("passed") for r in loss_rows):
        fine.append("the loss: within tolerance at every step")
    return fine


def _target_spec(report: DiagnosisReport) -> str:
    """How the command line names the target: its file (relative to here when below it) and
    entry, or the bundled name."""
    import os

    t = report.target
    source = t.get("source") or ""
    if not source:
        return str(t.get("name", "TARGET"))
    path, _, entry = source.partition(":") if not os.path.exists(source) else (source, "", "")
    try:
        shown = os.path.relpath(path) if os.path.abspath(path).startswith(os.getcwd() + os.sep) else path
    except ValueError:  # another drive
        shown = path
    return f"{shown}:{entry}" if entry else shown


def _next_command(report: DiagnosisReport) -> str:
    t = report.target
    name = _target_spec(report)
    v = report.verdict
    if v.verdict == "pass":
        return f"python -m harness profile {name}  (where the time goes in this correct run)"
    if v.verdict == "hang":
        return f"python -m harness diagnose {name} -v  (each rank's whole stack)"
    if v.verdict == "error":
        return f"python -m harness diagnose {name} -v  (the whole launcher report)"
    step = (first_location(report) or {}).get("step")
    if step is not None:
        return f"python -m harness diagnose {name} --steps {int(step) + 1} -v  (only up to the first departing step)"
    return f"python -m harness diagnose {name} -v  (every comparison, and every note)"


def _repro(report: DiagnosisReport) -> str:
    t = report.target
    name = _target_spec(report)
    simulated = t.get("simulated")
    ranks = f"--simulate {t.get('nproc')}" if simulated else f"--nproc {t.get('nproc')}"
    return f"python -m harness diagnose {name} {ranks} --steps {t.get('steps')}"


def _environment(report: DiagnosisReport) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version()}
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:  # a report read without torch: the version is not known here
        pass
    backend = next((m.get("backend") for m in report.mesh if m.get("backend")), None)
    if backend:
        env["backend"] = backend
    elapsed = (report.timing or {}).get("elapsed_s")
    if isinstance(elapsed, (int, float)):
        env["elapsed"] = f"{float(elapsed):.1f} s"
    return env


def divergence_positions(report: DiagnosisReport) -> dict[str, int]:
    """rank -> index, in the report's collective events of that rank, of the first divergent
    collective a collective code names: found by its group and sequence number (the position
    the diagnosis counted includes the harness's own collectives, which the events leave out)."""
    events = (report.collectives or {}).get("events") or {}
    marks: dict[str, int] = {}
    for d in report.diagnoses:
        if d.code not in ("collective-mismatch", "collective-missing"):
            continue
        ev = d.evidence
        per_rank = ev.get("per_rank") or {}
        wanted = {str(r): (entry.get("group_desc") or entry.get("group"), entry.get("seq"))
                  for r, entry in per_rank.items() if isinstance(entry, dict)}
        for rank in ev.get("ranks") or []:
            wanted.setdefault(str(rank), (ev.get("group_desc") or ev.get("group"), ev.get("seq")))
        for rank, (group, seq) in wanted.items():
            index = next((i for i, e in enumerate(events.get(rank) or [])
                          if e.get("seq") == seq and str(e.get("group")) in (str(group), str(ev.get("group")))), None)
            if index is not None:
                marks.setdefault(rank, index)
    return marks


MAX_HEAT_ROWS = 160  # beyond, one row per module (its parameters' worst)


@dataclass
class HeatMap:
    """Steps x values: ``rows`` in model order (parameters, or modules when there are many),
    ``columns`` (step, kind) with kind loss / grad / param / optim, ``cells[(row, column)]`` the
    largest error over what its tolerance allowed (>1 beyond), ``first``: the first
    divergence's cells."""

    rows: list[str]
    columns: list[tuple[int, str]]
    cells: dict[tuple[int, int], float]
    first: set[tuple[int, int]]


def heat_map(report: DiagnosisReport) -> HeatMap | None:
    cmp = report.comparison or {}
    tensors = cmp.get("tensors") or []
    if not tensors:
        return None
    params = list(dict.fromkeys(t["name"] for t in tensors if t["kind"] in ("grad", "param")))
    if not params:
        return None

    def owner(kind: str, name: str) -> str | None:
        if kind == "loss":
            return "loss"
        if kind != "optim":
            return name
        return next((p for p in sorted(params, key=len, reverse=True) if name.startswith(p + ".")), None)

    grouped = len(params) > MAX_HEAT_ROWS
    def row_of(name: str) -> str:
        if not grouped or name == "loss":
            return name
        parts = name.split(".")
        return ".".join(parts[:-1]) if len(parts) > 1 else name

    rows = list(dict.fromkeys(["loss"] * any(t["kind"] == "loss" for t in tensors) + [row_of(p) for p in params]))
    kinds = [k for k in ("loss", "grad", "param", "optim") if any(t["kind"] == k for t in tensors)]
    steps = sorted({t["step"] for t in tensors})
    columns = [(s, k) for s in steps for k in kinds]
    row_index = {r: i for i, r in enumerate(rows)}
    column_index = {c: i for i, c in enumerate(columns)}
    first = cmp.get("first_divergence") or {}
    first_keys = {(first.get("step"), k, n) for k, n in first.get("entries", [])}
    cells: dict[tuple[int, int], float] = {}
    marked: set[tuple[int, int]] = set()
    for t in tensors:
        name = owner(t["kind"], t["name"])
        if name is None:
            continue
        key = (row_index[row_of(name)], column_index[(t["step"], t["kind"])])
        ratio = tolerance_ratio(t)
        if ratio is not None:
            cells[key] = max(cells.get(key, 0.0), ratio)
        if (t["step"], t["kind"], t["name"]) in first_keys:
            marked.add(key)
    return HeatMap(rows, columns, cells, marked)
