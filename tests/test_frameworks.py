"""Framework loops on the real frameworks (files under ``tests/framework_loops``): each correct
loop passes with the defaults and each planted bug is named. The harness reads the state where
the framework keeps it (DeepSpeed ZeRO partitions, Megatron-Core shard attributes, Fabric's and
DeepSpeed's wrapper names, torchtitan's DTensors) and records at the framework's own optimizer
step."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.record.gather import GatherError, annotate_shard, prefix_rename, reference_name, shard_spec
from harness.pipeline import diagnose_target

LOOPS = Path(__file__).resolve().parent / "framework_loops"


def _diagnose(spec: str, rank_runner, reference_cache, workdir: Path):
    return diagnose_target(spec, runner=rank_runner, cache=reference_cache, workdir=workdir)


def _passes(spec: str, rank_runner, reference_cache, workdir: Path) -> None:
    run = _diagnose(spec, rank_runner, reference_cache, workdir)
    assert run.verdict.verdict == "pass", run.verdict.error or run.verdict.to_dict()


def _names(spec: str, code: str, rank_runner, reference_cache, workdir: Path) -> dict:
    run = _diagnose(spec, rank_runner, reference_cache, workdir)
    assert run.codes == [code], run.verdict.to_dict()
    return run.verdict.diagnoses[0].evidence


# -- DeepSpeed ZeRO --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["correct", "zero1", "zero3"])
def test_deepspeed_zero_stages_pass_read_through_deepspeeds_accessors(variant, rank_runner, reference_cache, tmp_path) -> None:
    pytest.importorskip("deepspeed")
    _passes(f"{LOOPS / 'deepspeed_zero.py'}:{variant}", rank_runner, reference_cache, tmp_path)


def test_deepspeed_loss_scaled_twice_is_grad_scaled_under_zero2(rank_runner, reference_cache, tmp_path) -> None:
    pytest.importorskip("deepspeed")
    ev = _names(str(LOOPS / "deepspeed_zero.py"), "grad-scaled", rank_runner, reference_cache, tmp_path)
    assert ev["factor"] == pytest.approx(0.5) and ev["param_count"] == 4, ev


@pytest.mark.slow
def test_deepspeed_loss_scaled_twice_is_grad_scaled_under_zero3(rank_runner, reference_cache, tmp_path) -> None:
    pytest.importorskip("deepspeed")
    ev = _names(f"{LOOPS / 'deepspeed_zero.py'}:zero3_bug", "grad-scaled", rank_runner, reference_cache, tmp_path)
    assert ev["factor"] == pytest.approx(0.5), ev


# -- Lightning Fabric --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["correct", "fsdp2"])
def test_fabric_ddp_and_fsdp2_pass_through_the_fabric_module(variant, rank_runner, reference_cache, tmp_path) -> None:
    pytest.importorskip("lightning.fabric")
    _passes(f"{LOOPS / 'fabric_ddp.py'}:{variant}", rank_runner, reference_cache, tmp_path)


def test_fabric_undivided_accumulation_is_named_not_hidden_by_wrapper_names(rank_runner, reference_cache, tmp_path) -> None:
    pytest.importorskip("lightning.fabric")
    ev = _names(str(LOOPS / "fabric_ddp.py"), "grad-scaled", rank_runner, reference_cache, tmp_path)
    assert ev["factor"] == pytest.approx(2.0), ev


@pytest.mark.slow
def test_fabric_fsdp2_undivided_accumulation_is_grad_scaled(rank_runner, reference_cache, tmp_path) -> None:
    pytest.importorskip("lightning.fabric")
    ev = _names(f"{LOOPS / 'fabric_ddp.py'}:fsdp2_bug", "grad-scaled", rank_runner, reference_cache, tmp_path)
    assert ev["factor"] == pytest.approx(2.0), ev


# -- accelerate ------------------------------------------------------------------------------


def test_accelerate_accumulation_passes_after_end_training_destroys_the_group(rank_runner, reference_cache, tmp_path) -> None:
    """The loop ends as accelerate documents, with ``end_training()``: the default group is
    gone when it returns; the harness finishes its work on a new one and says so."""
    pytest.importorskip("accelerate")
    run = _diagnose(f"{LOOPS / 'accelerate_ddp.py'}:correct", rank_runner, reference_cache, tmp_path)
    assert run.verdict.verdict == "pass", run.verdict.error or run.verdict.to_dict()
    assert any("destroyed the default process group" in n for n in run.comparison["notes"]), run.comparison["notes"]


def test_accelerate_loader_never_prepared_is_duplicate_samples_after_end_training(rank_runner, reference_cache, tmp_path) -> None:
    """A planted bug in a loop that destroys its group: named, never the harness's own error."""
    pytest.importorskip("accelerate")
    run = _diagnose(f"{LOOPS / 'accelerate_ddp.py'}:loader_not_sharded", rank_runner, reference_cache, tmp_path)
    # Both replicas read the epoch's first samples: the same ones twice, the later ones never.
    assert run.codes == ["duplicate-samples", "dropped-samples"], run.verdict.to_dict()


