"""A self-contained HTML report (one file, no network): the verdict and evidence, the loss per
step (reference vs parallel, drawn with matplotlib and inlined as SVG), the per-tensor error
table with the first divergence highlighted, the sample-id grid (rank x step) with duplicates
marked, the mesh, and the collective timeline per rank with the divergence marked."""

from __future__ import annotations

import html
import io
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

from harness.report.model import DiagnosisReport
from harness.report.summary import HeatMap, Summary, divergence_positions, heat_map, summarize, tolerance_ratio, waits_in

__all__ = ["render_html", "render_index", "report_path", "write_html"]

_OP_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#bab0ac"]

STYLESHEET = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
.verdict{display:inline-block;padding:4px 10px;border-radius:4px;color:#fff;font-weight:600}
.pass{background:#2e7d32}.fail{background:#c62828}.hang{background:#6a1b9a}.error{background:#555}
.code{font-family:monospace;background:#f3f3f3;padding:1px 5px;border-radius:3px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f6f6f6} tr.bad td{background:#fdecea} tr.first td{background:#ffd7d2;font-weight:600}
td.dup{background:#ffe082} .ids{font-family:monospace;font-size:12px}
pre{background:#f8f8f8;padding:8px;overflow-x:auto;font-size:12px}
.muted{color:#666;font-size:12px}
#summary{border:1px solid #ccc;border-left:6px solid #888;border-radius:4px;padding:10px 14px;margin:12px 0;background:#fafafa}
#summary.fail{border-left-color:#c62828}#summary.pass{border-left-color:#2e7d32}#summary.hang{border-left-color:#6a1b9a}
#summary dl{display:grid;grid-template-columns:max-content 1fr;gap:3px 14px;margin:6px 0}
#summary dt{font-weight:600;color:#444} #summary dd{margin:0}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;margin:6px 0 6px 8px;font-size:13px}
dl.facts dt{color:#555} dl.facts dd{margin:0}
details{margin:6px 0} summary{cursor:pointer;color:#333}
nav.toc{font-size:13px;margin:6px 0} nav.toc a{margin-right:12px}
.likely{font-weight:600}
"""


def report_path(report_dir: str | os.PathLike[str] | None, nodeid: str | None, name: str) -> Path:
    """The HTML report's path for a test (``nodeid``) or a named run, in ``report_dir``
    (default ``harness-reports``): the id made a safe file name."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid or name).strip("_")[:180] or "report"
    return Path(report_dir or "harness-reports") / f"{stem}.html"


def _e(value: Any) -> str:
    return html.escape(str(value))


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.find("<svg"):]


def _loss_plot(report: DiagnosisReport) -> str:
    """The loss per step, reference against parallel, and under it what the eye cannot see on
    curves that lie on each other: |parallel - reference| per step (the reference the verdict
    compared with: the stepwise replay where there is one) against the loss's tolerance band."""
    ref = report.losses.get("reference") or []
    par = report.losses.get("parallel") or []
    if not ref and not par:
        return "<p class='muted'>no losses recorded</p>"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compared = report.losses.get("stepwise") or ref
    allowed = {r["step"]: r for r in (report.comparison or {}).get("tensors") or [] if r["kind"] == "loss" and r["name"] == "loss"}
    diffs = [(i, abs(p - e), allowed.get(i)) for i, (p, e) in enumerate(zip(par, compared))
             if isinstance(p, (int, float)) and isinstance(e, (int, float))]
    fig, axes = plt.subplots(2 if diffs else 1, 1, figsize=(6.5, 4.6 if diffs else 3), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2]} if diffs else None)
    ax = axes[0] if diffs else axes
    for values, label, style in ((ref, "reference (1 device)", "o-"), (par, f"parallel ({report.target['nproc']} {'simulated ' if report.target.get('simulated') else ''}ranks)", "s--")):
        points = [(i, v) for i, v in enumerate(values) if isinstance(v, (int, float))]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if diffs:
        low = axes[1]
        floor = 1e-12
        low.semilogy([d[0] for d in diffs], [max(d[1], floor) for d in diffs], "s-", color="#b71c1c", label="|parallel - reference|")
        band = [(i, row["tolerance"]["atol"] + row["tolerance"]["rtol"] * abs(float(row.get("expected_at_worst") or 0.0)))
                for i, _, row in diffs if row is not None and row.get("tolerance")]
        if band:
            low.fill_between([b[0] for b in band], floor, [max(b[1], floor) for b in band], color="#2e7d32", alpha=0.18,
                             label="within tolerance")
        low.set_ylabel("|difference|")
        low.legend(fontsize=8)
        low.grid(alpha=0.3)
        axes[-1].set_xlabel("step")
    else:
        ax.set_xlabel("step")
    axes_last = axes[-1] if diffs else ax
    axes_last.set_xticks(range(max(len(ref), len(par))))
    svg = _svg(fig)
    plt.close(fig)
    return svg


def _where(loc: Any) -> str:
    """Where the run departs (harness.analysis.divergence), as one row of a numerics table."""
    if not isinstance(loc, dict):
        return ""
    cells = [loc.get("phase"), loc.get("module"), loc.get("module_type") or loc.get("op"), loc.get("rank"),
             f"{loc.get('max_abs', 0.0):.3g}", json.dumps(loc.get("tolerance")), loc.get("compared")]
    head = "".join(f"<th>{h}</th>" for h in ("phase", "module", "type / op", "rank", "max abs", "tolerance", "compared with"))
    row = "".join(f"<td>{_e(str(c))}</td>" for c in cells)
    ops = ""
    if loc.get("op_rows"):  # the module's ops against the reference's, the departing one last and marked
        op_head = "".join(f"<th>{h}</th>" for h in ("op", "module", "reference op", "aligned", "max abs", "compared with", "status"))
        op_rows = "".join(
            f"<tr class='{'first' if i == len(loc['op_rows']) - 1 else ''}'>"
            + "".join(f"<td>{_e(str(c))}</td>" for c in (r["op"], r["module"], r["reference_op"], r["aligned"],
                                                             f"{r['max_abs']:.3g}", r["compared"], r["status"]))
            + "</tr>" for i, r in enumerate(loc["op_rows"]))
        ops = f"<table class='numerics'><tr>{op_head}</tr>{op_rows}</table>"
    return (f"<p class='where'><b>where it departs:</b> {_e(loc.get('line', ''))}</p>"
            f"<table class='numerics'><tr>{head}</tr><tr class='first'>{row}</tr></table>{ops}")


def _fold(label: str, content: str) -> str:
    """``content`` in a closed fold: there for whoever opens it, out of the reader's way."""
    return f"<details><summary>{_e(label)}</summary>{content}</details>"


def _fact(value: Any) -> str:
    """One evidence value as a person reads it: numbers to 4 digits, short lists inline."""
    if isinstance(value, float):
        return _e(f"{value:.4g}")
    if isinstance(value, (list, tuple)) and len(value) <= 8 and all(not isinstance(x, (dict, list)) for x in value):
        return _e(", ".join(str(x) for x in value))
    if isinstance(value, dict) and len(value) <= 6 and all(not isinstance(x, (dict, list)) for x in value.values()):
        return _e(", ".join(f"{k}: {x}" for k, x in value.items()))
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return _e(text if len(text) <= 200 else text[:197] + "...")


def _evidence(evidence: dict[str, Any]) -> str:
    """A code's evidence for people: the likely source first, then a few labelled facts; the
    whole of it as JSON in a closed fold, uncut."""
    likely = evidence.get("likely_source")
    facts = [(k, v) for k, v in evidence.items() if k not in ("likely_source", "first_divergent_op") and v not in (None, "", [], {})
             and not (isinstance(v, (dict, list)) and len(json.dumps(v, default=repr)) > 200)]  # a raw dump: in the fold
    shown = "".join(f"<dt>{_e(k.replace('_', ' '))}</dt><dd>{_fact(v)}</dd>" for k, v in facts[:8])
    hidden = len(evidence) - len(facts[:8]) - ("likely_source" in evidence) - ("first_divergent_op" in evidence)
    more = f"<p class='muted'>{hidden} more entries in the raw evidence below</p>" if hidden > 0 else ""
    return ((f"<p class='likely'>likely source: {_e(likely)}</p>" if likely else "")
            + (f"<dl class='facts'>{shown}</dl>{more}" if shown else "")
            + _fold("raw evidence (JSON)", f"<pre>{_e(json.dumps(evidence, indent=2, default=repr))}</pre>"))


def _diagnoses(report: DiagnosisReport) -> str:
    v = report.verdict
    if not v.diagnoses:
        body = "<p>No diagnosis: the parallel run matches the reference.</p>" if v.verdict == "pass" else ""
    else:
        body = "".join(
            f"<h3><span class='code'>{_e(d.code)}</span> {_e(d.summary)}</h3>"
            + _where(d.evidence.get("first_divergent_op"))
            + _evidence(d.evidence)
            for d in v.diagnoses
        )
    if v.error:
        first = v.error.strip().splitlines()[0] if v.error.strip() else ""
        body += f"<p>{_e(first)}</p>" + _fold("launcher report (every rank's account)", f"<pre>{_e(v.error)}</pre>")
    return body


MAX_FOLDED_ROWS = 2000  # ok rows listed one by one in their fold; beyond, one line per module


def _tensor_row(t: dict[str, Any], cls: str, *, reason: bool = True) -> str:
    ratio = tolerance_ratio(t)
    tol = t.get("tolerance") or {}
    tol_text = f"rtol {tol.get('rtol', 0):.3g}, atol {tol.get('atol', 0):.3g}" if tol else ""
    scale = t.get("scale")
    return (f"<tr class='{cls}'><td>{t['step']}</td><td>{_e(t['kind'])}</td><td>{_e(t['name'])}</td>"
            f"<td>{'ok' if t['passed'] else 'MISMATCH'}</td><td>{_num(t['max_abs'])}</td>"
            f"<td>{_e(f'{ratio:.3g}x') if ratio is not None else ''}</td>"
            + (f"<td title='{_e(tol.get('reason', ''))}'>" if reason else "<td>") + f"{_e(tol_text)}</td>"
            f"<td>{_num(scale) if scale is not None and not t['passed'] else ''}</td>"
            f"<td>{t.get('mismatched', '')}/{t.get('numel', '')}</td></tr>")


_TENSOR_HEAD = ("<tr><th>step</th><th>kind</th><th>name</th><th>verdict</th><th>max abs</th><th>x tolerance</th>"
                "<th>tolerance (reason on hover)</th><th>scale</th><th>mismatched</th></tr>")


def _module_of(name: str) -> str:
    return name.rsplit(".", 2)[0] if name.count(".") >= 2 else name.split(".")[0]


def _tensor_table(report: DiagnosisReport) -> str:
    """Only what differs: the mismatched rows, the first divergence first, then by how far
    beyond their tolerance; the rows within tolerance folded, one line per kind."""
    cmp = report.comparison
    if not cmp:
        if report.verdict.diagnoses and not report.verdict.error:
            return "<p class='muted'>no comparison: the run was refused before it trained (see the diagnosis)</p>"
        return "<p class='muted'>no comparison (the run did not finish)</p>"
    first = cmp.get("first_divergence") or {}
    first_keys = {(first.get("step"), k, n) for k, n in first.get("entries", [])}
    rows = cmp.get("tensors", [])
    excused = bool(cmp.get("reported_loss"))
    bad = [t for t in rows if not t["passed"] and not (excused and t["kind"] == "loss")]
    ok = [t for t in rows if t not in bad]
    order = {(first.get("step"), k, n): i for i, (k, n) in enumerate(first.get("entries", []))}
    # The first divergence's values first, in its own order (samples, loss, gradients, ...),
    # then the rest step by step, the furthest beyond its tolerance first.
    bad.sort(key=lambda t: (order.get((t["step"], t["kind"], t["name"]), len(order)), t["step"], -(tolerance_ratio(t) or 0.0)))
    parts = []
    if bad:
        parts.append(f"<p>{len(bad)} value{'s' if len(bad) != 1 else ''} beyond tolerance"
                     + (f"; the first divergence at step {first['step']} first (highlighted)" if first else "") + ".</p>")
        parts.append("<table>" + _TENSOR_HEAD + "".join(
            _tensor_row(t, "first" if (t["step"], t["kind"], t["name"]) in first_keys else "bad") for t in bad) + "</table>")
    elif report.verdict.verdict != "pass" and rows:
        parts.append("<p>Every value of this comparison is within tolerance: the failure is the diagnosis's above.</p>")
    if ok:
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for t in ok:
            by_kind.setdefault(t["kind"], []).append(t)
        lines = []
        for kind, items in by_kind.items():
            ratio, worst = max([((tolerance_ratio(t) or 0.0), t) for t in items], key=lambda p: p[0])
            lines.append(f"<li>{len(items)} {_e(kind)} within tolerance; the closest, {_e(worst['name'])} at step "
                         f"{worst['step']}, at {ratio:.0%} of its tolerance</li>")
        if len(ok) <= MAX_FOLDED_ROWS:
            listed = "<table>" + _TENSOR_HEAD + "".join(_tensor_row(t, "", reason=False) for t in ok) + "</table>"
        else:  # one line per module: a long run's rows would make a page nobody scrolls
            modules: dict[str, list[dict[str, Any]]] = {}
            for t in ok:
                modules.setdefault(_module_of(t["name"]), []).append(t)
            listed = "<ul>" + "".join(
                f"<li>{_e(m)}: {len(items)} values, worst at {max((tolerance_ratio(t) or 0.0) for t in items):.0%} of tolerance</li>"
                for m, items in modules.items()) + "</ul>"
        parts.append(f"<ul>{''.join(lines)}</ul>" + _fold(f"show the {len(ok)} values within tolerance", listed))
    structure = cmp.get("structure") or []
    if structure:
        srows = "".join(f"<tr><td>{_e(x.get('category'))}</td><td>{_e(x.get('step'))}</td><td>{_e(x.get('kind'))}</td>"
                        f"<td>{_e(x.get('name'))}</td><td>{_e(x.get('expected'))}</td><td>{_e(x.get('actual'))}</td></tr>"
                        for x in structure)
        parts.append(f"<h3>structure ({len(structure)} differences)</h3><table><tr><th>what</th><th>step</th><th>kind</th>"
                     f"<th>name</th><th>reference</th><th>parallel</th></tr>{srows}</table>")
    return "".join(parts) or "<p class='muted'>nothing was compared</p>"


def _how_compared(report: DiagnosisReport) -> str:
    """The tolerance in force and every note on what was compared and how."""
    cmp = report.comparison or {}
    tolerance = cmp.get("tolerance") or {}
    parts = []
    if tolerance:
        parts.append(f"<p>tolerance: {_e(tolerance.get('mode', '?'))}"
                     + (f" against {_e(', '.join(tolerance.get('variants', [])))}" if tolerance.get("variants") else "") + "</p>")
    notes = cmp.get("notes") or []
    if notes:
        parts.append("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    return "".join(parts) or "<p class='muted'>no comparison</p>"


def _resume(report: DiagnosisReport) -> str:
    """The resume check (--resume-at): each load-gate difference a row, then what did not
    transfer to the resumed layout and the continuation."""
    resume = report.resume
    if resume.get("skipped"):
        return f"<p class='muted'>not checked: {_e(resume['skipped'])}</p>"
    into = resume.get("into") or {}
    head = (f"<p>saved after step {_e(resume.get('at', 0) - 1)} on {_e(resume.get('saved_world'))} ranks, loaded into "
            f"<span class='code'>{_e(into.get('target', ''))}</span> on {_e(resume.get('world'))} ranks "
            f"({'the same layout' if resume.get('same_layout') else 'another layout'}): load gate "
            f"{'exact' if resume.get('load_exact') else 'differs'}; compared "
            + _e(", ".join(f"{n} {k}" for k, n in (resume.get("compared") or {}).items())) + "</p>")
    rows = "".join(f"<tr><td class='code'>{_e(d['code'])}</td><td>{_e(d['line'])}</td></tr>" for d in resume.get("gate") or [])
    table = f"<table><tr><th>code</th><th>difference</th></tr>{rows}</table>" if rows else ""
    lost = "".join(f"<li>not transferable to {_e(n['world'])} ranks: {_e(n['state'])} ({_e(n['why'])})</li>"
                   for n in resume.get("not_transferable") or [])
    cont = resume.get("continuation") or {}
    first = cont.get("first_difference")
    cont_line = (f"<p>continuation ({_e(cont.get('compared'))}): "
                 + (f"departs at step {_e(first['step'])}: {_e(first['what'])}" if first
                    else f"steps {_e(resume.get('at'))}..{_e(cont.get('last_step'))} agree") + "</p>") if cont else ""
    return head + table + (f"<ul>{lost}</ul>" if lost else "") + cont_line + _resume_plot(resume)


def _resume_plot(resume: dict[str, Any]) -> str:
    """The uninterrupted run's loss against the resumed run's from the step it continued at,
    the first step where the continuation departs marked."""
    losses = resume.get("losses") or {}
    at = int(resume.get("at") or 0)
    whole = [(i, v) for i, v in enumerate(losses.get("uninterrupted") or []) if isinstance(v, (int, float))]
    resumed = [(i, v) for i, v in enumerate(losses.get("resumed") or []) if i >= at and isinstance(v, (int, float))]
    if not whole or not resumed:
        return ""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 2.6))
    ax.plot([p[0] for p in whole], [p[1] for p in whole], "o-", label="uninterrupted run")
    ax.plot([p[0] for p in resumed], [p[1] for p in resumed], "s--", label=f"resumed at step {at}")
    ax.axvline(at - 0.5, color="#888", linestyle=":", linewidth=1)
    first = (resume.get("continuation") or {}).get("first_difference")
    if first and isinstance(first.get("step"), int):
        ax.axvline(first["step"], color="#c62828", linewidth=1.5, label=f"departs at step {first['step']}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_xticks(range(len(losses.get("uninterrupted") or [])))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    svg = _svg(fig)
    plt.close(fig)
    return svg


def _repeat(report: DiagnosisReport) -> str:
    """The determinism gate (--repeat): the outcome, what was compared, the pins, the first
    differences."""
    repeat = report.repeat
    if repeat.get("skipped"):
        return f"<p class='muted'>not compared: {_e(repeat['skipped'])}</p>"
    head = ("bitwise identical" if repeat.get("identical")
            else f"{_e(repeat.get('differences'))} differences; the first: {_e(repeat.get('first_line', ''))}")
    compared = ", ".join(f"{_e(n)} {_e(what)}" for what, n in (repeat.get("compared") or {}).items())
    differ = repeat.get("differ") or {}
    if differ and not repeat.get("identical"):
        compared = ("<table><tr><th scope='col'>category</th><th scope='col'>differ / compared</th></tr>"
                    + "".join(f"<tr class='{'bad' if differ.get(what) else ''}'><td>{_e(what)}</td><td>{_e(differ.get(what, 0))} / "
                              f"{_e(n)}</td></tr>" for what, n in (repeat.get("compared") or {}).items()) + "</table>")
    magnitude = repeat.get("magnitude") or {}
    if magnitude.get("max_abs") is not None:
        head += _e(f"; there the runs are {magnitude['max_abs']:.3g} apart at most ({magnitude['ulps']} ULPs of "
                   f"{magnitude['dtype']}, {magnitude['of']})")
    reading = f"<p class='likely'>{_e(repeat['reading'])}</p>" if repeat.get("reading") else ""
    pins = repeat.get("pins") or {}
    rows = "".join(f"<tr><td>{_e(k)}</td><td class='code'>{_e(v)}</td></tr>" for k, v in pins.items())
    pins_differ = (f"<p>pins that differed between the runs: {_e(', '.join(repeat['pins_differ']))}</p>"
                   if repeat.get("pins_differ") else "")
    return (f"<p>{_e(repeat.get('runs', 2))} runs on fresh ranks: {head}</p>{reading}<p>compared:</p>{compared}{pins_differ}"
            f"<table><tr><th>pin</th><th>value</th></tr>{rows}</table>{_repeat_plot(repeat)}")


def _repeat_plot(repeat: dict[str, Any]) -> str:
    """|run k - run 1| of the loss per step (log scale): runs that repeat bitwise draw nothing,
    and how far apart the others drift step by step is seen at once."""
    series = repeat.get("losses") or []
    if len(series) < 2 or repeat.get("identical"):
        return ""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = series[0]
    fig, ax = plt.subplots(figsize=(6.5, 2.4))
    drawn = False
    for k, other in enumerate(series[1:], 2):
        points = [(i, abs(b - a)) for i, (a, b) in enumerate(zip(base, other))
                  if isinstance(a, (int, float)) and isinstance(b, (int, float))]
        if points:
            ax.semilogy([p[0] for p in points], [max(p[1], 1e-16) for p in points], "s-", label=f"|run {k} - run 1| of the loss")
            drawn = True
    if not drawn:
        plt.close(fig)
        return ""
    ax.set_xlabel("step")
    ax.set_xticks(range(len(base)))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    svg = _svg(fig)
    plt.close(fig)
    return svg


def _num(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) else _e(x)


def _sample_grid(report: DiagnosisReport) -> str:
    ranks = report.samples.get("ranks") or {}
    if not ranks:
        return "<p class='muted'>no sample ids recorded</p>"
    steps = sorted({int(s) for per in ranks.values() for s in per})
    epoch_count: Counter[int] = Counter()
    for per in ranks.values():
        for micro in per.values():
            for ids in micro:
                epoch_count.update(ids)
    dp_rank = {str(m.get("rank")): m.get("dp_rank") for m in report.mesh}
    # ids seen by two different data-parallel replicas are duplicates (TP peers share on purpose)
    owners: dict[int, set[Any]] = {}
    for rank, per in ranks.items():
        for micro in per.values():
            for ids in micro:
                for i in ids:
                    owners.setdefault(i, set()).add(dp_rank.get(rank, rank))
    dups = {i for i, o in owners.items() if len(o) > 1}
    head = "<tr><th>rank (dp replica)</th>" + "".join(f"<th>step {s}</th>" for s in steps) + "</tr>"
    rows = []
    for rank in sorted(ranks, key=int):
        cells = []
        for s in steps:
            micro = ranks[rank].get(str(s), [])
            flat = [i for ids in micro for i in ids]
            has_dup = any(i in dups for i in flat)
            text = " | ".join(" ".join(f"<b>{i}</b>" if i in dups else str(i) for i in ids) for ids in micro)
            cells.append(f"<td class='ids{' dup' if has_dup else ''}'>{text}</td>")
        rows.append(f"<tr><td>{rank} ({_e(dp_rank.get(rank, '?'))})</td>{''.join(cells)}</tr>")
    legend = f"<p>{len(dups)} sample ids consumed by more than one data-parallel replica (bold, yellow cells). Micro-batches separated by |.</p>"
    return legend + f"<table>{head}{''.join(rows)}</table>"


def _mesh_table(report: DiagnosisReport) -> str:
    if not report.mesh:
        return "<p class='muted'>no mesh recorded</p>"
    rows = "".join(
        f"<tr><td>{m.get('rank')}</td><td>{_e(m.get('mesh'))}</td><td>{m.get('dp_rank')}/{m.get('dp_size')}</td>"
        f"<td>{_e(m.get('stages'))}</td><td>{'yes' if m.get('holds_loss') else ''}</td><td class='ids'>{_e(m.get('groups'))}</td></tr>"
        for m in report.mesh
    )
    return ("<table><tr><th>rank</th><th>coordinates</th><th>dp replica</th><th>stages</th><th>holds loss</th><th>groups</th></tr>"
            f"{rows}</table>")


def _timeline(report: DiagnosisReport) -> str:
    events = {r: evs for r, evs in ((report.collectives or {}).get("events") or {}).items() if evs}
    if not events:
        return "<p class='muted'>no collectives traced</p>"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted(events, key=int)
    ops = sorted({e.get("op", "?") for evs in events.values() for e in evs})
    color = {op: _OP_COLORS[i % len(_OP_COLORS)] for i, op in enumerate(ops)}
    marks = divergence_positions(report)
    longest = max(len(v) for v in events.values())
    fig, ax = plt.subplots(figsize=(min(14, 4 + longest * 0.08), 0.6 + 0.5 * len(ranks)))
    for y, rank in enumerate(ranks):
        for i, ev in enumerate(events[rank]):
            ax.broken_barh([(i, 0.9)], (y - 0.35, 0.7), facecolors=color.get(ev.get("op", "?")))
        if rank in marks:
            ax.plot([marks[rank] + 0.45], [y], marker="x", color="red", markersize=12, mew=3)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("collective # (per rank, in issue order); red x = first divergence")
    ax.legend(handles=[Patch(color=color[o], label=o) for o in ops], loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=min(len(ops), 6), fontsize=8)
    ax.invert_yaxis()
    svg = _svg(fig)
    plt.close(fig)
    summary = (report.collectives or {}).get("summary") or []
    table = ""
    if summary:
        rows = "".join(
            f"<tr><td>{_e(s.get('step'))}</td><td>{_e(s.get('group'))}</td><td>{_e(s.get('op'))}</td><td>{_e(s.get('count'))}</td><td>{_e(s.get('bytes'))}</td></tr>"
            for s in summary[:400]
        )
        table = f"<h3>per step, group and op</h3><table><tr><th>step</th><th>group</th><th>op</th><th>count</th><th>bytes</th></tr>{rows}</table>"
    return svg + table


def _summary_card(summary: Summary) -> str:
    """The first screen (``id="summary"``): the verdict and what to do about it."""
    rows: list[tuple[str, str]] = [("verdict", f"<b>{_e(summary.verdict.upper())}</b>"
                                    + "".join(f" <span class='code'>{_e(c)}</span>" for c in summary.codes)),
                                   ("what", _e(summary.headline))]
    if summary.where:
        loc = summary.location
        facts = ", ".join(f"{k} {loc[k]}" for k in ("step", "rank", "phase", "module", "op") if k in loc)
        rows.append(("where it departs", f"{_e(facts)}" + (f"<br><span class='code'>{_e(loc['site'])}</span>" if loc.get("site") else "")))
    if summary.beyond:
        b = summary.beyond
        ratio = b.get("x_tolerance")
        rows.append(("how far", _e(f"{b['value']} at step {b['step']}: max abs {b['max_abs']:.3g}"
                                   + (f", {ratio:.3g}x its tolerance" if isinstance(ratio, float) else ""))))
    if summary.headroom:
        h = summary.headroom
        rows.append(("headroom", _e(f"the closest value, {h['value']} at step {h['step']}, is at "
                                    f"{h['share']:.0%} of its tolerance")))
    if summary.compared:
        rows.append(("compared", _e(", ".join(f"{n} {k}" for k, n in summary.compared.items()))))
    if summary.fine:
        rows.append(("known fine", "<br>".join(_e(f) for f in summary.fine)))
    if summary.next_command:
        rows.append(("next", f"<span class='code'>{_e(summary.next_command)}</span>"))
    env = ", ".join(f"{k} {v}" for k, v in summary.environment.items())
    rows.append(("run again", f"<span class='code'>{_e(summary.repro)}</span>" + (f" <span class='muted'>({_e(env)})</span>" if env else "")))
    body = "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in rows)
    return f"<section id='summary' class='{_e(summary.verdict)}'><dl>{body}</dl></section>"


def _heat_colour(ratio: float) -> str:
    """log10(error / allowed): within tolerance from pale green (far within) to amber (at it),
    beyond from light to dark red (10^4 x beyond and more)."""
    import math

    v = math.log10(max(ratio, 1e-8))

    def mix(a: tuple[int, int, int], b: tuple[int, int, int], f: float) -> str:
        f = min(max(f, 0.0), 1.0)
        return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b))

    if ratio <= 1.0:
        return mix((232, 245, 233), (255, 213, 79), (v + 4) / 4)
    return mix((239, 154, 154), (120, 10, 10), v / 4)


def _heatmap_svg(heat: HeatMap) -> str:
    """One inline SVG: a row per parameter (model order), a column per step and kind, each
    cell coloured by how far its error is from its tolerance, an x in every cell beyond it, the
    first divergence outlined; every cell says its numbers on hover."""
    cell_w, cell_h, label_w, top = 14, 10 if len(heat.rows) <= 60 else 7, 230, 34
    width, height = label_w + cell_w * len(heat.columns) + 10, top + cell_h * len(heat.rows) + 4
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img' "
             f"aria-labelledby='heatmap-title'><title id='heatmap-title'>error over tolerance per value and step</title>"]
    steps = list(dict.fromkeys(s for s, _ in heat.columns))
    per_step = len(heat.columns) // max(len(steps), 1)
    for i, step in enumerate(steps):
        x = label_w + i * per_step * cell_w
        parts.append(f"<text x='{x}' y='12' font-size='10'>step {step}</text>")
    for j, (_, kind) in enumerate(heat.columns):
        parts.append(f"<text x='{label_w + j * cell_w + 2}' y='28' font-size='8' fill='#555'>{_e(kind[0])}</text>")
    for i, row in enumerate(heat.rows):
        y = top + i * cell_h
        if cell_h >= 10 or i % 2 == 0:
            parts.append(f"<text x='{label_w - 4}' y='{y + cell_h - 1}' font-size='{min(cell_h, 9)}' text-anchor='end'>{_e(row)}</text>")
        for j, (step, kind) in enumerate(heat.columns):
            ratio = heat.cells.get((i, j))
            if ratio is None:
                continue
            x = label_w + j * cell_w
            outline = " stroke='#000' stroke-width='2'" if (i, j) in heat.first else ""
            parts.append(f"<rect x='{x}' y='{y}' width='{cell_w - 1}' height='{cell_h - 1}' fill='{_heat_colour(ratio)}'{outline}>"
                         f"<title>{_e(kind)} {_e(row)} step {step}: {ratio:.3g}x its tolerance</title></rect>")
            if ratio > 1.0:
                parts.append(f"<text x='{x + cell_w / 2 - 0.5}' y='{y + cell_h - 1.5}' font-size='{cell_h}' text-anchor='middle' "
                             f"fill='#fff'>x</text>")
    parts.append("</svg>")
    return "".join(parts)


def _heatmap(report: DiagnosisReport) -> str:
    heat = heat_map(report)
    if heat is None:
        return ""
    beyond = sum(1 for r in heat.cells.values() if r > 1.0)
    legend = (f"<p class='muted'>{len(heat.rows)} rows x {len(heat.columns)} columns (l loss, g grad, p param, o optim state: "
              "its worst entry); colour: the error over its tolerance on a log scale, green far within, amber at it, red "
              f"beyond (an x in each: {beyond} cells); the first divergence outlined.</p>")
    svg = f"<div id='heatmap'>{_heatmap_svg(heat)}</div>"
    if report.verdict.verdict == "pass":
        return _fold("every value against its tolerance, step by step", legend + svg)
    return legend + svg


def _ranks(report: DiagnosisReport) -> str:
    """A hung or failed run around where each rank is: one row a rank (state, the op and its
    sequence number, the group's ranks, the user's frame, the last collective it completed),
    then the groups each rank was in, side by side."""
    if not report.ranks:
        return ""
    head = ("<tr><th scope='col'>rank</th><th scope='col'>state</th><th scope='col'>in</th><th scope='col'>group ranks</th>"
            "<th scope='col'>your code</th><th scope='col'>last completed</th></tr>")
    rows = "".join(
        f"<tr class='{'bad' if r['state'] != 'finished' else ''}'><td>{r['rank']}</td><td>{_e(r['state'])}</td>"
        f"<td>{_e(waits_in(r))}</td>"
        f"<td>{_e(r['group_ranks'] if r.get('group_ranks') is not None else '')}</td>"
        f"<td class='code'>{_e(r.get('site', ''))}</td><td>{_e(r.get('last_completed', ''))}</td></tr>" for r in report.ranks)
    table = f"<table>{head}{rows}</table>"
    # Group membership rank by rank, from the collectives each rank issued: ranks that disagree
    # on a group's members stand side by side.
    events = (report.collectives or {}).get("events") or {}
    groups = list(dict.fromkeys(str(e.get("group")) for evs in events.values() for e in evs if e.get("group") is not None))
    if events and groups:
        member = {(rank, g): e.get("group_ranks") for rank, evs in events.items() for e in evs for g in [str(e.get("group"))]}
        ghead = "<tr><th scope='col'>rank</th>" + "".join(f"<th scope='col'>{_e(g)}</th>" for g in groups) + "</tr>"
        grows = "".join(f"<tr><td>{_e(rank)}</td>" + "".join(f"<td>{_e(member.get((rank, g), '') or '')}</td>" for g in groups)
                        + "</tr>" for rank in sorted(events, key=int))
        table += f"<h3>groups each rank issued collectives in (their members as the rank saw them)</h3><table>{ghead}{grows}</table>"
    return table


def _section_id(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def render_html(report: DiagnosisReport, *, trace_link: str | None = None) -> str:
    v = report.verdict
    t = report.target
    title = f"{v.verdict.upper()} {' '.join(v.codes)} - {t['name']}"
    sections = [
        ("Diagnosis", _diagnoses(report)),
        ("Loss per step", _loss_plot(report) if report.losses.get("reference") or report.losses.get("parallel") else ""),
        ("Tensors: reference vs parallel", _tensor_table(report)),
        ("Steps by values", _heatmap(report)),
        ("What was compared, and how", _how_compared(report) if report.comparison else ""),
        ("Sample ids per rank and step", _sample_grid(report) if report.samples.get("ranks") else ""),
        ("Mesh", _mesh_table(report) if report.mesh else ""),
        ("Collective timeline", (_timeline(report) + (
            f"<p>The same collectives as a Chrome trace, with step spans, arrows joining one collective across its "
            f"ranks and a hung rank's wait: <a href='{_e(trace_link)}'>{_e(trace_link)}</a> (open it in ui.perfetto.dev "
            "or chrome://tracing)</p>" if trace_link else "")) if (report.collectives or {}).get("events") else ""),
    ]
    if report.ranks:
        sections.insert(0, ("Where each rank is", _ranks(report)))
    if report.repeat:
        sections.insert(1, ("Repeated runs, bitwise", _repeat(report)))
    if report.resume:
        sections.insert(1, ("Resumed from a checkpoint", _resume(report)))
    shown = [(name, content) for name, content in sections if content]  # an empty section says nothing
    toc = "<nav class='toc'>" + "".join(f"<a href='#{_section_id(n)}'>{_e(n)}</a>" for n, _ in shown) + "</nav>"
    body = "".join(f"<h2 id='{_section_id(name)}'>{_e(name)}</h2>{content}" for name, content in shown)
    meta = (
        f"{_e(t['strategy'])} on {t['nproc']} {'simulated ' if t.get('simulated') else ''}ranks, case <span class='code'>{_e(t['case'])}</span>, {t['steps']} steps"
        + (f"; expected code <span class='code'>{_e(t['expected_code'])}</span>" if t.get("expected_code") else "")
    )
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title><style>{STYLESHEET}</style></head><body>"
        f"<h1><span class='verdict {v.verdict}'>{v.verdict.upper()}</span> {_e(t['name'])}</h1><p>{meta}</p>"
        f"{_summary_card(summarize(report))}{toc}{body}"
        f"<p class='muted'>harness diagnosis report, schema in harness/report/model.py</p></body></html>"
    )


def render_index(rows: list[dict[str, Any]], folder: str | Path) -> str:
    """The main job's page of every target (``index.html`` beside ``index.json``): its verdict
    and codes against the expected one, where it departs, and links to the reports it wrote in
    ``folder`` (each row: ``target``, ``expected``, ``verdict``, ``codes``, ``ok``, ``where``)."""
    folder = Path(folder)
    bad = [r for r in rows if not r.get("ok")]
    body = []
    for r in rows:
        name = str(r["target"])
        links = " ".join(f"<a href='{_e(name + ext)}'>{label}</a>" for ext, label in
                         ((".html", "report"), (".json", "json"), (".trace.json", "trace")) if (folder / f"{name}{ext}").exists())
        verdict = str(r.get("verdict", "error"))
        body.append(f"<tr class='{'' if r.get('ok') else 'bad'}'><td><a href='{_e(name)}.html'>{_e(name)}</a></td>"
                    f"<td><span class='verdict {_e(verdict)}'>{_e(verdict.upper())}</span></td>"
                    f"<td>{' '.join(f'<span class=code>{_e(c)}</span>' for c in r.get('codes') or [])}</td>"
                    f"<td>{_e(r.get('expected', ''))}</td><td>{'yes' if r.get('ok') else '<b>NO</b>'}</td>"
                    f"<td>{_e(r.get('where', ''))}</td><td>{links}</td></tr>")
    head = "<tr><th scope='col'>target</th><th scope='col'>verdict</th><th scope='col'>codes</th><th scope='col'>expected</th>" \
           "<th scope='col'>as expected</th><th scope='col'>where it departs</th><th scope='col'>files</th></tr>"
    title = f"{len(rows) - len(bad)}/{len(rows)} targets as expected"
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title><style>{STYLESHEET}</style></head>"
            f"<body><h1>{_e(title)}</h1>"
            + (f"<p>not as expected: {', '.join(_e(r['target']) for r in bad)}</p>" if bad else "")
            + f"<table><caption class='muted'>every target the run diagnosed; each name opens its report</caption>{head}"
            f"{''.join(body)}</table></body></html>")


def write_html(report: DiagnosisReport, path: str | Path, *, trace: str | Path | None = None) -> Path:
    """Write the page; ``trace``: the Chrome trace written beside it, linked from the timeline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from reference.files import write_atomic

    link = os.path.relpath(Path(trace).resolve(), path.resolve().parent) if trace else None
    return write_atomic(path, render_html(report, trace_link=link))
