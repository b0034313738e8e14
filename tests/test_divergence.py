"""Where a failing run departs (harness.analysis.divergence): the first module whose forward
output leaves the reference's, compared by what each rank holds (whole, a shard's chunk, a
partial's sum over the group), or the optimizer step when the gradients match and the update
does not. Unit checks on synthetic captures, then bundled bugs and a custom loop on real ranks,
each located where its bug is, and a correct run that gets no location."""

from __future__ import annotations

import json

import pytest
import torch

from cases.catalog import mlp_case
from harness.analysis.divergence import first_divergence_location
from harness.analysis.probe_checks import _reference_outputs
from harness.pipeline import diagnose_target
from harness.record.probe import OUTPUT, Capture, ProbeData
from harness.report import format_terminal
from harness.report.html import render_html

CASE = mlp_case()


class _Failed:
    """A comparison that failed (the location is only sought then)."""

    passed = False

    def failures(self) -> list:
        return []


def _probe(x: torch.Tensor, held: dict[int, dict[str, tuple[torch.Tensor, str | None]]]) -> ProbeData:
    order = ["fc1", "act", "dropout", "fc2", OUTPUT]
    ranks = []
    for rank, caps in held.items():
        captures = {name: Capture("Module", out, placements, placements is None or "Replicate" in placements)
                    for name, (out, placements) in caps.items()}
        ranks.append({"rank": rank, "mesh": {"tp": rank}, "groups": {"tp": sorted(held)}, "stages": None, "input": x,
                      "order": [n for n in order if n in captures], "captures": captures})
    return ProbeData(ranks)


def _column_then_row(ref: dict[str, torch.Tensor], *, fc1_dtensor: bool) -> dict[int, dict[str, tuple[torch.Tensor, str | None]]]:
    """What a correct 2-way TP MLP holds: fc1/act sharded on the features (a DTensor Shard(1) or
    a plain slice), fc2 a partial sum (halves of the whole) or the reduced whole."""
    held = {}
    for rank in (0, 1):
        shard = "(Shard(dim=1),)" if fc1_dtensor else None
        held[rank] = {
            "fc1": (ref["fc1"].chunk(2, 1)[rank].clone(), shard),
            "act": (ref["act"].chunk(2, 1)[rank].clone(), shard),
            "fc2": (ref["fc2"] / 2, "(Partial(sum),)") if fc1_dtensor else (ref["fc2"].clone(), None),
            OUTPUT: (ref[OUTPUT].clone(), None),
        }
    return held


@pytest.mark.parametrize("fc1_dtensor", [True, False], ids=["dtensor", "hand-sharded"])
def test_a_correct_tp_forward_has_no_location_and_a_changed_shard_is_found_on_its_rank(fc1_dtensor: bool) -> None:
    x = torch.randn(4, 8)
    ref = _reference_outputs(CASE, x)
    held = _column_then_row(ref, fc1_dtensor=fc1_dtensor)
    assert first_divergence_location(_Failed(), _probe(x, held), CASE) is None
    # Rank 1's half of the activation is normalised over its own features (a norm on a local shard).
    act = held[1]["act"][0]
    held[1]["act"] = (act / act.norm(dim=-1, keepdim=True), held[1]["act"][1])
    where = first_divergence_location(_Failed(), _probe(x, held), CASE)
    assert where is not None and (where["phase"], where["module"], where["rank"]) == ("forward", "act", 1), where
    assert where["compared"] == "chunk 1 of 2 along dim 1" and where["max_abs"] > where["tolerance"]["rtol"]
    assert "module 'act'" in where["line"] and "on rank 1" in where["line"]


def test_a_partial_sum_that_a_later_module_reduces_is_not_a_departure() -> None:
    x = torch.randn(4, 8)
    ref = _reference_outputs(CASE, x)
    held = _column_then_row(ref, fc1_dtensor=False)
    for rank in (0, 1):  # fc2's plain output before its all-reduce: halves that sum to the whole
        held[rank]["fc2"] = (ref["fc2"] / 2, None)
    assert first_divergence_location(_Failed(), _probe(x, held), CASE) is None
    held[0][OUTPUT] = (ref[OUTPUT] / 2, None)  # ...and never reduced: the model's output departs, fc2 is where
    where = first_divergence_location(_Failed(), _probe(x, held), CASE)
    assert where is not None and (where["module"], where["consumed_by"], where["rank"]) == ("fc2", "<model output>", 0), where
    assert "used unreduced" in where["line"] and where["partial_over"] == [0, 1]


