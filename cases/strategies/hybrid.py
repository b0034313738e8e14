"""Two-dimensional parallelism: data parallelism x tensor parallelism on a named 2-D mesh.

``ParallelDims(dp, tp)`` builds the mesh ``("dp", "tp")``: tensor-parallel peers are adjacent
ranks, and the data-parallel group of a rank is the ranks holding the *same* TP shard (e.g. on
4 ranks with tp=2: TP groups [0, 1], [2, 3]; DP groups [0, 2], [1, 3]). The model is first
split with :func:`cases.strategies.tp.apply_tensor_parallel` over ``mesh["tp"]``, then wrapped
for data parallelism over ``mesh["dp"]``:

- :class:`DDPTensorParallelStrategy`: replicated parameters, gradients all-reduced (averaged)
  over ``mesh["dp"]`` by PyTorch's FSDP2-based ``replicate``
  (``torch.distributed._composable.replicate_with_fsdp``, the one ``torch.distributed.
  pipelining`` uses). Its parameters become 2-D DTensors ``(Replicate() on dp, <TP placement>
  on tp)``, so the DP all-reduce of a TP-sharded gradient runs on the local shard among the
  ranks that hold that shard.

  Why not ``DistributedDataParallel(model, device_mesh=mesh["dp"])``: in torch 2.13 its
  DDP+TP path (``torch.distributed.tensor.parallel.ddp._pre_dp_module_transform``, marked a
  temporary workaround in ``nn/parallel/distributed.py``) swaps the DTensor parameters for
  local ``nn.Parameter``s and, on each forward, replaces them with plain DTensor *attributes*
  (``_reconstruct_dtensor``); its post-forward hook then iterates ``named_parameters()``, which
  no longer lists them, so after the first forward ``model.named_parameters()`` has lost every
  TP parameter (66 -> 22 on the tiny transformer) and nothing outside DDP can see or save
  them.
- :class:`FSDPTensorParallelStrategy`: FSDP2 ``fully_shard`` over ``mesh["dp"]`` after TP
  (2-D DTensors ``(Shard(0) on dp, <TP placement> on tp)``).

Both average gradients over dp, so micro-batch losses are weighted with the dp size; with
several micro-batches, gradient sync waits for the last one (``set_requires_gradient_sync``).
Only tp rank 0 of each replica reports the loss.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh

from harness.parallel_dims import ParallelConfigError, ParallelDims
from harness.strategy import DistContextLike, RankSetup, StrategyBase
from reference.case import Batch, Case

from .fsdp import apply_fsdp, fsdp_units, run_accumulating
from .tp import Plan, apply_tensor_parallel

__all__ = ["DDPTensorParallelStrategy", "FSDPTensorParallelStrategy", "apply_replicate"]


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Data-parallel replication over the 1-D mesh ``dp_mesh`` with FSDP2-style ``replicate``:
    one gradient all-reduce group per block (``fsdp_units``) plus the root. Works on plain and
    DTensor (tensor-parallel) parameters. Returns ``model``."""
    if dp_mesh.ndim != 1:
        raise ValueError(
            f"apply_replicate needs a 1-D data-parallel mesh, got a {dp_mesh.ndim}-d mesh "
            f"{dp_mesh.mesh_dim_names}; pass mesh['dp']"
        )
    for unit in fsdp_units(model):
        replicate(unit, mesh=dp_mesh)
    replicate(model, mesh=dp_mesh)
    return model


class _DataTensorParallel(StrategyBase):
    """Shared 2-D setup: TP over ``mesh["tp"]``, then :meth:`data_parallel` over ``mesh["dp"]``."""

    def __init__(self, tp: int = 2, plan: Plan | None = None):
        """``plan``: the tensor-parallel plan (see :func:`cases.strategies.tp.expand_plan`;
        default: the bundled models' plan)."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 2:
            raise ParallelConfigError(f"{type(self).__name__}: tp must be an int >= 2, got {tp!r}")
        self.tp = tp
        self.plan = plan

    def data_parallel(self, model: nn.Module, dp_mesh: DeviceMesh) -> None:
        raise NotImplementedError

    def setup(self, case: Case, ctx: DistContextLike) -> RankSetup:
        dims = ParallelDims.for_world(ctx.world_size, tp=self.tp)
        if dims.dp < 2:
            raise ParallelConfigError(
                f"{type(self).__name__} needs a data-parallel degree >= 2, but world size "
                f"{ctx.world_size} with tp={self.tp} leaves dp={dims.dp}; use TensorParallelStrategy"
            )
        mesh = dims.build_mesh(ctx.device.type)
        model = case.build_model(ctx.device)
        apply_tensor_parallel(model, mesh["tp"], self.plan)
        self.data_parallel(model, mesh["dp"])
        return RankSetup.on_mesh(case, ctx, model, dims, mesh)

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
        return run_accumulating(case, setup, micro_batches)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tp={self.tp})"


class DDPTensorParallelStrategy(_DataTensorParallel):
    """dp x tp: TP inside each replica, replicated parameters and a gradient all-reduce over
    the ranks that hold the same TP shard."""

    name = "ddp-tp"

    def data_parallel(self, model: nn.Module, dp_mesh: DeviceMesh) -> None:
        apply_replicate(model, dp_mesh)


class FSDPTensorParallelStrategy(_DataTensorParallel):
    """FSDP2 x TP: each TP shard is further sharded on dim 0 over the dp ranks."""

    name = "fsdp-tp"

    def data_parallel(self, model: nn.Module, dp_mesh: DeviceMesh) -> None:
        apply_fsdp(model, dp_mesh)
