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
from harness.analysis.probe_checks import _replay_reference
from harness.pipeline import diagnose_target
from harness.record.probe import OUTPUT, Capture, ProbeData, module_outputs, op_log
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
    ref = _replay_reference(CASE, x)[0]
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
    ref = _replay_reference(CASE, x)[0]
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
    ref = _replay_reference(CASE, x)[0]
    held = {0: {"fc1": (ref["fc1"] + 1.0, None)}}

    class Passed(_Failed):
        passed = True

    assert first_divergence_location(Passed(), _probe(x, held), CASE) is None
    assert first_divergence_location(_Failed(), _probe(x, held), CASE)["module"] == "fc1"


# -- the backward: module outputs' gradients ------------------------------------------------


class _GradsFailed(_Failed):
    """Step 0's loss matches and a gradient does not."""

    def __init__(self) -> None:
        from types import SimpleNamespace as T

        self.tensors = [T(step=0, kind="loss", passed=True, name="loss"), T(step=0, kind="grad", passed=False, name="fc1.weight")]

    def failures(self) -> list:
        return [t for t in self.tensors if not t.passed]


def _backward_probe(x: torch.Tensor, targets: torch.Tensor, grads: dict[int, dict[str, tuple[torch.Tensor, str | None]]],
                    order: list[str]) -> ProbeData:
    ref = _replay_reference(CASE, x)[0]
    held = _column_then_row(ref, fc1_dtensor=False)
    data = _probe(x, held)
    for entry in data.ranks:
        entry["targets"] = targets
        for name, (grad, placements) in grads[entry["rank"]].items():
            entry["captures"][name].grad, entry["captures"][name].grad_placements = grad, placements
        entry["grad_order"] = [n for n in order if n in grads[entry["rank"]]]
    return data


def test_the_backward_is_located_by_its_activation_gradients_up_to_the_ranks_loss_weight() -> None:
    x, targets = torch.randn(4, 8), torch.randn(4, 4)
    ref = _replay_reference(CASE, x, targets).grads
    order = list(ref)
    assert order[0] in (OUTPUT, "fc2") and order.index("fc2") < order.index("act") < order.index("fc1"), order

    def correct(weight: float) -> dict[int, dict[str, tuple[torch.Tensor, str | None]]]:
        # a 2-way TP MLP's gradients, each rank's loss weighted by ``weight``: fc1 / act sharded
        return {rank: {OUTPUT: (ref[OUTPUT] * weight, None), "fc2": (ref["fc2"] * weight, None),
                       "act": (ref["act"].chunk(2, 1)[rank] * weight, None), "fc1": (ref["fc1"].chunk(2, 1)[rank] * weight, None)}
                for rank in (0, 1)}

    assert first_divergence_location(_GradsFailed(), _backward_probe(x, targets, correct(0.5), order), CASE) is None
    # The gradient of fc2's input (act's output) split over the ranks (each rank's share of a
    # row-parallel backward): a sum no all-reduce completed.
    grads = correct(0.5)
    for rank, share in ((0, 0.3), (1, 0.7)):
        grads[rank]["act"] = (ref["act"] * 0.5 * share, None)
        grads[rank]["fc1"] = (ref["fc1"] * 0.5 * share, None)
    where = first_divergence_location(_GradsFailed(), _backward_probe(x, targets, grads, order), CASE)
    assert where is not None and (where["phase"], where["module"], where["grad_of"], where["partial_over"]) == \
        ("backward", "fc2", "act", [0, 1]), where
    assert where["loss_scale"] == pytest.approx(0.5) and "partial sum over the tensor-parallel group" in where["line"]
    # The same sum averaged instead: each rank holds the same half - not a piece awaiting its
    # all-reduce but a value scaled by 1/N, which departs.
    for rank in (0, 1):
        grads[rank]["act"] = (ref["act"] * 0.25, None)
    where = first_divergence_location(_GradsFailed(), _backward_probe(x, targets, grads, order), CASE)
    assert where is not None and (where["module"], where["grad_of"]) == ("fc2", "act") and "partial_over" not in where, where
    assert "holds 1/2 of it" in where["compared"]
    # Rank 1's gradient of fc1's output is off by more than rounding: it departs, after act's.
    grads = correct(1.0)
    grads[1]["fc1"] = (grads[1]["fc1"][0] + 0.1 * grads[1]["fc1"][0].abs().max() * torch.randn_like(grads[1]["fc1"][0]), None)
    where = first_divergence_location(_GradsFailed(), _backward_probe(x, targets, grads, order), CASE)
    assert where is not None and (where["module"], where["grad_of"], where["rank"]) == ("act", "fc1", 1), where
    assert "partial_over" not in where and "after the gradient of 'act'" in where["line"]


