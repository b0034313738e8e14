"""The resume check (``--resume-at K``, ``assert_resumes``): a checkpoint saved by one run after
step K-1 (DCP), loaded on fresh ranks of the same or another layout, gated bitwise, then the
continuation compared with the uninterrupted run. Unit checks of the chunk-permutation test,
then real ranks: FSDP2 resumes into the same layout (bitwise), TP, FSDP2 + TP on 4, FSDP2 on 4
(slow) and the plain model on one process; per-rank RNG that cannot map to another world size
is reported as not transferable; the bundled bug cases are each named by
tests/test_diagnose.py, and two of them again here through pytest's ``assert_resumes``."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy
from cases.strategies.fsdp import FSDPStrategy
from harness import assert_resumes
from harness.analysis.resume import chunk_permutation
from harness.pipeline import diagnose_target
from harness.report import format_terminal
from harness.report.html import render_html
from harness.targets.target import TargetError


# -- the permutation test -------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(chunks=st.integers(2, 6), rows=st.integers(1, 3), cols=st.integers(1, 4), data=st.data())
def test_chunks_in_another_order_are_found_with_their_order(chunks: int, rows: int, cols: int, data: st.DataObject) -> None:
    saved = torch.randn(chunks * rows, cols)
    order = data.draw(st.permutations(range(chunks)))
    loaded = torch.cat([saved.chunk(chunks, 0)[j] for j in order])
    found = chunk_permutation(saved, loaded)
    if list(order) == list(range(chunks)):
        assert found is None
    else:
        assert found is not None and found["dim"] == 0
        # The fewest chunks that explain it: reassembling the saved chunks in that order gives the loaded tensor.
        pieces = saved.chunk(found["chunks"], 0)
        assert torch.equal(torch.cat([pieces[j] for j in found["order"]]), loaded)


def test_a_changed_value_is_no_permutation() -> None:
    saved = torch.arange(8.0).reshape(4, 2)
    loaded = saved.flip(0).clone()
    loaded[0, 0] += 1e-6
    assert chunk_permutation(saved, loaded) is None
    assert chunk_permutation(saved, saved.clone()) is None


# -- what is refused before any rank starts ---------------------------------------------------
def test_resume_arguments_that_cannot_work_are_refused_with_the_allowed_values() -> None:
    with pytest.raises(TargetError, match=r"allowed 1\.\.2"):
        diagnose_target("fsdp", resume_at=3)
    with pytest.raises(TargetError, match="need resume_at"):
        diagnose_target("fsdp", resume_into="tp")
    with pytest.raises(TargetError, match="custom loop"):
        diagnose_target("custom-example", resume_at=1)
    with pytest.raises(TargetError, match="same case"):
        diagnose_target("fsdp", resume_at=1, resume_into="ddp")  # the MLP, not the transformer
    with pytest.raises(TargetError, match="one at a time"):
        diagnose_target("fsdp", resume_at=1, repeat=2)


def test_the_cli_refuses_resume_flags_it_cannot_honour(capsys) -> None:
    from harness import cli

    assert cli.main(["diagnose", "fsdp", "--resume-into", "tp"]) == 2
    assert "--resume-at" in capsys.readouterr().err
    assert cli.main(["diagnose", "fsdp", "--resume-at", "0"]) == 2
    assert cli.main(["diagnose", "fsdp", "--resume-at", "1", "--simulate", "2"]) == 2


# -- real ranks ---------------------------------------------------------------------------------
def test_fsdp_resumes_bitwise_on_its_own_layout(rank_runner, reference_cache, tmp_path) -> None:
    report = diagnose_target("fsdp", steps=4, resume_at=2, runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    resume = report.resume
    assert report.verdict.verdict == "pass", (report.verdict.to_dict(), resume)
    assert resume["load_exact"] and resume["same_layout"] and resume["passed"]
    assert resume["continuation"] == {"compared": "bitwise", "last_step": 3}
    # Everything the gate compares was compared: every tensor of the model and optimizer, the
    # param groups, both ranks' RNG, the first resumed batch.
    assert resume["compared"]["param"] > 0 and resume["compared"]["optim"] == 3 * resume["compared"]["param"]
    assert resume["compared"]["ranks"] == 2 and resume["compared"]["samples"] == 8
    assert (tmp_path / "checkpoint" / "manifest.json").is_file()
    assert json.loads(json.dumps(report.to_json()))["resume"]["at"] == 2
    text = format_terminal(report)
    assert "load gate exact" in text and "bitwise equal to the uninterrupted run" in text
    assert "Resumed from a checkpoint" in render_html(report)


@pytest.mark.parametrize("into, nproc", [("tp", 2), ("plain", 1), ("fsdp-tp", 4),
                                         pytest.param("fsdp", 4, marks=pytest.mark.slow)])
def test_fsdp_on_2_resumes_into_another_layout(rank_runner, reference_cache, tmp_path, into: str, nproc: int) -> None:
    report = diagnose_target("fsdp", resume_at=2, resume_into=into, resume_nproc=nproc, runner=rank_runner,
                             cache=reference_cache, workdir=tmp_path)
    resume = report.resume
    assert report.verdict.verdict == "pass", (report.verdict.to_dict(), resume)
    assert resume["load_exact"] and not resume["same_layout"] and resume["world"] == nproc
    assert resume["into"]["target"] == into
    assert resume["continuation"]["compared"] == "stepwise tolerance"
    assert "first_difference" not in resume["continuation"]


PER_RANK_DROPOUT = '''
import torch
from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy

CASE = mlp_case("adamw", dropout=0.1)

class PerRankDropout(DDPStrategy):
    """Data parallelism with each replica's own dropout stream (seed + rank), as many loops do."""
    name = "ddp-per-rank-dropout"

    def setup(self, case, ctx):
        setup = super().setup(case, ctx)
        self.rank = ctx.rank
        return setup

    def forward_backward(self, case, setup, micro_batches):
        if not getattr(self, "seeded", False):
            torch.manual_seed(case.seed + 1000 * (self.rank + 1))
            self.seeded = True
        return super().forward_backward(case, setup, micro_batches)

