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


FAILS_MIDWAY = """
import torch.distributed as dist
import pytest
from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy
from harness.testing import assert_matches_reference


class StopsAtStep2(DDPStrategy):
    def __init__(self, how):
        super().__init__()
        self.how, self.steps_done = how, 0

    def optimizer_step(self, case, setup):
        super().optimizer_step(case, setup)
        self.steps_done += 1
        if self.steps_done == 2 and self.how == "raise":
            raise RuntimeError("my strategy broke at step 2")
        if self.steps_done == 2 and self.how == "hang" and dist.get_rank() == 0:
            dist.barrier()  # only rank 0: rank 1 goes on into the next step's collectives


@pytest.mark.distributed(nproc=2, timeout=60)
@pytest.mark.parametrize("how", ["raise", "hang"])
def test_midway(dist_ctx, tmp_path, how):
    assert_matches_reference(mlp_case("sgd"), StopsAtStep2(how), dist_ctx, steps=3, cache=tmp_path / "c")


@pytest.mark.distributed(nproc=2, timeout=60)
def test_own_check(dist_ctx, tmp_path):
    from cases.bugs.double_averaged_ddp import DoubleAveragedDDP
    from harness.run import run_strategy

    result = run_strategy(mlp_case("sgd"), DoubleAveragedDDP(), dist_ctx, steps=2, workdir=tmp_path / "mine", cache=tmp_path / "c")
    assert result.comparison.passed, "my own check of the comparison"
"""


def test_a_check_that_raises_or_hangs_midway_names_its_steps_and_writes_html(pytester, monkeypatch) -> None:
    """assert_matches_reference that raises (the user's error) or hangs after step 1: the
    failure names the folder holding the 2 recorded steps, and an HTML report of them is
    written - the user's exception stays the verdict's lead."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makepyfile(test_midway=FAILS_MIDWAY)
    reports = pytester.path / "out"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--harness-report-dir", str(reports),
                                           "--dist-stall-window", "3", timeout=240)
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    # Raised: the ranks' recorders publish step 0 and step 1's gradients. Hung in step 1's
    # optimizer step and killed: step 0, checkpointed, is in the unfinished record.
    for how, recorded in (("raise", "parallel record: "), ("hang", "unfinished record, 1 step done before the ranks were stopped")):
        start = out.index(f"test_midway[{how}] _")
        section = out[start:out.find("\n_____", start + 1)]
        assert "recorded before the failure" in section, section
        assert recorded in section, section
        assert "html report: " in section
    assert "(2 steps, incomplete)" in out
    assert "RuntimeError: my strategy broke at step 2" in out
    # The test's own assertion on run_strategy(workdir=...): its record folder and an HTML
    # report of the comparison are named beside the user's message.
    start = out.index("test_own_check _")
    section = out[start:out.find("\n_____", start + 1)]
    assert "my own check of the comparison" in section and "parallel record: " in section and "/mine/" in section, section
    assert "(2 steps, complete)" in section and "html report: " in section, section
    html = {p.name: p.read_text() for p in reports.glob("*.html")}
    assert sorted(html) == ["test_midway.py_test_midway_hang.html", "test_midway.py_test_midway_raise.html",
                            "test_midway.py_test_own_check.html"], sorted(html)
    assert "my strategy broke at step 2" in html["test_midway.py_test_midway_raise.html"]
    assert "collective-missing" in html["test_midway.py_test_midway_hang.html"]
    assert "all_reduce" in html["test_midway.py_test_midway_hang.html"]  # the ranks' collectives, from their dumps
    assert "MISMATCH" in html["test_midway.py_test_own_check.html"]  # the comparison's failing tensors


CUSTOM_LOOPS = """
import pytest
import torch.distributed as dist
from cases.catalog import mlp_case
from cases.custom_example import train
from harness import RankLayout, assert_matches_reference


def summed(ctx, run):  # the custom example without the division by the world size
    case = run.case
    model = case.build_model(ctx.device)
    optimizer = case.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = case.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)
        for p in model.parameters():
            dist.all_reduce(p.grad)
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


@pytest.mark.distributed(nproc=2)
def test_custom_loop_is_right(dist_ctx, tmp_path):
    result = assert_matches_reference(mlp_case("adamw"), train, dist_ctx, steps=2, cache=tmp_path / "c")
    assert result.passed and result.strategy == "custom"


@pytest.mark.distributed(nproc=2)
def test_custom_loop_sums(dist_ctx, tmp_path):
    assert_matches_reference(mlp_case("adamw"), summed, dist_ctx, steps=2, cache=tmp_path / "c")
"""


def test_a_custom_loop_is_checked_like_a_strategy(pytester, monkeypatch) -> None:
    """A ``train(ctx, run)`` loop passed where the strategy goes: the same pipeline, the same
    failure (terminal diagnosis, HTML report)."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makepyfile(test_loops=CUSTOM_LOOPS)
    reports = pytester.path / "out"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--harness-report-dir", str(reports), timeout=240)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAIL  grad-not-averaged*", "*html report: *.html*"])
    assert sorted(p.name for p in reports.glob("*.html")) == ["test_loops.py_test_custom_loop_sums.html"]