# -- the op inside the module ----------------------------------------------------------------
class _RMSNorm(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _NormMLP(torch.nn.Module):
    """The reference: fc1 -> an RMS norm over its 16 features -> fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(8, 16), _RMSNorm(), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x)))


class _ShardedNorm(torch.nn.Module):
    """The norm on this rank's 8 of the 16 features: right, with the other rank's sum of
    squares added (what an all-reduce gives), or the bug: the mean over the local shard."""

    def __init__(self, others: torch.Tensor | None) -> None:
        super().__init__()
        self.others = others

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.others is None:  # BUG: normalised over the local shard only
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * torch.rsqrt((x.pow(2).sum(-1, keepdim=True) + self.others) / 16 + 1e-6)


class _ShardedNormMLP(torch.nn.Module):
    """One rank of a hand-written 2-way tensor-parallel _NormMLP: fc1 column-parallel (8 rows),
    fc2 row-parallel with the other rank's partial sum added (its all-reduce)."""

    def __init__(self, ref: _NormMLP, rank: int, x: torch.Tensor, *, bug: bool) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.fc1.weight.copy_(ref.fc1.weight.chunk(2, 0)[rank])
            self.fc1.bias.copy_(ref.fc1.bias.chunk(2, 0)[rank])
            h = ref.fc1(x)
            others = h.chunk(2, 1)[1 - rank].pow(2).sum(-1, keepdim=True)
            normed = ref.norm(h)
            self.other_partial = normed.chunk(2, 1)[1 - rank] @ ref.fc2.weight.chunk(2, 1)[1 - rank].T
        self.norm = _ShardedNorm(None if bug else others)
        self.w2, self.b2 = ref.fc2.weight.chunk(2, 1)[rank].detach(), ref.fc2.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc1(x)) @ self.w2.T + self.other_partial + self.b2


def _norm_case():
    import functools

    import torch.nn.functional as F

    from cases.catalog import OPTIMIZERS
    from cases.data import SyntheticRegression
    from reference.case import Case

    return Case(name="norm-mlp", model_factory=functools.partial(_NormMLP), dataset=SyntheticRegression(64, 8, 4),
                loss_fn=F.mse_loss, optimizer_factory=OPTIMIZERS["sgd"], global_batch_size=16, steps=1)


def _sharded_probe(case, x: torch.Tensor, *, bug: bool) -> ProbeData:
    ranks = []
    for rank in (0, 1):
        model = _ShardedNormMLP(case.build_model("cpu"), rank, x, bug=bug)
        ops, (outs, _) = op_log(model, lambda: module_outputs(model, lambda: model(x), dtype=torch.float32, whole=OUTPUT))
        ranks.append({"rank": rank, "mesh": {"tp": rank}, "groups": {"tp": [0, 1]}, "stages": None, "input": x,
                      "order": list(outs), "captures": {n: Capture(type(model).__name__, t) for n, t in outs.items()},
                      "ops": ops})
    return ProbeData(ranks)


def test_a_norm_over_a_local_shard_is_located_at_its_mean_and_the_right_one_nowhere() -> None:
    case = _norm_case()
    x = torch.randn(4, 8)
    # The right sharded norm writes the mean as sum + add + div: aligned at the run's end, it matches.
    assert first_divergence_location(_Failed(), _sharded_probe(case, x, bug=False), case) is None
    where = first_divergence_location(_Failed(), _sharded_probe(case, x, bug=True), case)
    assert where is not None and (where["module"], where["op"], where["rank"]) == ("norm", "aten.mean.dim", 0), where
    assert where["compared"].startswith("whole; nor as a partial: its sum over the tensor-parallel group [0, 1]")
    assert "; op aligned exact" in where["compared"] and where["max_abs"] > where["module_max_abs"] / 100
    assert "op aten.mean.dim of module 'norm'" in where["line"]


