"""Real third-party model code: tiny Hugging Face Llama and GPT-2 (random init, configs built in
code) under DDP, FSDP2, TP and FSDP2 x TP pass with the default settings, in fp32 and bf16 over
3 AdamW steps, and deliberate bugs in them are named with their own code - never another's.

Each run is one ``run_and_diagnose`` on the warm pool: the same path as ``assert_matches_reference``
and ``python -m harness diagnose``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.parallel import RowwiseParallel

pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]'")

from cases.bugs.double_averaged_ddp import DoubleAveragedDDP  # noqa: E402
from cases.bugs.summed_grads import SummedGradients  # noqa: E402
from cases.hf import gpt2_tp_plan, hf_case, llama_tp_plan  # noqa: E402
from cases.strategies import DDPStrategy, FSDPStrategy, FSDPTensorParallelStrategy, TensorParallelStrategy  # noqa: E402
from cases.strategies.fsdp import repeated_blocks  # noqa: E402
from harness.pipeline import run_and_diagnose  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _diagnose(case, strategy, dist_ctx, tmp_path, reference_cache):
    """Every rank runs it; the verdict and codes are broadcast from rank 0."""
    run = run_and_diagnose(case, strategy, dist_ctx, workdir=tmp_path, cache=reference_cache)
    outcome = [None]
    if dist_ctx.rank == 0:
        report = run.report
        outcome = [(report.verdict.verdict, report.verdict.codes, report.comparison_summary, report.verdict.to_dict())]
    torch.distributed.broadcast_object_list(outcome, src=0)
    return outcome[0]


def _strategy(name: str, model: str):
    plan = llama_tp_plan() if model == "llama" else gpt2_tp_plan()
    return {
        "ddp": lambda: DDPStrategy(),
        "fsdp": lambda: FSDPStrategy(),
        "tp": lambda: TensorParallelStrategy(plan=plan),
        "fsdp-tp": lambda: FSDPTensorParallelStrategy(tp=2, plan=plan),
    }[name]()


CORRECT = [
    ("llama", "ddp", 2), ("llama", "fsdp", 2), ("llama", "tp", 2), ("llama", "fsdp-tp", 4),
    ("gpt2", "ddp", 2), ("gpt2", "fsdp", 2), ("gpt2", "tp", 2), ("gpt2", "fsdp-tp", 4),
]
# 4-rank runs cost most: the default suite keeps one FSDP2 x TP run (GPT-2 in fp32; each model's
# TP and FSDP2 run in both dtypes on 2 ranks); the other three run with -m slow.
SLOW = {("llama", "fsdp-tp", "fp32"), ("llama", "fsdp-tp", "bf16"), ("gpt2", "fsdp-tp", "bf16")}
CORRECT_PARAMS = [
    pytest.param(model, strategy, dtype, id=f"{model}-{strategy}-{dtype}",
                 marks=[pytest.mark.distributed(nproc=nproc)] + ([pytest.mark.slow] if (model, strategy, dtype) in SLOW else []))
    for model, strategy, nproc in CORRECT for dtype in sorted(DTYPES)
]


@pytest.mark.parametrize("model,strategy,dtype", CORRECT_PARAMS)
def test_correct_hf_runs_pass_with_the_defaults(dist_ctx, tmp_path, reference_cache, model, strategy, dtype) -> None:
    verdict, codes, summary, _ = _diagnose(hf_case(model, dtype=DTYPES[dtype]), _strategy(strategy, model), dist_ctx, tmp_path, reference_cache)
    assert (verdict, codes) == ("pass", []), summary


class LlamaDownProjPartialSum(TensorParallelStrategy):
    """Row-parallel MLP down projections whose partial sums are used as they are."""

    name = "tp-down-proj-partial"

    def __init__(self) -> None:
        plan = llama_tp_plan()
        for key in [k for k in plan if k.endswith("mlp.down_proj")]:
            plan[key] = RowwiseParallel(input_layouts=Shard(-1), output_layouts=Partial())
        super().__init__(plan=plan)


BUGS = [
    ("llama", DoubleAveragedDDP, "grad-double-averaged"),
    ("llama", LlamaDownProjPartialSum, "tp-partial-sum"),
    ("gpt2", DoubleAveragedDDP, "grad-double-averaged"),
    ("gpt2", SummedGradients, "grad-not-averaged"),
]


@pytest.mark.distributed(nproc=2)
@pytest.mark.parametrize("model,bug,code", BUGS, ids=[f"{m}-{c}" for m, _, c in BUGS])
def test_bugs_in_hf_models_are_named_with_their_code(dist_ctx, tmp_path, reference_cache, model, bug, code) -> None:
    verdict, codes, summary, full = _diagnose(hf_case(model, steps=2), bug(), dist_ctx, tmp_path, reference_cache)
    assert (verdict, codes) == ("fail", [code]), f"{full}\n{summary}"


@pytest.mark.distributed(nproc=2)
def test_a_partial_sum_is_named_when_the_model_returns_its_own_loss(dist_ctx, tmp_path, reference_cache) -> None:
    """With ``labels`` the model's output starts with the scalar loss, near log(vocab) at
    initialisation whatever the logits: the probe reads the logits instead."""
    case = hf_case("llama", steps=2, model_loss=True)
    verdict, codes, summary, full = _diagnose(case, LlamaDownProjPartialSum(), dist_ctx, tmp_path, reference_cache)
    assert (verdict, codes) == ("fail", ["tp-partial-sum"]), f"{full}\n{summary}"
    # Where it departs: the down projection whose Partial output the decoder layer adds unreduced.
    where = full["diagnoses"][0]["evidence"]["first_divergent_op"]
    assert (where["module"], where["consumed_by"]) == ("model.layers.0.mlp.down_proj", "model.layers.0"), where


def test_fsdp_units_are_the_repeated_decoder_layers() -> None:
    for model_name, path, cls in (("llama", "model.layers", "LlamaDecoderLayer"), ("gpt2", "transformer.h", "GPT2Block")):
        model = hf_case(model_name).build_model()
        found = repeated_blocks(model)
        assert found is not None and found[0] == path and {type(b).__name__ for b in found[1]} == {cls}


@pytest.mark.distributed(nproc=2)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_dict_batches_and_the_models_own_loss(dist_ctx, tmp_path, reference_cache, strategy) -> None:
    """A plain torch Dataset of dicts with an "id" key, the model called with keyword
    arguments and its own ``outputs.loss`` from ``labels`` (``loss_fn=None``)."""
    case = hf_case("llama", model_loss=True, steps=2)
    assert case.loss_fn is None and isinstance(case.dataset[0], dict)
    verdict, codes, summary, _ = _diagnose(case, _strategy(strategy, "llama"), dist_ctx, tmp_path, reference_cache)
    assert (verdict, codes) == ("pass", []), summary


def test_a_custom_loop_over_an_hf_model_passes(rank_runner, reference_cache, tmp_path) -> None:
    from harness.pipeline import diagnose_target

    example = Path(__file__).resolve().parents[1] / "cases" / "hf_custom_example.py"
    report = diagnose_target(str(example), runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    assert report.verdict.verdict == "pass", report.verdict.to_dict()


def test_a_plan_with_patterns_expands_and_a_typo_is_named() -> None:
    from cases.strategies.tp import expand_plan

    model = hf_case("llama").build_model()
    plan = expand_plan(model, llama_tp_plan())
    assert len(plan) == 14 and "model.layers.1.mlp.gate_proj" in plan and "model.layers.0.self_attn.v_proj" in plan
    with pytest.raises(ValueError, match=r"'model.layers.\*.mlp.dwn_proj' matches no module .*model.layers.0.mlp.down_proj"):
        expand_plan(model, {"model.layers.*.mlp.dwn_proj": RowwiseParallel()})


@pytest.mark.distributed(nproc=2)
def test_an_moe_whose_experts_have_no_float64_kernel_calibrates_and_passes(dist_ctx, tmp_path, reference_cache) -> None:
    """Qwen2-MoE's experts run ``torch._grouped_mm``, which has no float64 kernel: the float64
    calibration rerun runs that op in float32 and says so, and the correct DDP run passes."""
    verdict, codes, summary, _ = _diagnose(hf_case("qwen2-moe", steps=2), DDPStrategy(), dist_ctx, tmp_path, reference_cache)
    assert (verdict, codes) == ("pass", []), summary
    assert "ops without a float64 kernel ran in float32: _grouped_mm" in summary, summary