STRATEGY = PerRankDropout
'''


def test_per_rank_rng_is_reported_not_transferable_to_another_world_size(rank_runner, reference_cache, tmp_path) -> None:
    target = tmp_path / "per_rank_dropout.py"
    target.write_text(PER_RANK_DROPOUT)
    report = diagnose_target(str(target), resume_at=2, resume_into=str(target), resume_nproc=1, runner=rank_runner,
                             cache=reference_cache, workdir=tmp_path / "run")
    resume = report.resume
    assert [n["state"] for n in resume["not_transferable"]] == ["rng"], resume
    assert resume["not_transferable"][0]["saved_world"] == 2 and resume["not_transferable"][0]["world"] == 1
    assert "not transferable to 1 ranks: rng" in format_terminal(report)
    # What can map did: the model, the optimizer, the scheduler-free param groups, the data.
    assert not [d for d in resume["gate"] if d["code"] != "resume-rng-not-restored"], resume["gate"]


@pytest.mark.distributed(nproc=2)
def test_assert_resumes_passes_a_correct_resume_into_another_strategy(dist_ctx, reference_cache) -> None:
    check = assert_resumes(mlp_case("adamw", steps=4), DDPStrategy(), dist_ctx, at=2, into=FSDPStrategy(), cache=reference_cache)
    assert check.passed and check.load_exact and not check.same_layout
    assert check.continuation["compared"] == "stepwise tolerance"


@pytest.mark.distributed(nproc=2)
def test_assert_resumes_fails_with_the_named_load_bug(dist_ctx, reference_cache) -> None:
    from cases.bugs.resume_step_counters_reset import CASE, StepCountersReset

    with pytest.raises(AssertionError) as failed:
        assert_resumes(CASE, StepCountersReset(), dist_ctx, at=2, cache=reference_cache)
    message = str(failed.value)
    assert "resume-step-reset" in message and "saved 2.0, loaded 0.0" in message
    assert "html report:" in message