def test_simulated_ranks_locate_the_op_as_real_ranks_do(reference_cache, tmp_path) -> None:
    from cases.catalog import transformer_case
    from harness.pipeline import simulate_target
    from harness.targets.target import Target
    from tests.test_simulate import RankSeededTP

    report = simulate_target(Target("bug", transformer_case(steps=1, layers=2, dropout=0.1), RankSeededTP()), 2,
                             workdir=tmp_path, cache=reference_cache)
    where = report.diagnoses[0].evidence["first_divergent_op"]
    assert (report.codes, where["module"], where["op"], where["rank"]) == (["rng-desync"], "dropout", "aten.bernoulli_.float", 1), where


def test_simulated_ranks_probe_a_later_failing_step_on_a_second_run(reference_cache, tmp_path) -> None:
    from cases.catalog import transformer_case
    from cases.strategies.tp import TensorParallelStrategy
    from harness.pipeline import simulate_target
    from harness.targets.target import Target

    class StaleMastersTP(StaleMasters, TensorParallelStrategy):
        name = "tp-stale-masters"

    # Step 0 matches (it starts from the initial weights either way); step 1 reads the stale
    # embedding first: the second simulated run probes step 1 and locates its first op.
    report = simulate_target(Target("stale", transformer_case(steps=2, layers=2), StaleMastersTP()), 2,
                             workdir=tmp_path, cache=reference_cache)
    where = report.diagnoses[0].evidence["first_divergent_op"]
    assert (report.codes, where["step"], where["module"], where["op"]) == \
        (["numeric-mismatch"], 1, "embed", "aten.embedding.default"), where