def test_accelerate_accumulating_more_than_the_case_is_batch_size_mismatch(rank_runner, reference_cache, tmp_path) -> None:
    """The Accelerator steps after 4 micro-batches where the case's step is 2: said as what
    happened (samples per step against the global batch), not numeric-mismatch."""
    pytest.importorskip("accelerate")
    ev = _names(f"{LOOPS / 'accelerate_ddp.py'}:accumulates_four", "batch-size-mismatch", rank_runner, reference_cache, tmp_path)
    assert ev["consumed"] == 32 and ev["global_batch"] == 16 and ev["micro_batches_per_replica"] == {"0": 4, "1": 4}, ev


@pytest.mark.slow
def test_accelerate_loss_divided_again_is_grad_scaled(rank_runner, reference_cache, tmp_path) -> None:
    pytest.importorskip("accelerate")
    ev = _names(str(LOOPS / "accelerate_ddp.py"), "grad-scaled", rank_runner, reference_cache, tmp_path)
    assert ev["factor"] == pytest.approx(0.5), ev


# -- Megatron-Core ---------------------------------------------------------------------------


def test_megatron_core_tp_layers_are_gathered_from_their_own_attributes(rank_runner, reference_cache, tmp_path) -> None:
    pytest.importorskip("megatron.core")
    _passes(f"{LOOPS / 'megatron_tp.py'}:correct", rank_runner, reference_cache, tmp_path)
    _names(str(LOOPS / "megatron_tp.py"), "tp-partial-sum", rank_runner, reference_cache, tmp_path / "bug")


def test_a_strided_megatron_partition_is_refused_with_the_reason() -> None:
    weight = nn.Parameter(torch.zeros(4, 2))
    weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, 0, 2
    with pytest.raises(GatherError, match=r"partitioned with stride 2 along dim 0: strided partitions interleave"):
        shard_spec(weight)


# -- torchtitan ------------------------------------------------------------------------------


def test_torchtitan_tp_on_its_llama3_passes_gathered_from_its_dtensors(rank_runner, reference_cache, tmp_path) -> None:
    """torchtitan's parallelize_llama with tp = 2 (sequence parallel on, FSDP at degree 1): the
    parameters are DTensors on its (fsdp, tp) mesh, gathered by the harness with no run.shard."""
    pytest.importorskip("torchtitan")
    _passes(f"{LOOPS / 'torchtitan_tp.py'}:correct", rank_runner, reference_cache, tmp_path)


def test_torchtitan_tokens_counted_over_the_tp_group_is_grad_scaled_by_tp(rank_runner, reference_cache, tmp_path) -> None:
    """The global token count summed over every rank instead of torchtitan's batch mesh: the TP
    peers' identical tokens counted twice, every gradient half the reference's."""
    pytest.importorskip("torchtitan")
    ev = _names(str(LOOPS / "torchtitan_tp.py"), "grad-scaled", rank_runner, reference_cache, tmp_path)
    assert ev["factor"] == pytest.approx(0.5) and ev["likely_source"] == "/ tensor-parallel size (2)", ev


