"""Gather on real ranks: every layout comes back as the full tensor under its reference name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from cases.models import TwoLayerMLP
from harness.record.gather import (
    GatheredTensors,
    GatherError,
    LocalTensor,
    StageCoverageError,
    annotate_shard,
    gather_state,
    local_state,
    reference_name,
    reference_named_parameters,
)

PLAIN_NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def gathered(entries, **kwargs) -> dict[str, torch.Tensor | None]:
    return dict(GatheredTensors(entries, **kwargs))


def check_on_dst(result: dict, expected: dict[str, torch.Tensor], dst: int) -> None:
    assert list(result) == list(expected)
    for name, value in result.items():
        if dist.get_rank() == dst:
            assert value is not None, name
            torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
        else:
            assert value is None, name  # only dst materializes full tensors


def batch_for(rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def expected_after_one_step(world: int, optimizer_cls, factory=TwoLayerMLP, **opt_kwargs):
    """Single-process truth: the mean loss over all ranks' batches, one optimizer step."""
    torch.manual_seed(0)
    model = factory()
    xs, ys = zip(*(batch_for(r) for r in range(world)))
    F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt = optimizer_cls(model.parameters(), **opt_kwargs)
    opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    optim = {f"{n}.{k}": v for n, p in model.named_parameters() for k, v in sorted(opt.state[p].items())}
    return grads, params, optim


# -- DTensor --------------------------------------------------------------------------------


@pytest.mark.distributed(nproc=2)
def test_dtensor_any_placement(dist_ctx) -> None:
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(30.0).reshape(5, 6)  # 5 rows: an uneven Shard(0)
    partial_local = full * (dist_ctx.rank + 1) / 3  # 1/3 + 2/3 of full
    entries = [
        LocalTensor("shard0", distribute_tensor(full, mesh, [Shard(0)])),
        LocalTensor("shard1", distribute_tensor(full, mesh, [Shard(1)])),
        LocalTensor("replicate", distribute_tensor(full, mesh, [Replicate()])),
        LocalTensor("partial", DTensor.from_local(partial_local, mesh, [Partial()])),
        LocalTensor("bf16", distribute_tensor(full.bfloat16(), mesh, [Shard(1)])),
    ]
    expected = {"shard0": full, "shard1": full, "replicate": full, "partial": full, "bf16": full.bfloat16()}
    for dst in (0, 1):
        check_on_dst(gathered(entries, dst=dst), expected, dst)


@pytest.mark.distributed(nproc=4)
def test_dtensor_on_a_2d_mesh_and_a_hand_shard_along_a_mesh_dim(dist_ctx) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(48.0).reshape(8, 6)
    tp = mesh.get_local_rank("tp")
    hand = annotate_shard(full[:, tp * 3 : (tp + 1) * 3].clone(), 1, mesh=mesh, mesh_dim="tp")
    entries = [
        LocalTensor("2d", distribute_tensor(full, mesh, [Shard(0), Shard(1)])),
        LocalTensor("hsdp", distribute_tensor(full, mesh, [Replicate(), Shard(0)])),
        LocalTensor("partial_shard", DTensor.from_local(full[:, tp * 3 : (tp + 1) * 3] / 2, mesh, [Partial(), Shard(1)])),
        LocalTensor("hand", hand, annotate_shard_spec(hand)),
    ]
    result = gathered(entries, dst=3)
    check_on_dst(result, {"2d": full, "hsdp": full, "partial_shard": full, "hand": full}, dst=3)
    stream = GatheredTensors(entries)
    assert stream.replica_mismatches == {}


def annotate_shard_spec(t: torch.Tensor):
    from harness.record.gather import shard_spec

    return shard_spec(t)


# -- FSDP2, DDP, torch.compile, activation checkpointing ------------------------------------


def uneven_mlp() -> nn.Module:
    return TwoLayerMLP(8, 15, 4)  # 15 rows do not split evenly over 2 ranks


