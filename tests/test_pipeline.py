"""Pipeline parallelism (``torch.distributed.pipelining``) checked against the single-device
reference, alone and composed with data and tensor parallelism, and two pipeline mistakes the
comparison must catch."""

from __future__ import annotations

import pytest
import torch

from cases import transformer_case
from cases.models import TinyTransformer
from cases.strategies import PipelineStrategy, balanced_stage_layers, pipeline_stage_model
from harness.record.gather import StageCoverageError
from harness.parallel_dims import ParallelConfigError, ParallelDims
from harness.run import run_strategy
from reference import Record


def _all_kinds_compared(result, steps: int = 3) -> bool:
    kinds = {(t.kind, t.step) for t in result.comparison.tensors}
    return kinds == {(k, s) for k in ("loss", "grad", "param", "optim") for s in range(steps)}


# -- correct pipelines ------------------------------------------------------------------------


@pytest.mark.distributed(nproc=2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_matches_the_reference(dist_ctx, tmp_path, reference_cache, schedule: str) -> None:
    case = transformer_case(micro_batches=4)
    result = run_strategy(case, PipelineStrategy(schedule), dist_ctx, workdir=tmp_path, cache=reference_cache)
    assert result.passed, result.summary()
    assert _all_kinds_compared(result)
    assert {t.name for t in result.comparison.tensors if t.kind == "loss"} == {"loss", *(f"micro.{m}" for m in range(4))}
    if dist_ctx.rank == 0:
        record = Record.load(result.record_path)
        assert [(r["stages"], r["holds_loss"]) for r in record.meta["ranks"]] == [([0], False), ([1], True)]
        step = record.step(0)
        # Both stages consumed the same 4 micro-batches: the whole global batch, in order.
        assert step.rank_sample_ids[0] == step.rank_sample_ids[1] == step.micro_sample_ids
        assert len(step.micro_sample_ids) == 4 and sorted(step.sample_ids) == sorted(i for m in step.micro_sample_ids for i in m)


@pytest.mark.slow  # 4 ranks; the 2-stage schedules run in the default suite, dp x pp on 4 too
@pytest.mark.distributed(nproc=4)
def test_four_stage_1f1b_matches_the_reference(dist_ctx, tmp_path, reference_cache) -> None:
    result = run_strategy(transformer_case(micro_batches=4), PipelineStrategy("1f1b"), dist_ctx, workdir=tmp_path, cache=reference_cache)
    assert result.passed, result.summary()
    assert _all_kinds_compared(result)


@pytest.mark.distributed(nproc=4)
@pytest.mark.parametrize("dp_mode", ["fsdp", "ddp"])
def test_dp_x_pp_matches_the_reference(dist_ctx, tmp_path, reference_cache, dp_mode: str) -> None:
    # 2 replicas of a 2-stage pipeline, each replica running 2 micro-batches of 2 samples.
    strategy = PipelineStrategy("1f1b", pp=2, dp_mode=dp_mode)
    result = run_strategy(transformer_case(micro_batches=2), strategy, dist_ctx, workdir=tmp_path, cache=reference_cache)
    assert result.passed, result.summary()
    assert _all_kinds_compared(result)
    if dist_ctx.rank == 0:
        record = Record.load(result.record_path)
        ranks = record.meta["ranks"]
        assert [(r["mesh"]["pp"], r["mesh"]["dp"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [r["groups"]["dp"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        by_rank = record.step(0).rank_sample_ids
        assert by_rank[0] == by_rank[2] and by_rank[1] == by_rank[3]  # one pipeline, one batch
        assert not {i for m in by_rank[0] for i in m} & {i for m in by_rank[1] for i in m}


@pytest.mark.slow
@pytest.mark.distributed(nproc=8, timeout=300)
def test_dp_x_tp_x_pp_matches_the_reference(dist_ctx, tmp_path, reference_cache) -> None:
    strategy = PipelineStrategy("1f1b", pp=2, tp=2)
    result = run_strategy(transformer_case(micro_batches=2), strategy, dist_ctx, workdir=tmp_path, cache=reference_cache)
    assert result.passed, result.summary()
    assert _all_kinds_compared(result)
    if dist_ctx.rank == 0:
        ranks = Record.load(result.record_path).meta["ranks"]
        assert [r["holds_loss"] for r in ranks] == [False] * 4 + [True, False, True, False]
        assert ranks[5]["mesh"] == {"pp": 1, "dp": 0, "tp": 1} and ranks[5]["groups"]["tp"] == [4, 5]


# -- configuration errors (no ranks needed) ---------------------------------------------------


def test_1f1b_needs_at_least_pp_micro_batches() -> None:
    with pytest.raises(ParallelConfigError, match=r"1F1B schedule needs micro_batches >= pp stages, got micro_batches=2 < pp=4"):
        PipelineStrategy("1f1b").check_case(transformer_case(micro_batches=2), ParallelDims(pp=4))
    PipelineStrategy("gpipe").check_case(transformer_case(micro_batches=2), ParallelDims(pp=4))  # GPipe has no such bound


def test_bad_pipeline_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule 'interleaved'; allowed: gpipe, 1f1b"):
        PipelineStrategy("interleaved")  # type: ignore[arg-type]
    with pytest.raises(ParallelConfigError, match="layer count 4 is not divisible by pp=3"):
        balanced_stage_layers(4, 0, 3)
    with pytest.raises(ParallelConfigError, match="needs pp >= 2 stages"):
        PipelineStrategy("gpipe", pp=1).dims(2)
    with pytest.raises(ParallelConfigError, match="dp_mode='ddp' cannot be combined with tp > 1"):
        PipelineStrategy("gpipe", tp=2, dp_mode="ddp")


def test_stages_keep_the_reference_names_and_cover_the_model_once() -> None:
    full = [n for n, _ in TinyTransformer().named_parameters()]
    stages = [[n for n, _ in pipeline_stage_model(TinyTransformer(), s, 2).named_parameters()] for s in range(2)]
    assert {"embed.weight", "pos"} <= set(stages[0]) and {"norm.weight", "head.weight"} <= set(stages[1])
    assert not {"embed.weight", "pos"} & set(stages[1]) and not {"norm.weight", "head.weight"} & set(stages[0])
    assert not any(n.startswith("layers.2") for n in stages[0]) and not any(n.startswith("layers.1") for n in stages[1])
    assert sorted(stages[0] + stages[1]) == sorted(full)
    assert TinyTransformer()(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 32)


# -- pipeline mistakes the comparison must catch ---------------------------------------------


class UnscaledPipeline(PipelineStrategy):
    """Forgets that the schedule sums the micro-batch gradients of a *mean* loss: no division
    by the micro-batch count (``scale_grads=False``), so every gradient is m x the reference's."""

    def build_schedule(self, stage, n_microbatches, loss_fn):
        from torch.distributed.pipelining import ScheduleGPipe

        return ScheduleGPipe(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


class LayerSkippingPipeline(PipelineStrategy):
    """A hand-written split that gives stage 0 only layer 0 and stage 1 layers 2-3: layer 1 is
    on no stage (the model still runs, one block short)."""

    def stage_layers(self, num_layers, stage, num_stages):
        return [0] if stage == 0 else [2, 3]


@pytest.mark.distributed(nproc=2)
def test_micro_batch_loss_not_averaged_is_caught(dist_ctx, tmp_path, reference_cache) -> None:
    result = run_strategy(transformer_case(micro_batches=4), UnscaledPipeline("gpipe"), dist_ctx, workdir=tmp_path, cache=reference_cache)
    assert not result.passed
    comparison = result.comparison
    # Losses are computed before the scaling, so they still match; every gradient is 4 x.
    assert all(t.passed for t in comparison.tensors if t.kind == "loss")
    grads = [t for t in comparison.tensors if t.kind == "grad" and t.step == 0]
    assert grads and all(not t.passed and t.scale == pytest.approx(4.0, rel=1e-3) for t in grads)
    assert comparison.first_divergence.step == 0 and comparison.first_divergence.entries[0][0] == "grad"


@pytest.mark.distributed(nproc=2)
def test_stage_split_that_skips_a_layer_is_caught(dist_ctx, tmp_path, reference_cache) -> None:
    with pytest.raises(StageCoverageError) as info:
        run_strategy(transformer_case(micro_batches=2), LayerSkippingPipeline("gpipe"), dist_ctx, workdir=tmp_path, cache=reference_cache)
    assert info.value.missing and all(n.startswith("layers.1.") for n in info.value.missing)
    assert not info.value.duplicated
    assert "held by no stage" in str(info.value)