# -- names and declarations ------------------------------------------------------------------


def test_wrapper_classes_are_known_by_name_and_subclasses_count() -> None:
    class _FabricModule(nn.Module):  # Lightning's name; the harness never imports Lightning
        def __init__(self, inner):
            super().__init__()
            self._forward_module = inner

    class DeepSpeedEngine(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    class PipelineEngine(DeepSpeedEngine):
        pass

    inner = nn.Sequential(nn.Linear(2, 2))
    assert reference_name(_FabricModule(inner), "_forward_module.0.weight") == "0.weight"
    assert reference_name(PipelineEngine(inner), "module.0.weight") == "0.weight"
    assert reference_name(nn.Sequential(inner), "0.0.weight") == "0.0.weight"  # a container, not a wrapper


def test_names_differing_by_one_prefix_map_one_to_one_by_shape() -> None:
    ref = {"fc1.weight": (16, 8), "fc1.bias": (16,), "fc2.weight": (4, 16)}
    wrapped = {"shell.inner." + n: s for n, s in ref.items()}
    assert prefix_rename(wrapped, ref) == ("shell.inner.", "")
    assert prefix_rename(dict(ref), ref) is None  # equal: nothing to map
    assert prefix_rename({"net." + n: s for n, s in ref.items()}, {"model.net." + n: s for n, s in ref.items()}) == ("", "model.")
    assert prefix_rename({**wrapped, "shell.inner.fc1.bias": (15,)}, ref) is None  # a shape differs: not the same tensors
    assert prefix_rename({"a." + n: s for n, s in list(ref.items())[:2]} | {"b.fc2.weight": (4, 16)}, ref) is None  # two prefixes


def test_an_annotated_model_still_pickles() -> None:
    """A declaration is not an attribute of the tensor: torch.save of the state dict (and of
    the module) works though the declaration holds an unpicklable group."""
    import threading

    model = nn.Linear(4, 2)
    annotate_shard(model.weight, 0, group=threading.Lock())  # stands for a ProcessGroup
    torch.save(model.state_dict(), io.BytesIO())
    torch.save(model, io.BytesIO())
    assert shard_spec(model.weight) is not None and shard_spec(model.bias) is None


def test_an_unknown_wrapper_is_mapped_by_its_prefix_with_a_notice_and_bugs_still_named(rank_runner, reference_cache, tmp_path) -> None:
    """Every name is ``shell.`` + the reference's, shapes one to one: compared under the
    reference's names with a notice instead of state-structure, and the loop's bug (gradients
    never averaged) is still named."""
    path = LOOPS / "unknown_wrapper.py"
    ok = _diagnose(f"{path}:correct", rank_runner, reference_cache, tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()
    notes = " ".join(ok.comparison["notes"])
    assert "without the prefix 'shell.'" in notes, notes
    bug = _diagnose(str(path), rank_runner, reference_cache, tmp_path / "bug")
    assert bug.codes == ["grad-not-averaged"], bug.verdict.to_dict()


@pytest.mark.distributed(nproc=2)
def test_a_destroyed_default_group_is_made_again_on_the_same_store(dist_ctx) -> None:
    """Twice in one process (a second run of the same loop): each new group gets a store
    prefix of its own, and its collectives work."""
    import torch.distributed as dist

    from harness.context import DefaultGroupKept

    for _ in range(2):
        with DefaultGroupKept() as kept:
            dist.destroy_process_group()
        assert kept.destroyed and dist.is_initialized()
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == dist_ctx.world_size
    with DefaultGroupKept() as kept:  # a loop that leaves the group alone: nothing to say
        pass
    assert not kept.destroyed and kept.note == ""
