"""The HTML report as a person sees it, in a real browser (Debian's Chromium driven by
Playwright; ``.ci/run`` installs both, nothing is downloaded at run time): the summary card ends
on the first screen and says where a failed run departs, down to the user's file:line; evidence is
labelled facts with the raw JSON folded; a passing report fits in three screens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from harness.pipeline import diagnose_target
from harness.report.html import write_html

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREEN = {"width": 1400, "height": 900}


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, report, tmp_path: Path, name: str):
    path = write_html(report, tmp_path / f"{name}.html")
    page = browser.new_page(viewport=SCREEN)
    page.goto(path.resolve().as_uri())
    return page


def _page_facts(page) -> dict:
    return page.evaluate("""() => {
        const card = document.getElementById('summary');
        const r = card.getBoundingClientRect();
        return {
            cardBottom: r.bottom + window.scrollY,
            cardText: card.innerText,
            height: document.documentElement.scrollHeight,
            preOutsideFold: Array.from(document.querySelectorAll('pre')).filter(p => !p.closest('details')).length,
            openFolds: Array.from(document.querySelectorAll('details')).filter(d => d.open).length,
            sections: Array.from(document.querySelectorAll('h2[id]')).map(h => h.id),
            tocLinks: Array.from(document.querySelectorAll('nav.toc a')).map(a => a.getAttribute('href')),
        };
    }""")


def test_a_failing_report_says_where_it_departs_on_the_first_screen(browser, rank_runner, reference_cache, tmp_path) -> None:
    report = diagnose_target("autocast_forward", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    page = _open(browser, report, tmp_path, "autocast_forward")
    facts = _page_facts(page)
    assert facts["cardBottom"] <= SCREEN["height"], facts
    card = facts["cardText"]
    assert "where it departs" in card and "aten.addmm.default" in card and "module fc1" in card, card
    assert "cases/models.py:" in card, card  # the user's line that ran the op
    assert "x its tolerance" in card and "next" in card and "run again" in card, card
    assert facts["preOutsideFold"] == 0 and facts["openFolds"] == 0, facts
    assert [f"#{s}" for s in facts["sections"]] == facts["tocLinks"], facts
    # The first divergent row leads the tensor table, and no ok row is listed outside its fold.
    first_row = page.evaluate("() => document.querySelector('#tensors-reference-vs-parallel ~ table tr.first td:nth-child(3)').innerText")
    assert first_row == "loss", first_row
    visible_ok = page.evaluate("() => Array.from(document.querySelectorAll('tr')).filter(t => t.offsetParent !== null "
                               "&& t.children[3] && t.children[3].innerText === 'ok').length")
    assert visible_ok == 0, visible_ok
    # The steps x values map: a cell per value and step, the first divergence outlined, an x
    # (not colour alone) in every cell beyond tolerance.
    heat = page.evaluate("""() => { const m = document.querySelector('#heatmap svg');
        return {cells: m.querySelectorAll('rect').length, outlined: m.querySelectorAll('rect[stroke]').length,
                crosses: Array.from(m.querySelectorAll('text')).filter(t => t.textContent === 'x').length}; }""")
    assert heat["cells"] >= 5 * 3 and heat["outlined"] >= 1 and heat["crosses"] >= 5, heat
    page.close()


def test_a_passing_report_fits_in_three_screens_with_its_headroom(browser, rank_runner, reference_cache, tmp_path) -> None:
    report = diagnose_target("tp", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    assert report.verdict.verdict == "pass"
    page = _open(browser, report, tmp_path, "tp")
    facts = _page_facts(page)
    assert facts["height"] <= 3 * SCREEN["height"], facts["height"]
    assert facts["cardBottom"] <= SCREEN["height"], facts
    assert "headroom" in facts["cardText"] and "% of its tolerance" in facts["cardText"], facts["cardText"]
    assert "compared" in facts["cardText"] and "grad" in facts["cardText"], facts["cardText"]
    assert facts["preOutsideFold"] == 0, facts
    assert page.locator("#heatmap").count() == 1  # there, folded: a pass has nothing to point at
    page.close()


def test_the_divergence_mark_is_found_by_group_and_sequence_number() -> None:
    """The diagnosis counts positions in the flight recorder's list, which holds the harness's
    own collectives; the report's events leave them out. The mark is the event with the named
    group and sequence number, in the HTML timeline and the Chrome trace alike."""
    from harness.codes import Diagnosis, Verdict
    from harness.report import chrome_trace
    from harness.report.model import DiagnosisReport
    from harness.report.summary import divergence_positions

    events = {"0": [{"group": "default_pg", "seq": 351, "op": "all_gather"}, {"group": "default_pg", "seq": 356, "op": "all_reduce"},
                    {"group": "metrics", "seq": 1, "op": "all_reduce"}],
              "1": [{"group": "default_pg", "seq": 351, "op": "all_gather"}, {"group": "default_pg", "seq": 356, "op": "all_reduce"}]}
    found = Diagnosis("collective-missing", "rank 0 waits in metrics #1", {
        "group": "1", "group_desc": "metrics", "seq": 1, "position": 1, "ranks": [0], "position_per_rank": {"0": 7},
        "per_rank": {"0": {"op": "all_reduce", "seq": 1, "group": "1", "group_desc": "metrics"}}})
    report = DiagnosisReport(verdict=Verdict("hang", [found], "stopped"), target={"name": "x", "strategy": "s", "nproc": 2,
                                                                                   "case": "c", "steps": 1},
                             collectives={"events": events})
    assert divergence_positions(report) == {"0": 2}
    marked = [e for e in chrome_trace(report)["traceEvents"] if "diverg" in str(e.get("name", "")).lower()]
    assert len(marked) == 1 and marked[0]["pid"] == 0, marked


def test_the_index_page_links_every_target_it_ran(browser, tmp_path) -> None:
    from harness.report.html import render_index

    rows = [{"target": "summed_grads", "expected": "grad-not-averaged", "verdict": "fail", "codes": ["grad-not-averaged"],
             "ok": True, "where": ""},
            {"target": "ddp", "expected": "PASS", "verdict": "pass", "codes": [], "ok": True, "where": ""},
            {"target": "tp_missing_allreduce", "expected": "tp-partial-sum", "verdict": "pass", "codes": [], "ok": False,
             "where": ""}]
    for r in rows:
        (tmp_path / f"{r['target']}.html").write_text("<html></html>")
        (tmp_path / f"{r['target']}.json").write_text("{}")
    (tmp_path / "index.html").write_text(render_index(rows, tmp_path))
    page = browser.new_page(viewport=SCREEN)
    page.goto((tmp_path / "index.html").as_uri())
    hrefs = page.evaluate("() => Array.from(document.querySelectorAll('table a')).map(a => a.getAttribute('href'))")
    assert {f"{r['target']}.html" for r in rows} <= set(hrefs) and all((tmp_path / h).exists() for h in hrefs), hrefs
    assert page.title() == "2/3 targets as expected" and "tp_missing_allreduce" in page.inner_text("body > p")
    page.close()


def test_the_chrome_trace_joins_a_collective_across_its_ranks_and_shows_steps_and_waits() -> None:
    from harness.codes import Verdict
    from harness.report import chrome_trace
    from harness.report.model import DiagnosisReport

    def ev(group, ranks, seq, step, start):
        return {"group": group, "group_ranks": ranks, "seq": seq, "op": "all_reduce", "step": step, "start_us": start,
                "end_us": start + 5}

    events = {"0": [ev("mesh_dp", [0, 2], 1, 0, 0), ev("mesh_dp", [0, 2], 2, 1, 20)],
              "1": [ev("mesh_dp", [1, 3], 1, 0, 1)],  # the same name, another group: never joined to rank 0's
              "2": [ev("mesh_dp", [0, 2], 1, 0, 2), ev("mesh_dp", [0, 2], 2, 1, 21)]}
    report = DiagnosisReport(verdict=Verdict("hang", [], "stopped"), target={"name": "x", "strategy": "s", "nproc": 3, "case": "c",
                                                                             "steps": 2},
                             collectives={"events": events},
                             ranks=[{"rank": 1, "state": "waiting", "op": "all_reduce", "seq": 2, "group": "mesh_dp",
                                     "group_ranks": [1, 3], "site": "", "last_completed": ""}])
    trace = chrome_trace(report)["traceEvents"]
    starts = [e for e in trace if e["ph"] == "s"]
    ends = [e for e in trace if e["ph"] == "f"]
    assert len(starts) == 2 and len(ends) == 2 and {e["pid"] for e in ends} == {2}, (starts, ends)
    assert sorted(e["name"] for e in trace if e.get("cat") == "step" and e["pid"] == 0) == ["step 0", "step 1"]
    [wait] = [e for e in trace if e.get("cat") == "hang"]
    assert wait["pid"] == 1 and wait["name"] == "waiting: all_reduce #2 on mesh_dp", wait
