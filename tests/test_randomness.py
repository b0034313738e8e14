"""Randomness is an input of the step: the reference replays the draws every rank made, so a
correct run with dropout passes under DDP, FSDP2, TP and a 2-D mesh whatever its seeding
convention; the draws themselves are judged: tensor-parallel peers must draw a replicated
tensor alike and a sharded one each from a generator of its own (``rng-desync`` otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.pipeline import run_and_diagnose
from harness.pipeline import diagnose_target

LOOPS = Path(__file__).resolve().parent / "custom_loops"


def _verdict(case, strategy, dist_ctx, tmp_path, reference_cache):
    run = run_and_diagnose(case, strategy, dist_ctx, workdir=tmp_path, cache=reference_cache)
    out = [(run.report.verdict.to_dict(), run.report.comparison.get("notes", [])) if dist_ctx.rank == 0 else None]
    torch.distributed.broadcast_object_list(out, src=0)
    return out[0]


def _replayed(notes) -> bool:
    return any(n.startswith("randomness replayed") for n in notes)


def _strategy(name):
    from cases.strategies import DDPStrategy, FSDPStrategy, TensorParallelStrategy

    return {"ddp": DDPStrategy, "fsdp": FSDPStrategy, "tp": TensorParallelStrategy}[name]()


@pytest.mark.distributed(nproc=2)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_dropout_passes_under_every_layout(dist_ctx, tmp_path, reference_cache, strategy) -> None:
    from cases.catalog import transformer_case

    verdict, notes = _verdict(transformer_case(dropout=0.1, steps=2, layers=2), _strategy(strategy), dist_ctx, tmp_path, reference_cache)
    assert verdict["verdict"] == "pass", verdict
    assert _replayed(notes), notes


@pytest.mark.distributed(nproc=4)
def test_dropout_passes_on_a_dp_by_tp_mesh(dist_ctx, tmp_path, reference_cache) -> None:
    from cases.catalog import transformer_case
    from cases.strategies import DDPTensorParallelStrategy

    verdict, notes = _verdict(transformer_case(dropout=0.1, steps=2, layers=2), DDPTensorParallelStrategy(tp=2), dist_ctx, tmp_path, reference_cache)
    assert verdict["verdict"] == "pass", verdict
    assert _replayed(notes), notes


def test_replicas_seeded_per_rank_pass(rank_runner, reference_cache, tmp_path) -> None:
    report = diagnose_target(str(LOOPS / "dropout_seed_per_rank.py"), runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    assert report.verdict.verdict == "pass", report.verdict.to_dict()
    assert _replayed(report.comparison["notes"]), report.comparison["notes"]


@pytest.mark.distributed(nproc=2)
def test_an_encoder_with_default_dropout_under_dp(dist_ctx, tmp_path, reference_cache) -> None:
    """BERT as its config ships: 0.1 dropout on hidden states and on attention probabilities."""
    pytest.importorskip("transformers")
    from cases.hf import hf_case
    from cases.strategies import DDPStrategy

    verdict, notes = _verdict(hf_case("bert", steps=2), DDPStrategy(), dist_ctx, tmp_path, reference_cache)
    assert verdict["verdict"] == "pass", verdict
    assert _replayed(notes), notes


@pytest.mark.distributed(nproc=2)
def test_an_encoder_under_tp_draws_its_heads_masks_per_rank(dist_ctx, tmp_path, reference_cache) -> None:
    """Under tensor parallelism each rank holds half of BERT's heads. Drawn from the one shared
    generator state, rank 1's heads repeat rank 0's attention-dropout masks: rng-desync, at the
    attention's dropout, with the fix. With a generator per rank for that region (Megatron's
    model-parallel RNG tracker) the run passes."""
    pytest.importorskip("transformers")
    from cases.hf import bert_tp_plan, hf_case
    from cases.strategies import TensorParallelStrategy

    case = hf_case("bert", steps=2)
    shared, _ = _verdict(case, TensorParallelStrategy(plan=bert_tp_plan()), dist_ctx, tmp_path / "shared", reference_cache)
    assert [d["code"] for d in shared["diagnoses"]] == ["rng-desync"], shared
    ev = shared["diagnoses"][0]["evidence"]
    assert ev["layout"] == "sharded along dim 1" and ev["shape"] == [8, 4, 8, 8] and ev["ranks"] == [0, 1], ev
    assert "modeling_bert.py" in ev["call_site"] and "generator" in ev["fix"], ev
    own, notes = _verdict(case, TensorParallelStrategy(plan=bert_tp_plan(), sharded_rng=["*.attention.self"]),
                          dist_ctx, tmp_path / "own", reference_cache)
    assert own["verdict"] == "pass", own
    assert _replayed(notes), notes


def test_tp_peers_drawing_a_replicated_mask_differently_are_rng_desync(rank_runner, reference_cache, tmp_path) -> None:
    report = diagnose_target("tp_rank_seeded_dropout", runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    assert report.codes == ["rng-desync"], report.verdict.to_dict()
