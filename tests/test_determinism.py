"""The determinism gate (``--repeat N``): runs on fresh ranks compared bitwise per step, rank and
tensor. Unit checks of :func:`compare_repeats` on records written here (what it compares, the
order in which it names the first difference), then real ranks: correct targets repeat, an
unseeded random op on one rank and an arrival-order accumulation are named
``nondeterministic-run`` with the step, rank and tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.analysis.determinism import compare_repeats, pin_report
from harness.pipeline import diagnose_target
from harness.report.html import render_html
from reference.record import RecordWriter

LOOPS = Path(__file__).parent / "custom_loops"


def _record(path: Path, *, grad_of_rank1_step1: float = 2.0, loss_of_rank0_step1: float = 0.5,
            threads: int = 1) -> object:
    """A 2-step, 2-rank record in the recorder's shape: per-rank digests of local state, the
    ranks' layouts with their pins."""
    ranks = [{"rank": r, "dp_rank": r, "mesh": {"dp": r}, "pins": {"threads": threads, "deterministic_algorithms": False}}
             for r in range(2)]
    writer = RecordWriter(path, {"source": "t", "case": {"name": "x", "seed": 7}, "world_size": 2, "ranks": ranks})
    for step in range(2):
        rec = writer.step(step)
        rec.loss = 0.5
        rec.rank_sample_ids = {0: [[0, 1]], 1: [[2, 3]]}
        digests = {}
        for rank in range(2):
            grad = grad_of_rank1_step1 if (rank, step) == (1, 1) else 2.0
            loss = loss_of_rank0_step1 if (rank, step) == (0, 1) else 0.5
            digests[rank] = {"loss": [float(loss).hex()], "grad": {"w": f"g{grad}"}, "param": {"w": "p"}, "optim": {"w.step": "s"}}
        rec.extra["rank_digests"] = digests
        writer.add_tensor(step, "grad", "w", torch.full((2,), 2.0))
        writer.add_tensor(step, "param", "w", torch.ones(2))
    return writer.finish()


def test_identical_records_repeat_and_say_what_was_compared(tmp_path) -> None:
    outcome = compare_repeats(_record(tmp_path / "a"), _record(tmp_path / "b"))
    assert outcome.identical and outcome.diagnosis() is None
    assert outcome.compared["local-state"] == 2 * 2 * 3 and outcome.compared["gathered-state"] == 2 * 2
    assert outcome.pins["seed"] == 7 and outcome.pins["threads"] == 1 and outcome.pins_differ == []


def test_the_first_difference_is_the_earliest_in_the_order_a_step_happens(tmp_path) -> None:
    # Step 1 differs in rank 0's loss and in rank 1's gradient: the loss comes first (the
    # forward precedes the backward), whatever the rank numbers.
    a = _record(tmp_path / "a")
    b = _record(tmp_path / "b", grad_of_rank1_step1=3.0, loss_of_rank0_step1=0.25)
    outcome = compare_repeats(a, b)
    first = outcome.first
    assert (first.what, first.step, first.rank) == ("loss", 1, 0), first
    assert [(d.what, d.rank, d.kind, d.name) for d in outcome.differences] == [("loss", 0, "", ""), ("local-state", 1, "grad", "w")]
    found = outcome.diagnosis()
    assert found is not None and found.code == "nondeterministic-run"
    assert "step 1 on rank 0" in found.summary and found.evidence["first_difference"]["what"] == "loss"


def test_a_gradient_that_differs_on_one_rank_is_named_with_its_rank_and_tensor(tmp_path) -> None:
    outcome = compare_repeats(_record(tmp_path / "a"), _record(tmp_path / "b", grad_of_rank1_step1=3.0))
    first = outcome.first
    assert (first.what, first.step, first.rank, first.kind, first.name) == ("local-state", 1, 1, "grad", "w")


def test_pins_that_differ_between_runs_are_reported(tmp_path) -> None:
    outcome = compare_repeats(_record(tmp_path / "a"), _record(tmp_path / "b", threads=4))
    assert outcome.identical and outcome.pins_differ == ["threads"]
    assert pin_report(_record(tmp_path / "c"))["layout"] == {0: {"dp_rank": 0, "mesh": {"dp": 0}}, 1: {"dp_rank": 1, "mesh": {"dp": 1}}}