# -- real ranks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("target, phase, module, rank, op", [
    ("autocast_forward", "forward", "fc1", 0, "aten.addmm.default"),  # the first matmul under bfloat16 autocast
    # rank 0 draws the reference's mask, rank 1 its own: the draw itself
    ("tp_rank_seeded_dropout", "forward", "dropout", 1, "aten.bernoulli_.float"),
    ("optimizer_missing_params", "optimizer", "fc1.bias", None, "AdamW.step"),  # the gradients match; the biases never update
    # a row-parallel matmul inline in forward(): its bias add on an unreduced partial sum, found
    # by aligning the whole forward (the reference runs it in fc2)
    ("tests/custom_loops/tp_inline_row_parallel.py", "forward", "<model output>", 0, "aten.add.Tensor"),
    # its bias added on every rank before the all-reduce: that add, a partial that sums to the
    # reference's plus the bias
    ("tests/custom_loops/tp_inline_row_parallel.py:bias_before_reduce", "forward", "<model output>", 0, "aten.add.Tensor"),
    # a LayerNorm over features sharded by hand, normalised over each rank's half: its own op
    ("tests/custom_loops/tp_norm_on_local_shard.py", "forward", "blocks.0.norm", 0, "aten.native_layer_norm.default"),
    # a residual added a second time on the last TP rank, inline in the model's forward: the
    # norm after it departs on every rank (its statistics are all-reduced); the extra add, with
    # no counterpart in the reference, changed the value the matching add left - there, rank 1
    ("tests/custom_loops/tp_norm_on_local_shard.py:residual_twice", "forward", "<model output>", 1, "aten.add.Tensor"),
    # vocab-parallel cross entropy that lets the padded logit in: the forward matches up to the
    # model's output (the head's padded shard compared on its real rows), the loss does not
    # - and inside the loss (its ops against the reference's cross entropy decomposed), the sum
    # of exponentials over the rank's padded shard: a partial sum that no longer sums to the
    # reference's normaliser
    ("tests/custom_loops/vocab_parallel_padded_loss.py", "loss", "<loss>", 0, "aten.sum.dim_IntList"),
    # the target's logit read without the shard's offset: the normaliser (log of the summed
    # exponentials) still matches, the per-token loss built from the target's logit has no
    # counterpart, the loss's mean departs
    ("tests/custom_loops/vocab_parallel_padded_loss.py:target_not_offset", "loss", "<loss>", 0, "aten.mean.default"),
    # a loss that calls the same functions as the reference's and computes more after them: its
    # ops match up to nll_loss_forward, then the rank's extra ops (label smoothing; torch's own
    # loss_parallel() divided by the TP size) are the location, unpaired
    ("tests/custom_loops/loss_label_smoothing.py", "loss", "<loss>", 1, "aten.sum.dim_IntList"),
    # the same from the loop's own DataLoader: the input taken from the model call, the targets
    # from the samples run.loss names
    ("tests/custom_loops/loss_label_smoothing.py:own_loader", "loss", "<loss>", 1, "aten.sum.dim_IntList"),
    ("tests/custom_loops/tp_loss_parallel.py", "loss", "<loss>", 0, "aten.div.Tensor"),
    # a pipeline's later stage, against the reference replayed on the same micro-batch: the
    # activation sent in bfloat16 departs between the stages (stage 1's input against stage
    # 0's output), a GELU stage 1 applies on arrival at fc2 on rank 1 with the GELU named
    ("tests/custom_loops/pp_stage_boundary.py", "forward", "<input of pipeline stage 1>", 1, None),
    # Megatron-style vocab-parallel embedding whose out-of-range tokens are looked up at row 0
    # and never zeroed: the lookup's output is no partial of the reference's
    ("tests/custom_loops/vocab_parallel_embedding.py", "forward", "embed", 0, "aten.embedding.default"),
    ("tests/custom_loops/pp_stage_boundary.py:extra_activation", "forward", "fc2", 1, "aten.addmm.default"),
    # a loop with its own loader that adds unseeded noise to rank 1's inputs: before the model
    ("tests/custom_loops/unseeded_noise_on_one_rank.py", "input", "<model input>", 1, None),
    # a column-parallel layer whose input's gradient is never all-reduced (the "copy to the
    # tensor-parallel region" without its backward): the forward and the loss match, the
    # gradient of the norm's output is a partial sum - in the backward after 'blocks.1.up'
    # (the node: the hand-written Function's backward that passed the partial sum on)
    ("tests/custom_loops/tp_copy_grad_unreduced.py", "backward", "blocks.1.up", 0, "_CopyToRegionBackward"),
    # the same Function averaging over the group where it must sum: every rank holds half the
    # gradient - a departure at that node, which the reference has no counterpart of
    ("tests/custom_loops/tp_copy_grad_unreduced.py:averaged", "backward", "blocks.1.up", 0, "_CopyToRegionBackward"),
    # a sampler never told the epoch: step 4 reads the reference's step-0 batch again
    ("tests/custom_loops/no_set_epoch.py", "input", "<data>", None, None),
    # departures first visible after step 0, found by probing the first failing step on a second
    # run: stale master weights copied over step 0's update (step 1, the first layer's matmul),
    # a validation pass's model.eval() never undone (step 1, the first dropout, by its mode)
    ("tests/custom_loops/stale_master_weights.py", "forward", "fc1", 0, "aten.addmm.default"),
    ("tests/custom_loops/eval_mode_after_validation.py", "forward", "dropout", 0, "aten.bernoulli_.float"),
    # AdamW built with another eps on rank 1: the gradients agree and match, the replicas' copies
    # go apart at step 0; the comparison reads rank 0's (right) - the location reads each copy
    ("tests/custom_loops/optimizer_differs_on_one_rank.py", "optimizer", "fc1.weight", 1, "AdamW.step"),
    # a stale head behind five dropouts at step 1: their masks taken from the ranks
    ("tests/custom_loops/stale_head_behind_dropout.py", "forward", "head", 0, "aten.addmm.default"),
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
    if phase == "backward" and target.endswith(":averaged"):
        assert (where[0]["grad_of"], where[0]["unpaired"]) == ("blocks.1.norm", True) and "partial_over" not in where[0], where[0]
        assert report.codes == ["numeric-mismatch"], report.codes
    elif phase == "backward":
        assert (where[0]["grad_of"], where[0]["partial_over"], where[0]["partial_from"]) == \
            ("blocks.1.norm", [0, 1], "AddmmBackward0"), where[0]
    if target.endswith(("stale_master_weights.py", "eval_mode_after_validation.py")):
        assert where[0]["step"] == 1 and "of step 1" in where[0]["line"], where[0]
    if target.endswith("vocab_parallel_padded_loss.py"):
        assert where[0]["last_matched"]["op"] == "aten.exp.default" and "partial" in where[0]["op_compared"], where[0]
        assert "the first op of the loss beyond the rule: aten.sum.dim_IntList" in where[0]["line"]
    if target.endswith(":target_not_offset"):
        assert (where[0]["last_matched"]["op"], where[0]["unpaired_before"]) == ("aten.log.default", ["aten.sub.Tensor"]), where[0]
    if target.endswith(("loss_label_smoothing.py", "loss_label_smoothing.py:own_loader", "tp_loss_parallel.py")):
        assert report.codes == (["numeric-mismatch"] if "smoothing" in target else ["grad-scaled"]), report.codes
        assert where[0]["unpaired"] and where[0]["last_matched"]["op"] == "aten.nll_loss_forward.default", where[0]
        assert "after which the rank computes what the reference's loss has not" in where[0]["line"]
    if target.endswith("pp_stage_boundary.py"):
        assert (where[0]["stage_input"], where[0]["sent_by"]) == (True, 0) and "between pipeline stages" in where[0]["line"]
    if target.endswith(":residual_twice"):
        assert (where[0]["unpaired"], where[0]["inline_before"], where[0]["last_matched"]["op"]) == \
            (True, "blocks.1.norm", "aten.add.Tensor"), where[0]
    if target.endswith(":extra_activation"):
        assert where[0]["inline_unpaired"] == ["aten.gelu.default"], where[0]
    if target.endswith("eval_mode_after_validation.py"):
        assert where[0]["eval_mode"] and "never ran" in where[0]["line"], where[0]
    if module == "<data>":
        assert (where[0]["step"], where[0]["same_as_reference_step"]) == (4, 0) and "set_epoch" in where[0]["line"], where[0]