@pytest.mark.distributed(nproc=2)
def test_fsdp2_params_grads_and_optimizer_state(dist_ctx) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = uneven_mlp()
    fully_shard(model.fc1)
    fully_shard(model.fc2)
    fully_shard(model)
    assert isinstance(model.fc1.weight, DTensor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch_for(dist_ctx.rank)
    F.mse_loss(model(x), y).backward()  # FSDP2 averages gradients over ranks
    grads = dict(gather_state(model, opt, "grad"))
    opt.step()
    params, optim = dict(gather_state(model, opt, "param")), dict(gather_state(model, opt, "optim"))
    want_g, want_p, want_o = expected_after_one_step(2, torch.optim.AdamW, uneven_mlp, lr=1e-2)
    check_on_dst(grads, want_g, 0)
    check_on_dst(params, want_p, 0)
    check_on_dst(optim, want_o, 0)
    assert "fc1.weight.exp_avg_sq" in optim and "fc1.weight.step" in optim


@pytest.mark.distributed(nproc=2)
def test_ddp_compile_and_checkpoint_prefixes_are_removed(dist_ctx) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    inner = TwoLayerMLP()
    inner.fc1 = checkpoint_wrapper(inner.fc1)
    model = DistributedDataParallel(torch.compile(inner, backend="eager"))
    raw = [n for n, _ in model.named_parameters()]
    assert raw[0] == "module._orig_mod.fc1._checkpoint_wrapped_module.weight"
    names = [n for n, _ in reference_named_parameters(model)]
    assert names == PLAIN_NAMES
    assert names == list(get_model_state_dict(model).keys())  # PyTorch's own FQN rule agrees

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batch_for(dist_ctx.rank)
    F.mse_loss(model(x), y).backward()
    grads = dict(gather_state(model, opt, "grad"))
    opt.step()
    want_g, want_p, want_o = expected_after_one_step(2, torch.optim.SGD, lr=0.1, momentum=0.9)
    check_on_dst(grads, want_g, 0)
    check_on_dst(dict(gather_state(model, opt, "param", dst=1)), want_p, 1)
    check_on_dst(dict(gather_state(model, opt, "optim")), want_o, 0)


def test_reference_name_strips_only_wrappers() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)  # a user attribute called "module" is not a wrapper

    assert reference_name(Holder(), "module.weight") == "module.weight"
    compiled = torch.compile(Holder(), backend="eager")
    assert [n for n, _ in reference_named_parameters(compiled)] == ["module.weight", "module.bias"]


# -- pipeline stages ------------------------------------------------------------------------


def stage_model(keep: set[str]) -> nn.Module:
    torch.manual_seed(0)
    model = TwoLayerMLP()
    for layer in ("fc1", "fc2"):
        if layer not in keep:
            setattr(model, layer, None)  # the stage does not hold this layer
    return model


@pytest.mark.distributed(nproc=2)
def test_pipeline_stages_are_united(dist_ctx) -> None:
    torch.manual_seed(0)
    full = dict(TwoLayerMLP().named_parameters())
    mine = stage_model({"fc1"} if dist_ctx.rank == 0 else {"fc2"})
    for dst in (0, 1):
        result = dict(gather_state(mine, None, "param", stages=[dist_ctx.rank], expected=PLAIN_NAMES, dst=dst))
        check_on_dst(result, {n: full[n].detach() for n in PLAIN_NAMES}, dst)


