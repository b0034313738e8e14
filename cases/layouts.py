"""Layouts for the layout check (:mod:`harness.simulate.layout`): the two layouts the seeds
work through, a bug that swaps two mesh dims at 64 ranks, and a plan for any ``(dp, tp, pp)``.

- ``seed-8gpu`` (seed 000 section 9): ``[dp=4, tp=2]`` on 8 GPUs, global batch 32: each replica
  reads 8 samples, both TP ranks of a replica read the same 8, gradients sync over the 4 ranks
  holding the same TP shard;
- ``seed-64gpu`` (seed 001 section 5): DP=4, TP=8, PP=2 on 8 nodes of 8 GPUs: TP inside a node
  (adjacent ranks), the two pipeline stages on two nodes, 4 replicas; 4 samples per GPU
  micro-batch and 8 accumulation steps, so a global batch of 4 x 8 x 4 = 128;
- ``seed-64gpu-swapped-mesh``: the same job with the mesh's dp and tp dims swapped (the rank
  tensor transposed): TP groups span nodes, the "dp" groups are a node's adjacent ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from harness.parallel_dims import ParallelConfigError, ParallelDims
from harness.simulate.layout import LayoutPlan
from harness.targets.target import Target
from reference.case import Case

from .catalog import transformer_case
from .strategies.hybrid import apply_replicate
from .strategies.pipeline import pipeline_stage_model
from .strategies.tp import apply_tensor_parallel

__all__ = ["LAYOUT_TARGETS", "layout_plan", "transformer_stage"]


def transformer_stage(case: Case, stage: int, num_stages: int, mesh) -> torch.nn.Module:
    """Stage ``stage`` of the tiny transformer, tensor-parallel over ``mesh["tp"]`` and
    replicated over ``mesh["dp"]`` (FSDP2-style ``replicate``), the dims the mesh has."""
    model = case.build_model("cpu")
    if num_stages > 1:
        pipeline_stage_model(model, stage, num_stages)
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        apply_tensor_parallel(model, mesh["tp"])
    if "dp" in names:
        apply_replicate(model, mesh["dp"])
    return model


def layout_plan(
    dp: int = 1, tp: int = 1, pp: int = 1, *, global_batch: int | None = None, micro_batches: int | None = None,
    name: str | None = None, description: str = "", build_mesh: Callable[[ParallelDims], object] | None = None,
    heads: int | None = None, layers: int | None = None,
) -> LayoutPlan:
    """A plan for any degrees on the tiny transformer (4 features per head, MLP width 8 per
    head). ``heads`` / ``layers`` fix the model: degrees that do not split it are a
    :class:`ParallelConfigError` naming the degrees that would. Left out, the model is widened
    so that ``tp`` divides its heads (at least 4) and ``pp`` its layers (at least 4), and the
    plan's description says so. By default 4 samples per replica micro-batch and ``2 * pp``
    micro-batches (1 without a pipeline)."""
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    widened = []
    if heads is None:
        heads = tp * math.ceil(4 / tp)
        if heads != 4:
            widened.append(f"{heads} heads, not 4, so that tp={tp} divides them")
    elif heads % tp:
        raise ParallelConfigError(f"tp={tp} does not divide the model's {heads} heads; tp may be one of "
                                  f"{[d for d in range(1, heads + 1) if heads % d == 0]} (or leave --heads out to widen the model)")
    if layers is None:
        layers = pp * max(1, math.ceil(4 / pp))
        if layers != 4:
            widened.append(f"{layers} layers, not 4, so that pp={pp} divides them")
    elif layers % pp:
        raise ParallelConfigError(f"pp={pp} does not divide the model's {layers} layers; pp may be one of "
                                  f"{[d for d in range(1, layers + 1) if layers % d == 0]} (or leave --layers out to widen the model)")
    model_line = f"model: the tiny transformer with {heads} heads (dim {4 * heads}) and {layers} layers" + (
        f" (widened: {'; '.join(widened)})" if widened else "")
    description = f"{description}\n  {model_line}" if description else model_line
    micro = micro_batches or (2 * pp if pp > 1 else 1)
    batch = global_batch or 4 * dp * micro
    if batch % (dp * micro):
        raise ParallelConfigError(f"global batch {batch} is not divisible by dp x micro-batches = {dp} x {micro}")
    case = transformer_case(global_batch_size=batch, micro_batches=micro, num_samples=max(64, batch), dim=4 * heads,
                            heads=heads, hidden=8 * heads, layers=layers, name=f"transformer-h{heads}-l{layers}")
    return LayoutPlan(name or f"pp{pp}-dp{dp}-tp{tp}", dims, case, transformer_stage, build_mesh=build_mesh,
                      description=description)


def _swapped_dp_tp(dims: ParallelDims):
    """BUG: the rank tensor reshaped as (pp, tp, dp) and transposed, as if the loop that
    enumerates ranks ran over dp fastest: each "tp" group is one rank per node of a stage."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(dims.world_size).reshape(dims.pp, dims.tp, dims.dp).transpose(1, 2)
    return DeviceMesh("cpu", ranks.contiguous(), mesh_dim_names=("pp", "dp", "tp"))


def _layout_target(name: str, code: str | None, **options) -> Callable[[], Target]:
    def build() -> Target:
        plan = layout_plan(name=name, **options)
        return Target(name, plan.case, nproc=plan.dims.world_size, expected_code=code, description=plan.description, layout=plan)

    return build


LAYOUT_TARGETS: dict[str, Callable[[], Target]] = {
    "seed-8gpu": _layout_target("seed-8gpu", None, dp=4, tp=2, global_batch=32, micro_batches=1,
                                description="seed 000 section 9: [dp=4, tp=2], global batch 32, 8 samples per replica"),
    "seed-64gpu": _layout_target("seed-64gpu", None, dp=4, tp=8, pp=2, global_batch=128, micro_batches=8,
                                 description="seed 001 section 5: DP=4 x TP=8 (in a node) x PP=2 (across nodes), "
                                             "4 samples per GPU micro-batch, 8 accumulation steps"),
    "seed-64gpu-swapped-mesh": _layout_target(
        "seed-64gpu-swapped-mesh", "swapped-mesh-dims", dp=4, tp=8, pp=2, global_batch=128, micro_batches=8,
        build_mesh=_swapped_dp_tp, description="the 64-GPU job with the mesh's dp and tp dims swapped"),
}