@pytest.mark.parametrize("target", ["tests/custom_loops/tp_norm_on_local_shard.py:correct",
                                    "tests/custom_loops/vocab_parallel_padded_loss.py:correct",
                                    "tests/custom_loops/loss_label_smoothing.py:correct",
                                    "tests/custom_loops/loss_label_smoothing.py:own_loader_correct",
                                    "tests/custom_loops/tp_loss_parallel.py:correct",
                                    "tests/custom_loops/pp_stage_boundary.py:correct",
                                    "tests/custom_loops/vocab_parallel_embedding.py:correct",
                                    "tests/custom_loops/stale_head_behind_dropout.py:correct",
                                    "tests/custom_loops/unseeded_noise_on_one_rank.py:seeded",
                                    "tests/custom_loops/tp_copy_grad_unreduced.py:correct",
                                    "tests/custom_loops/stale_master_weights.py:correct",
                                    "tests/custom_loops/eval_mode_after_validation.py:correct",
                                    "tests/custom_loops/optimizer_differs_on_one_rank.py:correct"])
def test_the_right_versions_of_the_held_out_bugs_pass_without_a_location(rank_runner, reference_cache, tmp_path, target: str) -> None:
    report = diagnose_target(target, runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    assert report.verdict.verdict == "pass" and "first_divergent_op" not in json.dumps(report.to_json()), report.verdict.to_dict()


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


class StaleMasters:
    """A strategy mixin that copies the first step's "master weights" over the parameters
    before every step (BUG: the masters never learn): step 0 matches, step 1 departs."""

    def forward_backward(self, case, setup, micro_batches):
        params = list(setup.model.parameters())
        if not hasattr(self, "masters"):
            self.masters = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, m in zip(params, self.masters):
                p.copy_(m)
        return super().forward_backward(case, setup, micro_batches)


STALE_MASTERS = '''
from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy
from tests.test_divergence import StaleMasters

CASE = mlp_case("adamw")

class StaleMastersDDP(StaleMasters, DDPStrategy):
    name = "ddp-stale-masters"

STRATEGY = StaleMastersDDP
'''


def test_a_strategy_whose_forward_departs_after_step_0_is_probed_at_that_step(rank_runner, reference_cache, tmp_path) -> None:
    target = tmp_path / "stale_masters.py"
    target.write_text(STALE_MASTERS)
    report = diagnose_target(str(target), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    assert report.verdict.verdict == "fail", report.verdict.to_dict()
    where = report.diagnoses[0].evidence["first_divergent_op"]
    assert (where["phase"], where["step"], where["module"], where["op"]) == ("forward", 1, "fc1", "aten.addmm.default"), where


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


def test_an_op_the_log_cannot_copy_is_skipped_and_never_fails_the_forward(monkeypatch) -> None:
    from harness.record.probe import OpLog

    def cannot_copy(self, func, out, *args):
        raise RuntimeError("a tensor subclass the log does not know")

    monkeypatch.setattr(OpLog, "_keep", cannot_copy)
    model = CASE.build_model("cpu")
    x = torch.randn(4, 8)
    ops, out = op_log(model, lambda: model(x))
    assert ops == [] and torch.equal(out, model(x))


def test_an_op_log_is_searched_by_identity_even_where_one_op_repeats_in_a_module() -> None:
    from harness.record.probe import OpCapture

    # Two adds in one module with outputs of one shape: equality by fields would compare the
    # tensors, whose truth value is ambiguous, and the search for the second would raise.
    first, second = (OpCapture("block", "aten.add.Tensor", torch.full((2, 2), v)) for v in (1.0, 2.0))
    assert [first, second].index(second) == 1 and first != second


def test_a_padded_shard_is_compared_on_its_real_rows() -> None:
    from harness.analysis.divergence.values import judge as _judge

    # A 31-row vocabulary padded to 32 over 2 ranks: rank 0 holds rows 0..15, rank 1 rows 16..30
    # and one pad row, whatever its value.
    whole = torch.randn(4, 31)
    held = {0: whole[:, :16].clone(), 1: torch.cat([whole[:, 16:], torch.full((4, 1), 7.0)], 1)}
    judged = {r: _judge(held[r], None, whole, r, [0, 1], lambda: None, 2e-3, 2e-4) for r in (0, 1)}
    assert [j.status for j in judged.values()] == ["within", "within"], judged
    assert judged[1].compared.startswith("rows 16..30 along dim 1")
    held[1][:, 3] += 1.0  # a real row off: it departs; the pad row is never the reference's
    assert _judge(held[1], None, whole, 1, [0, 1], lambda: None, 2e-3, 2e-4).status == "departs"
    # More than a padded split can hold (three ranks' worth on a 2-rank group): not compared.
    assert _judge(torch.randn(4, 48), None, whole, 1, [0, 1], lambda: None, 2e-3, 2e-4) is None


def test_a_local_max_or_sum_over_a_vocabulary_shard_is_a_partial_and_a_kept_dim_compares() -> None:
    from harness.analysis.divergence.values import judge as _judge

    # Each rank's max (and sum) over its half of the vocabulary, against the reference's over
    # the whole with keepdim=True: a partial that the all-reduce (MAX, SUM) completes.
    logits = torch.randn(6, 32)
    halves = logits.chunk(2, 1)
    local_max = {r: halves[r].amax(1) for r in (0, 1)}
    whole_max = logits.amax(1, keepdim=True)
    for r in (0, 1):
        judged = _judge(local_max[r], None, whole_max, r, [0, 1], lambda: local_max[0] + local_max[1], 2e-3, 2e-4,
                        group_max=lambda: torch.maximum(local_max[0], local_max[1]))
        assert (judged.status, judged.compared) == ("partial", "max over the tensor-parallel group [0, 1]"), judged
    local_sum = {r: halves[r].exp().sum(1) for r in (0, 1)}
    judged = _judge(local_sum[0], None, logits.exp().sum(1, keepdim=True), 0, [0, 1], lambda: local_sum[0] + local_sum[1],
                    2e-3, 2e-4, group_max=lambda: torch.maximum(local_sum[0], local_sum[1]))
    assert judged.status == "partial" and judged.compared.startswith("sum"), judged
    # A sum that gained a pad column's exp(0 - max) on one rank sums to the reference's by neither rule.
    padded = local_sum[1] + torch.exp(-logits.amax(1))
    judged = _judge(padded, None, logits.exp().sum(1, keepdim=True), 1, [0, 1], lambda: local_sum[0] + padded, 2e-3, 2e-4,
                    group_max=lambda: torch.maximum(local_sum[0], padded))
    assert judged.status == "departs" and "nor as a partial" in judged.compared, judged


def test_the_reference_loss_is_logged_decomposed_into_the_ops_a_hand_written_loss_uses() -> None:
    import torch.nn.functional as F

    from harness.record.probe import LOSS, loss_op_log

    x, y = torch.randn(6, 31), torch.randint(0, 31, (6,))
    ops = loss_op_log(lambda: F.cross_entropy(x, y))
    names = [o.op for o in ops]
    assert {o.module for o in ops} == {LOSS}
    for op in ("aten.amax.default", "aten.sub.Tensor", "aten.exp.default", "aten.sum.dim_IntList", "aten.log.default",
               "aten.gather.default", "aten.neg.default", "aten.div.Tensor"):
        assert op in names, names
    assert not any("log_softmax" in n or "nll_loss" in n for n in names), names
    assert torch.allclose(ops[-1].output, F.cross_entropy(x, y))


def test_the_probe_logs_the_loss_after_the_forward_until_the_backward_and_leaves_no_mode_behind() -> None:
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

    from harness.record.probe import LOSS, OUTPUT, ActivationProbe

    model = CASE.build_model("cpu")
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    probe = ActivationProbe()
    probe.attach([model])
    out = model(x)
    assert _get_current_dispatch_mode() is not None  # the op log goes on for the loss
    loss = F.mse_loss(out.tanh(), y)
    loss.backward()  # its ops are the backward's, not the loss's
    probe.end_loss_log()
    assert _get_current_dispatch_mode() is None
    probe.detach()
    in_loss = [o.op for o in probe.ops if o.module == LOSS]
    assert in_loss[0] == "aten.tanh.default" and "aten.mse_loss.default" in in_loss, in_loss
    assert not any("backward" in o.op for o in probe.ops) and len(in_loss) == 2, in_loss
    assert probe.captures[OUTPUT].output.shape == out.shape

    class UserMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    # A mode the user entered after the forward and still holds is never popped by the probe.
    probe = ActivationProbe()
    probe.attach([model])
    out = model(x)
    with UserMode() as mine:
        probe.end_loss_log()
        assert _get_current_dispatch_mode() is mine
        F.mse_loss(out, y)
    probe.detach()  # the user's mode is gone: the probe's leaves now
    assert _get_current_dispatch_mode() is None
    assert not any(o.module == LOSS and o.op == "aten.mse_loss.default" for o in probe.ops)


def test_a_later_steps_replay_takes_each_dropouts_mask_from_the_rank_and_names_draws_of_its_own() -> None:
    import torch.nn.functional as F
    from torch import nn

    from cases.catalog import transformer_case

    case = transformer_case("adamw", steps=2, layers=2, dropout=0.5)
    x = torch.randint(0, 32, (4, 8))
    plain = _replay_reference(case, x)
    masks = {n: torch.rand(plain.outputs[n].shape) > 0.5 for n in plain.outputs if n.endswith("dropout")}
    replay = _replay_reference(case, x, masks=masks)
    assert replay.masked == frozenset(masks) and not replay.own_draws
    block = "layers.0.mlp.dropout"
    inp = replay.outputs["layers.0.mlp.down"]
    assert torch.allclose(replay.outputs[block], inp * masks[block] / 0.5)

    class FunctionalDropout(nn.Module):  # a draw no module's mask can stand for
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            return F.dropout(self.lin(x), 0.5, self.training)

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = FunctionalDropout()

        def forward(self, x):
            return self.inner(x)

    import dataclasses

    functional = dataclasses.replace(mlp_case(), model_factory=Wrapped)
    assert _replay_reference(functional, torch.randn(2, 8), masks={}).own_draws == frozenset({"inner"})


def test_a_run_that_cannot_be_located_says_what_the_probe_lacked() -> None:
    from types import SimpleNamespace

    from harness.analysis.diagnose import _unlocated_because

    assert "no first forward" in _unlocated_because(None)
    assert "input" in _unlocated_because(SimpleNamespace(ranks=[{"input": None}, {"input": None}]))
    named = _unlocated_because(SimpleNamespace(ranks=[{"input": 1, "targets": None, "missing": "the samples [9] named in run.loss are not ids"}]))
    assert named.startswith("the samples [9]") and "cannot be replayed" in named
    assert "targets are unknown" in _unlocated_because(SimpleNamespace(ranks=[{"input": 1, "targets": None}]))
    assert _unlocated_because(SimpleNamespace(ranks=[{"input": 1, "targets": 2}])) == ""
