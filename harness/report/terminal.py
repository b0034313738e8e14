"""The terminal report: the verdict first, then each code with its evidence, short enough for
a CI log."""

from __future__ import annotations

import json
from typing import Any

from harness.report.model import DiagnosisReport, entry_name
from harness.report.summary import first_location, waits_in

__all__ = ["format_evidence", "format_terminal"]

_MAX_VALUE = 160
MAX_NOTES = 4  # what was compared and how (calibration, randomness, per-replica contract)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= _MAX_VALUE else text[: _MAX_VALUE - 3] + "..."


def format_evidence(evidence: dict[str, Any], indent: str = "      ", *, verbose: bool = True) -> list[str]:
    """One line per item; where the run departs (harness.analysis.divergence) as its sentence,
    whole. Without ``verbose``, a long list or mapping (a raw dump: the per-tensor rows, the
    first divergence's entries) is one line saying how much there is."""
    lines = []
    for key, value in evidence.items():
        if key == "first_divergent_op" and isinstance(value, dict) and "line" in value:
            lines.append(f"{indent}where: {value['line']}")
        elif not verbose and isinstance(value, (dict, list)) and len(json.dumps(value, default=repr)) > _MAX_VALUE:
            lines.append(f"{indent}{key}: {len(value)} entries (-v, or the JSON report)")
        else:
            lines.append(f"{indent}{key}: {_short(value)}")
    return lines


def format_terminal(report: DiagnosisReport, *, verbose: bool = False) -> str:
    v = report.verdict
    t = report.target
    head = {"pass": "PASS", "fail": "FAIL", "hang": "HANG", "error": "ERROR"}[v.verdict]
    codes = " ".join(v.codes)
    lines = [
        f"{head}{'  ' + codes if codes else ''}  "
        f"[{t['name']}: {t['strategy']} on {t['nproc']} {'simulated ' if t.get('simulated') else ''}ranks, case {t['case']!r}, {t['steps']} steps]"
    ]
    where = (first_location(report) or {}).get("line", "")
    if where:  # what a person acts on, before any evidence
        lines.append(f"  where: {where}")
    if t.get("description"):
        lines.append(f"  {t['description']}")
    for d in v.diagnoses:
        lines.append(f"  {d.code}: {d.summary}")
        shown_evidence = {k: e for k, e in d.evidence.items() if not (where and k == "first_divergent_op")}  # said above
        lines += format_evidence(shown_evidence, verbose=verbose)
    expected = t.get("expected_code")
    if expected:
        ok = expected in v.codes
        lines.append(f"  expected code {expected}: {'named' if ok else 'NOT named'}")
    if v.verdict == "fail" and report.comparison_summary and (verbose or not v.diagnoses):
        lines += ["  comparison:"] + ["    " + line for line in report.comparison_summary.splitlines()]
    elif report.comparison and report.comparison.get("first_divergence") and not where:
        div = report.comparison["first_divergence"]
        shown = ", ".join(entry_name(k, n) for k, n in div["entries"][:4])
        lines.append(f"  first divergence at step {div['step']}: {shown}")
    notes = (report.comparison or {}).get("notes") or []
    shown = notes if verbose else notes[:MAX_NOTES]
    lines += [f"  note: {n}" for n in shown]
    if len(notes) > len(shown):
        lines.append(f"  ... {len(notes) - len(shown)} more notes (--verbose, or the JSON report's comparison.notes)")
    lines += _repeat_lines(report.repeat)
    lines += _resume_lines(report.resume)
    if v.verdict == "error" and v.error:
        lines.append(f"  error: {v.error.splitlines()[0]}")
    recorded = getattr(report, "recorded", None) or {}
    for r in recorded.get("records", []):
        lines.append(f"  recorded: {r['path']} ({r['steps']} steps, {'complete' if r['complete'] else 'incomplete'})")
    lines += [f"  trace parts: {p}" for p in recorded.get("trace_parts", [])]
    lines += [f"  unfinished record: {p} (steps done before the ranks were stopped)" for p in recorded.get("unfinished", [])]
    ranks = getattr(report, "ranks", None) or []
    if ranks and v.verdict == "hang" and not verbose:
        # Where each rank is, one line a rank; the whole launcher report (stacks) with -v.
        lines.append("  ranks:")
        for r in ranks:
            inside = waits_in(r, members=True)
            at = f" at {r['site']}" if r.get("site") else ""
            last = f"; last completed {r['last_completed']}" if r.get("last_completed") else ""
            lines.append(f"    rank {r['rank']}: {r['state']}{' in ' + inside if inside else ''}{at}{last}")
        lines.append("  launcher report: every rank's stack and collectives with -v (or in the HTML report)")
    elif v.error and (v.verdict in ("error", "hang") or verbose):
        text = v.error if verbose else "\n".join(v.error.splitlines()[:40])
        lines += ["  launcher report:"] + ["    " + line for line in text.splitlines()]
    return "\n".join(lines)


def _resume_lines(resume: dict) -> list[str]:
    """The resume check: the load gate, what did not transfer, the continuation."""
    if not resume:
        return []
    if resume.get("skipped"):
        return [f"  resume: not checked ({resume['skipped']})"]
    return [f"  {line}" for line in resume.get("lines") or []]


def _repeat_lines(repeat: dict) -> list[str]:
    """The determinism gate's outcome and the pins the runs shared."""
    if not repeat:
        return []
    if repeat.get("skipped"):
        return [f"  repeat: not compared ({repeat['skipped']})"]
    compared = ", ".join(f"{n} {what}" for what, n in (repeat.get("compared") or {}).items())
    head = ("bitwise identical" if repeat.get("identical")
            else f"{repeat.get('differences')} differences, the first: {repeat.get('first_line', '')}")
    pins = repeat.get("pins") or {}
    shown = ", ".join(f"{k} {pins[k]}" for k in ("seed", "world_size", "threads", "deterministic_algorithms", "backend") if k in pins)
    lines = [f"  repeat: {repeat.get('runs', 2)} runs on fresh ranks {head} ({compared} compared)",
             f"  pins: {shown}"]
    magnitude = repeat.get("magnitude") or {}
    if magnitude.get("max_abs") is not None:
        lines.append(f"  apart by: max abs {magnitude['max_abs']:.3g}, {magnitude['ulps']} ULPs of {magnitude['dtype']} "
                     f"({magnitude['of']}, step {magnitude['step']})")
    if repeat.get("differ") and not repeat.get("identical"):
        lines.append("  differ / compared: " + ", ".join(f"{what} {repeat['differ'].get(what, 0)}/{n}"
                                                         for what, n in (repeat.get("compared") or {}).items()))
    if repeat.get("reading"):
        lines.append(f"  reading: {repeat['reading']}")
    if repeat.get("pins_differ"):
        lines.append(f"  pins that differed between the runs: {', '.join(repeat['pins_differ'])}")
    return lines
