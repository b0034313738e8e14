"""Per-replica statistics on real ranks: a program that computes a statistic of its batch on
each data-parallel replica (a masked loss normalised by the replica's own count, an MoE
router's load-balancing loss, a BatchNorm without sync) matches the per-replica reference, not
one device's: ``per-replica-statistic``, with what depends on the batch; declared in the case,
the per-replica reference is the contract and the run passes, while bugs under the declaration
are still named. And the calibration never learns a change of meaning as noise."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness.pipeline import run_and_diagnose
from harness.pipeline import diagnose_target

REPO = Path(__file__).resolve().parents[1]
LOOPS = REPO / "tests" / "custom_loops"


def _diagnose(spec, rank_runner, reference_cache, workdir):
    return diagnose_target(str(spec), runner=rank_runner, cache=reference_cache, workdir=workdir)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_masked_loss_normalised_by_each_replicas_own_count(rank_runner, reference_cache, tmp_path, micro_batches) -> None:
    """Each micro-batch's masked mean over the whole micro-batch is the case; the correct loop
    divides by the all-reduced count and passes; the bug divides by each replica's own count -
    named, with the loss as the term that depends on the batch. The calibration's split variant
    changes what such a loss computes: it is rejected, not learnt as noise, and the tolerance
    stays at rounding level (it was 32% of the gradients before, and the bug passed)."""
    path = LOOPS / f"masked_loss_m{micro_batches}.py"
    ok = _diagnose(f"{path}:correct", rank_runner, reference_cache, tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()
    tolerance = ok.comparison["tolerance"]
    assert any("changes what is computed" in r and "2 micro-batches" in r or f"{2 * micro_batches} micro-batches" in r
               for r in tolerance["rejected"]), tolerance
    assert all("micro-batches, reversed" not in v for v in tolerance["variants"]), tolerance
    assert max(v for k, v in tolerance["relative_noise"].items() if k.endswith(":grad")) < 1e-5, tolerance
    assert any("not invariant to splitting the batch" in n for n in ok.comparison["notes"])
    bug = _diagnose(path, rank_runner, reference_cache, tmp_path / "bug")
    assert bug.codes == ["per-replica-statistic"], bug.verdict.to_dict()
    ev = bug.verdict.diagnoses[0].evidence
    assert ev["dependence"]["loss"] is not None and ev["dependence"]["first_module"] is None, ev
    assert ev["declare"] == {"per_replica": ["loss"]} and ev["references_differ_by"] > 1e-2, ev


def test_a_token_normalised_loss_with_accumulation_needs_only_the_plain_glue(rank_runner, reference_cache, tmp_path) -> None:
    """``loss_normaliser=valid_tokens``: the step's loss is the mean over all its valid tokens.
    The plain glue (run.loss_weight, run.loss) weights and combines by the counts: PASS, loss
    included; weighting by samples instead is the per-replica (and per-micro-batch) mean."""
    example = REPO / "cases" / "masked_loss_example.py"
    ok = _diagnose(example, rank_runner, reference_cache, tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()
    bug = _diagnose(f"{example}:local_normalisation", rank_runner, reference_cache, tmp_path / "bug")
    assert bug.codes == ["per-replica-statistic"], bug.verdict.to_dict()
    assert bug.verdict.diagnoses[0].evidence["dependence"]["loss"] is not None


def test_declared_per_replica_statistics_are_the_contract_and_bugs_under_them_are_named(rank_runner, reference_cache, tmp_path) -> None:
    path = LOOPS / "masked_loss_declared.py"
    ok = _diagnose(path, rank_runner, reference_cache, tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()
    assert any("per-replica reference" in n for n in ok.comparison["notes"]), ok.comparison["notes"]
    scaled = _diagnose(f"{path}:unweighted_accumulation", rank_runner, reference_cache, tmp_path / "scaled")
    assert scaled.codes == ["grad-scaled"], scaled.verdict.to_dict()


@pytest.mark.distributed(nproc=2)
def test_an_moe_router_loss_is_a_per_replica_statistic_until_declared(dist_ctx, tmp_path, reference_cache) -> None:
    """Qwen2-MoE's load-balancing loss is computed over the tokens of each forward, so a
    correct DDP run computes it per replica: named, with the output field it comes from; the
    same run with the loss declared per replica passes."""
    pytest.importorskip("transformers")
    from cases.hf import hf_case
    from cases.strategies import DDPStrategy

    def verdict(case, where):
        run = run_and_diagnose(case, DDPStrategy(), dist_ctx, workdir=tmp_path / where, cache=reference_cache)
        out = [run.report.verdict.to_dict() if dist_ctx.rank == 0 else None]
        torch.distributed.broadcast_object_list(out, src=0)
        return out[0]

    undeclared = verdict(hf_case("qwen2-moe-router-loss", model_loss=True, steps=2), "undeclared")
    assert [d["code"] for d in undeclared["diagnoses"]] == ["per-replica-statistic"], undeclared
    dependence = undeclared["diagnoses"][0]["evidence"]["dependence"]
    assert "aux_loss" in dependence["output_fields"], dependence
    declared_case = hf_case("qwen2-moe-router-loss", model_loss=True, steps=2, per_replica=("loss",))
    declared = verdict(declared_case, "declared")
    assert declared["verdict"] == "pass", declared
    # A bug under the declaration keeps its own name.
    from cases.bugs.double_averaged_ddp import DoubleAveragedDDP

    run = run_and_diagnose(declared_case, DoubleAveragedDDP(), dist_ctx, workdir=tmp_path / "bug", cache=reference_cache)
    out = [run.report.verdict.codes if dist_ctx.rank == 0 else None]
    torch.distributed.broadcast_object_list(out, src=0)
    assert out[0] == ["grad-double-averaged"], out


def _bn_case(per_replica=()):
    from cases.catalog import OPTIMIZERS
    from cases.data import SyntheticRegression
    from cases.models import BatchNormMLP
    from reference import Case

    return Case("bn-mlp" + ("-per-replica" if per_replica else ""), BatchNormMLP, SyntheticRegression(64, 8, 4), F.mse_loss,
                OPTIMIZERS["adamw"], global_batch_size=16, steps=2, per_replica=per_replica)


@pytest.mark.distributed(nproc=2)
def test_batch_norm_without_sync_names_its_module(dist_ctx, tmp_path, reference_cache) -> None:
    from cases.strategies import DDPStrategy

    def verdict(case, where):
        run = run_and_diagnose(case, DDPStrategy(), dist_ctx, workdir=tmp_path / where, cache=reference_cache)
        out = [run.report.verdict.to_dict() if dist_ctx.rank == 0 else None]
        torch.distributed.broadcast_object_list(out, src=0)
        return out[0]

    undeclared = verdict(_bn_case(), "undeclared")
    assert [d["code"] for d in undeclared["diagnoses"]] == ["per-replica-statistic"], undeclared
    ev = undeclared["diagnoses"][0]["evidence"]
    assert ev["dependence"]["first_module"] == "bn" and ev["declare"] == {"per_replica": ["bn"]}, ev
    assert verdict(_bn_case(("bn",)), "declared")["verdict"] == "pass"
    # Declaring the loss does not cover the BatchNorm: what is not declared is still named.
    wrong = verdict(_bn_case(("loss",)), "wrong")
    assert [d["code"] for d in wrong["diagnoses"]] == ["per-replica-statistic"] and wrong["diagnoses"][0]["evidence"]["undeclared"] == ["bn"], wrong
