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
@pytest.mark.parametrize("model", ["bert", "bert-sdpa"])
def test_an_encoder_under_tp_draws_its_heads_masks_per_rank(dist_ctx, tmp_path, reference_cache, model) -> None:
    """Under tensor parallelism each rank holds half of BERT's heads. Drawn from the one shared
    generator state, rank 1's heads repeat rank 0's attention-dropout masks: rng-desync, at the
    attention's dropout, with the fix. With a generator per rank for that region (Megatron's
    model-parallel RNG tracker) the run passes. The same with transformers' default attention,
    SDPA, whose dropout is drawn inside the fused op."""
    pytest.importorskip("transformers")
    from cases.hf import bert_tp_plan, hf_case
    from cases.strategies import TensorParallelStrategy

    case = hf_case(model, steps=2)
    shared, _ = _verdict(case, TensorParallelStrategy(plan=bert_tp_plan()), dist_ctx, tmp_path / "shared", reference_cache)
    assert [d["code"] for d in shared["diagnoses"]] == ["rng-desync"], shared
    ev = shared["diagnoses"][0]["evidence"]
    assert ev["layout"] == "sharded along dim 1" and ev["shape"] == [8, 4, 8, 8] and ev["ranks"] == [0, 1], ev
    # Where the mask is drawn: BERT's own dropout, or transformers' SDPA integration.
    assert ("modeling_bert.py" if model == "bert" else "sdpa_attention.py") in ev["call_site"] and "generator" in ev["fix"], ev
    own, notes = _verdict(case, TensorParallelStrategy(plan=bert_tp_plan(), sharded_rng=["*.attention.self"]),
                          dist_ctx, tmp_path / "own", reference_cache)
    assert own["verdict"] == "pass", own
    assert _replayed(notes), notes


def test_tp_peers_drawing_a_replicated_mask_differently_are_rng_desync(rank_runner, reference_cache, tmp_path) -> None:
    report = diagnose_target("tp_rank_seeded_dropout", runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    assert report.codes == ["rng-desync"], report.verdict.to_dict()


def test_attention_ops_are_read_by_their_schema_and_fused_kernels_by_their_philox_state() -> None:
    """``dropout_p`` sits at another position in each attention op (after ``attn_mask`` or
    ``attn_bias`` in some): read by name, never a mask taken for the probability. A fused
    kernel's draw is its Philox seed and offset (the same on two ranks: the same mask); one
    that returns none is drawn-but-unreadable (None), never the attention's output."""
    from reference.draws import random_output

    aten = torch.ops.aten
    q = torch.randn(1, 2, 4, 8)
    mask = torch.ones(4, 4, dtype=torch.bool)
    seed, offset = torch.tensor(7), torch.tensor(12)
    assert random_output(aten.scaled_dot_product_attention.default, (q, q, q, mask, 0.1), {}, q) is None
    assert random_output(aten.scaled_dot_product_attention.default, (q, q, q, mask), {}, q) is False
    efficient = aten._scaled_dot_product_efficient_attention.default
    drawn = random_output(efficient, (q, q, q, None, True, 0.1), {}, (q, q, seed, offset))
    again = random_output(efficient, (q, q, q, None, True, 0.1), {}, (q + 1, q, seed.clone(), offset.clone()))
    other = random_output(efficient, (q, q, q, None, True, 0.1), {}, (q, q, seed, offset + 8))
    assert torch.equal(drawn, again) and not torch.equal(drawn, other)
    assert random_output(efficient, (q, q, q, None, True), {}, (q, q, seed, offset)) is False
    assert random_output(aten._flash_attention_forward.default, (q, q, q, None, None, 4, 4, 0.0), {}, (q, q, seed, offset, q)) is False
    assert random_output(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.1), {}, (q, q)) is None


def test_a_draw_no_one_can_read_is_said_plainly_not_judged() -> None:
    from types import SimpleNamespace

    from harness.analysis.diagnose import Analysis
    from harness.tracing.random_ops import RandomDraw

    fused = RandomDraw(0, "_scaled_dot_product_flash_attention_for_cpu", [1, 2, 4, 8], "float32", "", "/x/model.py:12 in forward")
    plain = RandomDraw(1, "bernoulli_", [1, 8], "float32", "ab12", "/x/model.py:20 in forward")
    fake = SimpleNamespace(trace=SimpleNamespace(ranks={0: SimpleNamespace(random_ops=[fused, plain])}), cmp=SimpleNamespace(notes=[]))
    Analysis._note_unreadable_draws(fake)
    [note] = fake.cmp.notes
    assert "_scaled_dot_product_flash_attention_for_cpu" in note and "not judged" in note and "bernoulli_" not in note, note
