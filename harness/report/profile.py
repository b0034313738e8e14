"""The profile of a correct run (:func:`harness.analysis.profile.build_profile`) for people: a
terminal table and a self-contained HTML page (per-rank bars of compute, communication and
idle; the bubble against theory; collective bytes per group; memory)."""

from __future__ import annotations

import html
import os
from typing import Any

__all__ = ["PALETTE", "bubble_judgement", "format_profile", "render_profile_html"]


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _collectives(c: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{op} x{v['count']} {_bytes(v['bytes'])}" for op, v in sorted(c.items())) or "none"


def format_profile(profile: dict[str, Any]) -> str:
    """The profile as terminal lines."""
    lines = [f"profile {profile['target']} ({profile['strategy']}, case {profile['case']!r}) on {profile['nproc']} ranks: "
             f"{profile['steps']} steps after {profile['warmup']} warm-up ({profile['informational']})",
             f"  {'rank':>4}  {'step':>10}  {'compute':>10}  {'comm':>10}  {'overlap':>10}  {'exposed':>10}  {'idle':>10}  "
             f"{'peak alloc':>10}  collectives over the profiled steps"]
    for r in profile["ranks"].values():
        lines.append(f"  {r['rank']:>4}  {_ms(r['step_s']):>10}  {_ms(r['compute_s']):>10}  {_ms(r['comm_s']):>10}  "
                     f"{_ms(r['overlap_s']):>10}  {_ms(r['exposed_comm_s']):>10}  {_ms(r['idle_s']):>10}  "
                     f"{_bytes(r['peak_bytes']):>10}  {_collectives(r['collectives'])}")
    tput = f"{profile['samples_per_s']:.1f} samples/s" if profile.get("samples_per_s") else "-"
    if profile.get("tokens_per_s"):
        tput += f", {profile['tokens_per_s']:.0f} tokens/s"
    lines.append(f"  slowest rank {profile['slowest_rank']} ({_ms(profile['step_s'])} a step; spread "
                 f"{profile['spread']:.0%} of it); {tput}")
    agree = "agree with" if profile["collectives_agree"] else "DISAGREE with"
    lines.append(f"  collective counts and bytes from the profiler {agree} the harness's collective trace")
    for r in profile["ranks"].values():
        if r["collectives_disagree"]:
            lines.append(f"    rank {r['rank']}: {r['collectives_disagree']}")
    bubble = profile.get("bubble")
    if bubble:
        per = ", ".join(f"stage {k} {v['fraction']:.2f}" for k, v in bubble["measured"]["per_stage"].items())
        imbalance = f"; stage imbalance {bubble['imbalance']:.2f}" if bubble["imbalance"] else ""
        lines.append(f"  pipeline bubble: measured {bubble['measured']['mean']:.2f} ({per}) against (p-1)/(m+p-1) = "
                     f"{bubble['theory']:.2f} for p={bubble['stages']}, m={bubble['micro_batches']}{imbalance}")
        lines.append(f"    {bubble_judgement(bubble)}")
    lines.append(f"  per-rank Chrome traces: {profile['trace_dir']}")
    return "\n".join(lines)


# Colours that differ in lightness as well as hue (read in grey, and by a reader who does not
# tell green from orange): dark blue compute, mid blue overlap, orange communication, grey idle.
PALETTE = {"compute": "#1b4f72", "overlap": "#5b9bd5", "comm": "#f5a623", "idle": "#8c8c8c", "stage": "#7b3294",
           "recording": "#c8c8c8"}


def _bar(r: dict[str, Any], scale: float) -> str:
    """One rank's step as a bar: compute only, compute and communication at once, communication only, idle."""
    parts = [(r["compute_s"] - r["overlap_s"], PALETTE["compute"], "compute"), (r["overlap_s"], PALETTE["overlap"], "overlap"),
             (r["exposed_comm_s"], PALETTE["comm"], "communication (exposed)"), (r["idle_s"], PALETTE["idle"], "idle")]
    x, out = 0.0, []
    for length, colour, what in parts:
        w = max(length, 0.0) * scale
        out.append(f"<rect x='{x:.1f}' y='0' width='{w:.1f}' height='16' fill='{colour}'><title>{what}: {_ms(length)}</title></rect>")
        x += w
    return f"<svg width='{x + 2:.0f}' height='16'>{''.join(out)}</svg>"


def _timeline(profile: dict[str, Any]) -> str:
    """Each rank's last profiled step on one time axis: lanes of compute, communication and (in
    a pipeline) the stage's forward/backward chunks; the gaps are idle."""
    ranks = list(profile["ranks"].values())
    longest = max((r["timeline"]["length_ms"] for r in ranks if r.get("timeline")), default=0.0) or 1.0
    width, lane_h = 800, 8
    colours = PALETTE
    rows = []
    for r in ranks:
        t = r.get("timeline")
        if not t:
            continue
        lanes = [k for k in ("compute", "comm", "stage", "recording") if t.get(k)]
        rects = []
        for i, k in enumerate(lanes):
            for a, b in t[k]:
                rects.append(f"<rect x='{a / longest * width:.1f}' y='{i * lane_h}' width='{max((b - a) / longest * width, 0.5):.1f}' "
                             f"height='{lane_h - 1}' fill='{colours[k]}'><title>{k} {a:.2f}-{b:.2f} ms</title></rect>")
        rows.append(f"<tr><td>{r['rank']}</td><td>{', '.join(lanes)}</td><td><svg width='{width}' height='{len(lanes) * lane_h}'>"
                    f"<rect x='0' y='0' width='{t['length_ms'] / longest * width:.1f}' height='{len(lanes) * lane_h}' fill='#f4f4f4'/>"
                    f"{''.join(rects)}</svg></td></tr>")
    return (f"<h2 id='timeline'>Timeline of the last profiled step ({longest:.1f} ms)</h2><p>lanes top to bottom as listed: "
            "compute (dark blue), communication (orange), pipeline stage chunks (purple), the harness's own recording (light "
            "grey); gaps are idle</p><table><tr><th>rank</th><th>lanes</th><th>timeline</th></tr>" + "".join(rows) + "</table>")


def _arith(r: dict[str, Any]) -> str:
    a = r.get("state_arithmetic")
    return " / ".join(_bytes(a[k]) for k in ("params", "grads", "optimizer")) if a else "-"


def _link(target: str, page: str | None) -> str:
    """``target`` as a link from the page at ``page`` (relative where both are known)."""
    if page is None:
        return target
    return os.path.relpath(os.path.abspath(target), os.path.dirname(os.path.abspath(page)))


def bubble_judgement(bubble: dict[str, Any]) -> str:
    """The measured bubble against (p-1)/(m+p-1), said as a judgement with its likely reason."""
    theory, measured = float(bubble["theory"]), float(bubble["measured"]["mean"])
    stages = bubble["measured"]["per_stage"]
    idlest = max(stages.items(), key=lambda kv: kv[1]["idle_s"]) if stages else None
    where = (f"; stage {idlest[0]} (rank {idlest[1]['rank']}) idles most, {_ms(idlest[1]['idle_s'])} a step"
             if idlest is not None else "")
    if theory <= 0:
        return f"measured {measured:.2f}{where}"
    ratio = measured / theory
    if ratio <= 1.25:
        return f"at theory ({ratio:.1f}x (p-1)/(m+p-1)): the schedule's own fill and drain{where}"
    imbalance = bubble.get("imbalance")  # the busiest stage's busy time over the least busy's
    fixed = ("each micro-batch's work is small against what every send, receive and chunk costs, so more micro-batches "
             "barely shrink it (on CPU especially)")
    why = (f"the busiest stage works {imbalance:.2f}x the least busy (the others wait for it), and {fixed}"
           if isinstance(imbalance, (int, float)) and imbalance > 1.2 else f"the stages are balanced; {fixed}")
    return f"{ratio:.1f}x theory: {why}{where}"


def render_profile_html(profile: dict[str, Any], *, verdict: dict[str, Any] | None = None, page: str | None = None) -> str:
    """The profile as one self-contained HTML page; ``page``: where it is written, so the
    per-rank traces are linked relative to it."""
    e = html.escape
    longest = max(r["step_s"] for r in profile["ranks"].values()) or 1.0
    scale = 600 / longest
    rows = "".join(
        f"<tr><td>{r['rank']}</td><td>{_ms(r['step_s'])}</td><td>{_ms(r['compute_s'])}</td><td>{_ms(r['comm_s'])}</td>"
        f"<td>{_ms(r['overlap_s'])}</td><td>{_ms(r['exposed_comm_s'])}</td><td>{_ms(r['idle_s'])}</td><td>{_bar(r, scale)}</td></tr>"
        for r in profile["ranks"].values())
    groups = "".join(
        f"<tr><td>{r['rank']}</td><td>{e(g)}</td><td>{v['count']}</td><td>{_bytes(v['bytes'])}</td></tr>"
        for r in profile["ranks"].values() for g, v in sorted(r["collectives_by_group"].items()))
    memory = "".join(
        f"<tr><td>{r['rank']}</td><td>{_bytes(r['state_bytes']['params'])}</td><td>{_bytes(r['state_bytes']['grads'])}</td>"
        f"<td>{_bytes(r['state_bytes']['optimizer'])}</td><td>{_arith(r)}</td><td>{_bytes(r['peak_bytes'])}</td>"
        f"<td>{e(r['peak_source'])}</td></tr>"
        for r in profile["ranks"].values())
    bubble = ""
    if profile.get("bubble"):
        b = profile["bubble"]
        stages = "".join(f"<tr><td>{e(k)}</td><td>{v['rank']}</td><td>{_ms(v['busy_s'])}</td><td>{_ms(v['idle_s'])}</td>"
                         f"<td>{v['fraction']:.2f}</td></tr>" for k, v in b["measured"]["per_stage"].items())
        bubble = (f"<h2 id='bubble'>Pipeline bubble</h2><p>measured mean {b['measured']['mean']:.2f} against (p-1)/(m+p-1) = "
                  f"{b['theory']:.2f} (p={b['stages']}, m={b['micro_batches']})</p><p class='likely'>{e(bubble_judgement(b))}</p>"
                  "<table><tr><th>stage</th><th>rank</th>"
                  f"<th>busy</th><th>idle</th><th>bubble fraction</th></tr>{stages}</table>")
    traces = ""
    if profile.get("trace_dir"):
        files = [f"rank{r['rank']}.json" for r in profile["ranks"].values()]
        traces = ("<h2 id='traces'>Per-rank traces</h2><p>torch.profiler's Chrome traces of the profiled steps (open in "
                  "ui.perfetto.dev or chrome://tracing; Holistic Trace Analysis reads the folder: "
                  f"<span class='code'>TraceAnalysis(trace_dir={e(repr(str(profile['trace_dir'])))})</span>):</p><ul>"
                  + "".join(f"<li><a href='{e(_link(os.path.join(str(profile['trace_dir']), f), page))}'>{e(f)}</a></li>"
                            for f in files)
                  + "</ul>")
    verdict_line = f"<p>verdict: <b>{e(str((verdict or {}).get('verdict', '?')))}</b></p>" if verdict else ""
    from harness.report.html import STYLESHEET

    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>profile {e(profile['target'])}</title>"
            f"<style>{STYLESHEET}</style></head><body>"
            f"<h1>Profile of {e(profile['target'])} ({e(profile['strategy'])}) on {profile['nproc']} ranks</h1>{verdict_line}"
            f"<p>{profile['steps']} profiled steps after {profile['warmup']} warm-up. {e(profile['informational'])}.</p>"
            "<h2>Per rank (mean per step)</h2><p>bar: compute, compute overlapped with communication, exposed "
            "communication, idle</p><table><tr><th>rank</th><th>step</th><th>compute</th><th>comm</th><th>overlap</th>"
            f"<th>exposed</th><th>idle</th><th>timeline</th></tr>{rows}</table>"
            f"<p>slowest rank {profile['slowest_rank']}, spread {profile['spread']:.0%}</p>{_timeline(profile)}{bubble}"
            "<h2>Collectives per group (profiled steps)</h2><table><tr><th>rank</th><th>group</th><th>count</th>"
            f"<th>bytes</th></tr>{groups}</table><h2>Memory</h2><table><tr><th>rank</th><th>parameters</th>"
            f"<th>gradients (after zero_grad)</th><th>optimizer</th><th>arithmetic: params / grads / optimizer</th><th>peak allocated</th>"
            f"<th>peak from</th></tr>{memory}</table>{traces}"
            "</body></html>")