def test_a_correct_target_repeats_bitwise_on_fresh_ranks(rank_runner, reference_cache, tmp_path) -> None:
    report = diagnose_target("ddp", runner=rank_runner, cache=reference_cache, workdir=tmp_path, repeat=2)
    assert report.verdict.verdict == "pass", report.verdict.to_dict()
    repeat = report.to_json()["repeat"]
    assert repeat["identical"] and repeat["runs"] == 2 and len(repeat["workdirs"]) == 2
    # Everything the gate promises was compared: per-rank losses and local state, the gathered
    # record, the collective order.
    assert all(repeat["compared"][what] > 0 for what in ("loss", "samples", "local-state", "gathered-state", "collectives"))
    assert repeat["pins"]["world_size"] == 2 and "threads" in repeat["pins"]
    from harness.report import format_terminal, render_html

    assert "repeat: 2 runs on fresh ranks bitwise identical" in format_terminal(report)
    html = render_html(report)
    assert "Repeated runs, bitwise" in html and "bitwise identical" in html


def test_an_unseeded_random_op_on_one_rank_is_named_at_that_ranks_first_loss(rank_runner, reference_cache, tmp_path) -> None:
    path = LOOPS / "unseeded_noise_on_one_rank.py"
    bug = diagnose_target(str(path), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "bug", repeat=2)
    assert "nondeterministic-run" in bug.codes, (bug.verdict.to_dict(), bug.repeat)
    found = next(d for d in bug.diagnoses if d.code == "nondeterministic-run")
    first = found.evidence["first_difference"]
    assert (first["what"], first["step"], first["rank"]) == ("loss", 0, 1), first
    assert found.evidence["pins"]["seed"] == 0 and "deterministic_algorithms" in found.evidence["pins"]
    # With magnitudes: the rank's two losses, how far apart; the categories read; both runs drawn.
    assert found.evidence["magnitude"]["of"] == "the rank's loss" and found.evidence["magnitude"]["max_abs"] > 0, found.evidence
    assert found.evidence["differ"]["samples"] == 0 and found.evidence["differ"]["loss"] >= 1, found.evidence["differ"]
    assert len(bug.repeat["losses"]) == 2 and "run 2 - run 1" in render_html(bug)
    ok = diagnose_target(f"{path}:seeded", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "ok", repeat=2)
    assert ok.verdict.verdict == "pass" and ok.repeat["identical"], (ok.verdict.to_dict(), ok.repeat)


def test_a_repeat_that_is_not_a_positive_count_is_refused() -> None:
    from harness.targets.target import TargetError

    with pytest.raises(TargetError, match="repeat must be an int >= 1"):
        diagnose_target("ddp", repeat=0)


def test_the_collective_order_is_compared_by_what_was_asked_not_where_it_was_filed(tmp_path) -> None:
    from harness.tracing.records import CollectiveRecord
    from harness.tracing.run_trace import RankTrace, RunTrace

    def trace(reduce_op: str, step_of_second: int) -> RunTrace:
        ops = [CollectiveRecord(rank=1, index=0, op="allreduce", group="0", group_ranks=[0, 1], shapes=[[2]], reduce_op="sum", step=0),
               CollectiveRecord(rank=1, index=1, op="allreduce", group="0", group_ranks=[0, 1], shapes=[[2]], reduce_op=reduce_op,
                                step=step_of_second)]
        return RunTrace(ranks={1: RankTrace(rank=1, world_size=2, collectives=ops)})

    a, b = _record(tmp_path / "a"), _record(tmp_path / "b")
    assert compare_repeats(a, b, trace("sum", 0), trace("sum", 1)).identical  # filed under another step only
    outcome = compare_repeats(a, b, trace("sum", 0), trace("avg", 0))
    first = outcome.first
    assert (first.what, first.rank, first.name, first.step) == ("collectives", 1, "op #1", 0), first
    assert outcome.compared["collectives"] == 2