def test_a_passed_comparison_gets_no_location_whatever_the_probe_holds() -> None:
    x = torch.randn(4, 8)
    ref = _reference_outputs(CASE, x)
    held = {0: {"fc1": (ref["fc1"] + 1.0, None)}}

    class Passed(_Failed):
        passed = True

    assert first_divergence_location(Passed(), _probe(x, held), CASE) is None
    assert first_divergence_location(_Failed(), _probe(x, held), CASE)["module"] == "fc1"


# -- real ranks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("target, phase, module, rank, op", [
    ("autocast_forward", "forward", "fc1", 0, "aten.addmm.default"),  # the first matmul under bfloat16 autocast
    # rank 0 draws the reference's mask, rank 1 its own: the draw itself
    ("tp_rank_seeded_dropout", "forward", "dropout", 1, "aten.bernoulli_.float"),
    ("optimizer_missing_params", "optimizer", "fc1.bias", None, "AdamW.step"),  # the gradients match; the biases never update
    # a row-parallel matmul inline in forward(): its bias add on an unreduced partial sum, found
    # by aligning the whole forward (the reference runs it in fc2)
    ("tests/custom_loops/tp_inline_row_parallel.py", "forward", "<model output>", 0, "aten.add.Tensor"),
])
def test_bundled_bugs_are_located_where_the_bug_is(rank_runner, reference_cache, tmp_path, target: str, phase: str,
                                                   module: str, rank: int | None, op: str) -> None:
    report = diagnose_target(target, runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    assert report.verdict.verdict == "fail"
    where = [d.evidence.get("first_divergent_op") for d in report.diagnoses]
    assert where and all(w is not None for w in where), report.verdict.to_dict()
    assert (where[0]["phase"], where[0]["module"], where[0]["rank"], where[0]["op"]) == (phase, module, rank, op), where[0]
    assert {"phase", "module", "op", "rank", "max_abs", "tolerance"} <= set(where[0])
    assert f"where: {where[0]['line']}" in format_terminal(report)
    assert "where it departs" in render_html(report)
    assert json.loads(json.dumps(report.to_json()))["diagnoses"][0]["evidence"]["first_divergent_op"]["module"] == module


def test_a_correct_tp_run_and_a_bug_the_forward_does_not_show_get_no_location(rank_runner, reference_cache, tmp_path) -> None:
    report = diagnose_target("tp", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "tp")
    assert report.verdict.verdict == "pass" and "first_divergent_op" not in json.dumps(report.to_json())
    # Gradients averaged twice: the forward is exact and the update follows the wrong gradients.
    report = diagnose_target("double_averaged_ddp", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "dd")
    assert report.codes == ["grad-double-averaged"]
    assert "first_divergent_op" not in report.diagnoses[0].evidence


DOUBLE_DECAY = '''
import torch
from cases.catalog import mlp_case
from cases.strategies.fsdp import FSDPStrategy

CASE = mlp_case("adamw")

class DoubleDecay(FSDPStrategy):
    name = "fsdp-double-decay"

    def optimizer_step(self, case, setup):
        super().optimizer_step(case, setup)
        with torch.no_grad():
            for p in setup.model.parameters():  # BUG: the decoupled weight decay again, on each shard
                p.mul_(1 - 0.01 * 0.01)

STRATEGY = DoubleDecay
'''


def test_weight_decay_applied_twice_to_shards_is_located_in_the_optimizer_step(rank_runner, reference_cache, tmp_path) -> None:
    target = tmp_path / "double_decay.py"
    target.write_text(DOUBLE_DECAY)
    report = diagnose_target(str(target), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    assert report.codes == ["numeric-mismatch"], report.verdict.to_dict()
    where = report.diagnoses[0].evidence["first_divergent_op"]
    assert (where["phase"], where["op"], where["step"]) == ("optimizer", "AdamW.step", 0), where
    assert "every gradient of step 0 matches" in where["line"]


@pytest.mark.parametrize("target, module", [("partial_grad_sync", "fc2"), ("double_averaged_ddp", None)])
def test_gradients_that_fail_in_part_are_located_and_a_scale_on_all_of_them_is_not(rank_runner, reference_cache, tmp_path,
                                                                                 target: str, module: str | None) -> None:
    # partial_grad_sync all-reduces the weight matrices' gradients only: the biases fail, fc2's
    # first in backward order, while the loss matches. Every gradient halved: no module.
    report = diagnose_target(target, runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    where = report.diagnoses[0].evidence.get("first_divergent_op")
    if module is None:
        assert where is None, where
    else:
        assert where is not None and (where["phase"], where["module"]) == ("backward", module), where
