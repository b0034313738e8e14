"""harness.testing.assert_matches_reference in a real pytest session: a correct strategy
passes; a buggy one fails with the terminal diagnosis in the failure report and an HTML report
written to the report directory."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHECKS = """
import pytest
from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy
from cases.bugs.double_averaged_ddp import DoubleAveragedDDP
from harness.testing import assert_matches_reference


@pytest.mark.distributed(nproc=2)
def test_ddp_is_right(dist_ctx, tmp_path):
    result = assert_matches_reference(mlp_case(), DDPStrategy(), dist_ctx, steps=2, cache=tmp_path / "c")
    assert result.passed


@pytest.mark.distributed(nproc=2)
def test_double_averaged(dist_ctx, tmp_path):
    assert_matches_reference(mlp_case(), DoubleAveragedDDP(), dist_ctx, steps=2, cache=tmp_path / "c")
"""


def test_a_failing_check_prints_the_diagnosis_and_writes_html(pytester, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makepyfile(test_checks=CHECKS)
    reports = pytester.path / "out"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--harness-report-dir", str(reports), timeout=240)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAIL  grad-double-averaged*", "*every gradient is 1/2 of the reference's*", "*html report: *.html*"])
    written = sorted(p.name for p in reports.glob("*.html"))
    assert written == ["test_checks.py_test_double_averaged.html"]
    assert "grad-double-averaged" in (reports / written[0]).read_text()


def test_reports_go_next_to_junitxml_by_default(pytester, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makepyfile(test_checks=CHECKS)
    junit = pytester.path / "ci" / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--junitxml={junit}", "-k", "double", timeout=240)
    result.assert_outcomes(failed=1, deselected=1)
    assert [p.name for p in (junit.parent / "harness-reports").glob("*.html")] == ["test_checks.py_test_double_averaged.html"]