@pytest.mark.distributed(nproc=2)
def test_pipeline_stage_held_twice_or_by_none_is_a_clear_error(dist_ctx) -> None:
    twice = stage_model({"fc1"} if dist_ctx.rank == 0 else {"fc1", "fc2"})
    with pytest.raises(StageCoverageError, match=r"'fc1.weight' \(stages \[0, 1\], ranks \[0, 1\]\)") as info:
        gather_state(twice, None, "param", stages=[dist_ctx.rank], expected=PLAIN_NAMES)
    assert info.value.duplicated == {"fc1.weight": [0, 1], "fc1.bias": [0, 1]} and info.value.missing == []

    nobody = stage_model({"fc1"})
    with pytest.raises(StageCoverageError, match=r"held by no stage: \['fc2.weight', 'fc2.bias'\]") as info:
        gather_state(nobody, None, "param", stages=[dist_ctx.rank], expected=PLAIN_NAMES)
    assert info.value.missing == ["fc2.weight", "fc2.bias"]

    differ = stage_model({"fc1"} if dist_ctx.rank == 0 else {"fc2"})
    with pytest.raises(GatherError, match=r"'fc1.weight' is missing on ranks \[1\].*declare stages"):
        gather_state(differ, None, "param")  # no stages declared: every rank must hold all


# -- hand-sharded tensors -------------------------------------------------------------------


class RowShardedLinear(nn.Module):
    """Hand-written row sharding of a (5, 3) weight: rank 0 holds 2 rows, rank 1 holds 3."""

    def __init__(self, full: torch.Tensor, rank: int, **spec) -> None:
        super().__init__()
        rows = slice(0, 2) if rank == 0 else slice(2, 5)
        self.weight = nn.Parameter(full[rows].clone())
        annotate_shard(self.weight, 0, **spec)


@pytest.mark.distributed(nproc=2)
def test_hand_sharded_parameter_grad_and_optimizer_state(dist_ctx) -> None:
    full = torch.arange(15.0).reshape(5, 3) / 10
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for spec in ({"group": dist.group.WORLD}, {"mesh": mesh, "mesh_dim": "tp"}):
        layer = RowShardedLinear(full, dist_ctx.rank, **spec)
        opt = torch.optim.Adam(layer.parameters(), lr=0.1)
        (layer.weight**2).sum().backward()
        check_on_dst(dict(gather_state(layer, opt, "grad")), {"weight": 2 * full}, 0)
        opt.step()
        truth = nn.Parameter(full.clone())
        truth_opt = torch.optim.Adam([truth], lr=0.1)
        (truth**2).sum().backward()
        truth_opt.step()
        check_on_dst(dict(gather_state(layer, opt, "param")), {"weight": truth.detach()}, 0)
        want = {f"weight.{k}": v for k, v in sorted(truth_opt.state[truth].items())}
        check_on_dst(dict(gather_state(layer, opt, "optim")), want, 0)  # `step` stays a scalar


# -- replicas -------------------------------------------------------------------------------


@pytest.mark.distributed(nproc=2)
def test_diverged_replicas_are_reported(dist_ctx) -> None:
    mesh = init_device_mesh("cpu", (2,))
    same = torch.ones(3)
    drifted = torch.ones(3) + (1e-3 if dist_ctx.rank == 1 else 0.0)
    entries = [
        LocalTensor("same", same),
        LocalTensor("drifted", drifted),
        LocalTensor("sharded", distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])),  # shards differ by design
    ]
    stream = GatheredTensors(entries)
    assert stream.replica_mismatches == {"drifted": [[0], [1]]}
    result = dict(stream)
    if dist_ctx.rank == 0:
        assert torch.equal(result["drifted"], torch.ones(3))  # dst's own replica


def test_single_process_gather_without_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    torch.manual_seed(0)
    model = TwoLayerMLP()
    result = dict(gather_state(model, None, "param"))
    assert list(result) == PLAIN_NAMES and torch.equal(result["fc1.weight"], model.fc1.weight)
    sharded = annotate_shard(torch.ones(2), 0, group=object())
    with pytest.raises(GatherError, match="'x' is sharded but no process group is initialised"):
        GatheredTensors([LocalTensor("x", sharded, annotate_shard_spec(sharded))])
    assert local_state(model, None, "grad") == []  # no gradients yet
