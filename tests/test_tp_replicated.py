"""Tensors the tensor-parallel layout keeps replicated, on real ranks: a gradient computed from
sharded activations that nobody sums over the TP group is ``missing-grad-sync`` along tp (its
copies sum to the reference); copies that go apart inside one replica are
``replica-divergence`` inside the group; complete gradients all-reduced again over TP are a
scale with TP named. Each bug beside its correct twin, which passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.pipeline import run_and_diagnose
from harness.pipeline import diagnose_target

LOOPS = Path(__file__).resolve().parent / "custom_loops"


def _run(case, strategy, dist_ctx, tmp_path, reference_cache):
    """Every rank runs it; the verdict and diagnoses are broadcast from rank 0."""
    run = run_and_diagnose(case, strategy, dist_ctx, workdir=tmp_path, cache=reference_cache)
    outcome = [None]
    if dist_ctx.rank == 0:
        outcome = [run.report.verdict.to_dict()]
    torch.distributed.broadcast_object_list(outcome, src=0)
    return outcome[0]


def _codes(verdict: dict) -> list[str]:
    return [d["code"] for d in verdict["diagnoses"]]


@pytest.mark.distributed(nproc=2)
def test_per_head_norms_under_a_head_sharding_plan(dist_ctx, tmp_path, reference_cache) -> None:
    """Qwen3's q/k norms (one weight of head_dim shared by every head) stay replicated under
    the Llama-style plan while each rank holds half the heads: their gradients are partial
    sums. The plan alone leaves them so (named); summing them over tp passes."""
    pytest.importorskip("transformers")
    from cases.hf import hf_case, llama_tp_plan
    from cases.strategies import TensorParallelStrategy

    case = hf_case("qwen3", steps=2)
    bug = _run(case, TensorParallelStrategy(plan=llama_tp_plan()), dist_ctx, tmp_path / "bug", reference_cache)
    assert _codes(bug) == ["missing-grad-sync"], bug
    ev = bug["diagnoses"][0]["evidence"]
    assert ev["group"] == "tp" and ev["sums_to_reference"] is True and ev["step"] == 0, ev
    assert set(ev["params"]) == {f"model.layers.{i}.self_attn.{n}_norm.weight" for i in (0, 1) for n in "qk"}, ev["params"]
    ok = _run(case, TensorParallelStrategy(plan=llama_tp_plan(), sum_grads=["*.self_attn.[qk]_norm.weight"]),
              dist_ctx, tmp_path / "ok", reference_cache)
    assert ok["verdict"] == "pass", ok


@pytest.mark.distributed(nproc=2)
def test_complete_gradients_all_reduced_again_over_tp_are_a_scale_from_tp(dist_ctx, tmp_path, reference_cache) -> None:
    """The tiny transformer's norms get complete gradients on every TP rank; summing them over
    tp once more doubles them: a scale on those parameters, with TP as its source."""
    from cases.catalog import transformer_case
    from cases.strategies import TensorParallelStrategy

    verdict = _run(transformer_case(steps=2), TensorParallelStrategy(sum_grads=["layers.*_norm.*"]), dist_ctx, tmp_path, reference_cache)
    assert _codes(verdict) == ["grad-scaled"], verdict
    ev = verdict["diagnoses"][0]["evidence"]
    assert abs(ev["factor"] - 2.0) < 1e-3 and ev["partial"] is True, ev
    assert "tensor-parallel" in ev["likely_source"] and "again" in ev["likely_source"], ev


def test_sequence_parallel_norm_gradients_never_summed(rank_runner, reference_cache, tmp_path) -> None:
    """Hand-written sequence parallelism: the norms and the row-parallel bias run on each
    rank's positions; without Megatron's all-reduce of their gradients over tp they are partial
    sums, named with every such parameter; with it the loop passes."""
    path = LOOPS / "sp_norm_grads.py"
    bug = diagnose_target(str(path), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "bug")
    assert bug.codes == ["missing-grad-sync"], bug.verdict.to_dict()
    ev = bug.verdict.diagnoses[0].evidence
    assert ev["group"] == "tp" and ev["sums_to_reference"] is True, ev
    expected = {f"blocks.{i}.{n}" for i in (0, 1) for n in ("norm.weight", "norm.bias", "down.bias")} | {"norm.weight", "norm.bias"}
    assert set(ev["params"]) == expected, sorted(ev["params"])
    ok = diagnose_target(f"{path}:correct", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()


def test_replicated_weights_that_drift_apart_inside_the_tp_group(rank_runner, reference_cache, tmp_path) -> None:
    """Rank 0 alone updates the replicated bias and never broadcasts it: the copies differ
    after step 0 while every gradient of step 0 matched - named as divergence inside the tp
    group at that step, not as the gradient mismatches it causes later."""
    path = LOOPS / "tp_replicated_update.py"
    bug = diagnose_target(str(path), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "bug")
    assert bug.codes == ["replica-divergence"], bug.verdict.to_dict()
    ev = bug.verdict.diagnoses[0].evidence
    assert (ev["group"], ev["kind"], ev["step"]) == ("tp", "param", 0), ev
    assert list(ev["params"]) == ["fc2.bias"] and ev["params"]["fc2.bias"]["ranks"] == [0, 1], ev
    clipped = diagnose_target(f"{path}:clip_on_one_rank", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "clip")
    assert clipped.codes == ["replica-divergence"], clipped.verdict.to_dict()
    ev = clipped.verdict.diagnoses[0].evidence
    assert (ev["group"], ev["kind"], ev["step"]) == ("tp", "grad", 0), ev
    assert ev["params"]["fc2.bias"][0]["matches_reference"] == [1], ev  # rank 1's copy is the right one
    ok = diagnose_target(f"{path}:correct", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()
