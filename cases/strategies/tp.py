"""Tensor parallelism (Megatron style) with ``torch.distributed.tensor.parallel``.

Each transformer block is split across the ranks of a tensor-parallel mesh:

- attention: ``q``, ``k``, ``v`` are ``ColwiseParallel`` (each rank computes ``heads / tp``
  whole heads; the attention reads its local head count from the projection width), ``o`` is
  ``RowwiseParallel`` (it consumes the local heads and all-reduces its partial sums);
- MLP: ``up`` is ``ColwiseParallel``, ``down`` ``RowwiseParallel``.

Layouts are declared explicitly: the column-parallel layers take the replicated activation and
leave their output sharded on the last dim (as local tensors, so attention runs unchanged); the
row-parallel layers take that shard and return a replicated activation. Embedding, positions,
norms and head stay replicated: every rank computes them on the same batch, and their
gradients are complete on every rank because DTensor's backward all-reduces the partial input
gradients of the column-parallel layers.

Every tensor-parallel rank consumes the same batch; only tp rank 0 reports the loss
(:meth:`ParallelDims.layout`). :func:`apply_tensor_parallel` is the plan alone, usable on a
pipeline stage (a ``TinyTransformer`` whose ``embed``/``norm``/``head`` may be None and that
holds only some blocks) or before data parallelism (:mod:`cases.strategies.hybrid`).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from cases.models import TinyTransformer, TwoLayerMLP
from harness.parallel_dims import ParallelConfigError, ParallelDims
from harness.strategy import DistContextLike, RankSetup, StrategyBase
from reference.case import Case

__all__ = [
    "TensorParallelStrategy",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "colwise",
    "expand_plan",
    "rowwise",
    "tensor_parallel_plan",
]

M = TypeVar("M", bound=nn.Module)
# A plan: module name (or fnmatch pattern, "model.layers.*.mlp.down_proj") -> style, or a
# function of the model that returns one.
Plan = Union[Mapping[str, ParallelStyle], Callable[[nn.Module], Mapping[str, ParallelStyle]]]


def colwise() -> ColwiseParallel:
    """Replicated input -> output sharded on the last dim (a local tensor)."""
    return ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))


def rowwise() -> RowwiseParallel:
    """Input sharded on the last dim -> output replicated (all-reduce of the partial sums)."""
    return RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())


def tensor_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan for ``model``: per block present in ``model.layers``,
    q/k/v and MLP up column-wise, o and MLP down row-wise; for ``TwoLayerMLP`` fc1 column-wise
    and fc2 row-wise. Other modules stay replicated."""
    if isinstance(model, TwoLayerMLP):
        return {"fc1": colwise(), "fc2": rowwise()}
    if isinstance(model, TinyTransformer):
        plan: dict[str, ParallelStyle] = {}
        for name in model.layers:
            prefix = f"layers.{name}"
            plan.update({
                f"{prefix}.attn.q": colwise(),
                f"{prefix}.attn.k": colwise(),
                f"{prefix}.attn.v": colwise(),
                f"{prefix}.attn.o": rowwise(),
                f"{prefix}.mlp.up": colwise(),
                f"{prefix}.mlp.down": rowwise(),
            })
        return plan
    raise TypeError(
        f"no tensor-parallel plan for {type(model).__name__}; allowed: TinyTransformer (or a "
        "pipeline stage of one), TwoLayerMLP. For another model call parallelize_module with "
        "your own plan"
    )


def expand_plan(model: nn.Module, plan: Plan | None) -> dict[str, ParallelStyle]:
    """``plan`` as ``parallelize_module`` takes it: a callable is called with ``model``, and
    each key that is a pattern (``*``, ``?``, ``[...]``, matched with :mod:`fnmatch` against the
    module names of ``model``) becomes the names it matches. None: :func:`tensor_parallel_plan`.
    A key that matches no module is an error naming close module names (a typo would otherwise
    leave that layer silently replicated)."""
    if plan is None:
        return tensor_parallel_plan(model)
    if callable(plan) and not isinstance(plan, Mapping):
        plan = plan(model)
    if not isinstance(plan, Mapping):
        raise TypeError(f"a tensor-parallel plan is a mapping of module names to ParallelStyle, got {type(plan).__name__}")
    names = [n for n, _ in model.named_modules() if n]
    expanded: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"plan entry {key!r}: {style!r} is not a torch.distributed.tensor.parallel.ParallelStyle")
        matched = [n for n in names if fnmatch.fnmatchcase(n, key)] if any(c in key for c in "*?[") else [key] if key in names else []
        if not matched:
            close = difflib.get_close_matches(re.sub(r"\*|\?|\[[^]]*\]", "0", key), names, n=3, cutoff=0.5) or names[:5]
            raise ValueError(
                f"tensor-parallel plan entry {key!r} matches no module of {type(model).__name__}; "
                f"closest module names: {close}"
            )
        for name in matched:
            expanded[name] = style
    return expanded


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Raise :class:`ParallelConfigError` when ``model``'s split dims do not divide by ``tp``:
    head count, hidden size and MLP width of a ``TinyTransformer``, fc1's width of an MLP."""
    if isinstance(model, TinyTransformer):
        ParallelDims(tp=tp).check_model({k: model.config[k] for k in ("heads", "dim", "hidden")})
    elif isinstance(model, TwoLayerMLP) and model.fc1.out_features % tp:
        raise ParallelConfigError(f"MLP width fc1.out_features={model.fc1.out_features} is not divisible by tp={tp}")


def apply_tensor_parallel(model: M, tp_mesh: DeviceMesh, plan: Plan | None = None) -> M:
    """Shard ``model`` in place over the 1-D tensor-parallel mesh ``tp_mesh`` (e.g.
    ``mesh["tp"]``) with :func:`tensor_parallel_plan` (or ``plan``, see :func:`expand_plan`)
    and return it.

    Works on a pipeline stage: only the blocks it holds are planned, and missing embedding /
    norm / head are fine. Call it before any data-parallel wrapper (FSDP2, DDP)."""
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"apply_tensor_parallel needs a 1-D tensor-parallel mesh, got a {tp_mesh.ndim}-d mesh "
            f"{tp_mesh.mesh_dim_names}; pass mesh['tp']"
        )
    check_tensor_parallel(model, tp_mesh.size())
    parallelize_module(model, tp_mesh, expand_plan(model, plan))
    return model


class TensorParallelStrategy(StrategyBase):
    """Pure tensor parallelism over all ranks (tp = world size): every rank sees the whole
    batch and holds ``1/tp`` of each block's attention heads and MLP columns."""

    name = "tp"

    def __init__(self, plan: Plan | None = None, *, sum_grads: Sequence[str] = (), sharded_rng: Sequence[str] = ()):
        """``plan``: module names or fnmatch patterns -> ``ParallelStyle`` (or a function of the
        model returning that); default :func:`tensor_parallel_plan` for the bundled models.

        ``sum_grads``: fnmatch patterns of parameters the plan keeps replicated (plain tensors)
        whose gradients come from activations sharded over tp - the per-head q/k norms of Qwen3
        or OLMo under a head-sharding plan: each rank's gradient is a partial sum over its heads,
        so they are all-reduced over the tensor-parallel group after backward.

        ``sharded_rng``: fnmatch patterns of modules whose random draws fill tensors sharded over
        tp (attention dropout over each rank's heads): they draw from a generator of each rank's
        own (:class:`ShardedRegionRNG`, Megatron's model-parallel RNG tracker), so the ranks' heads
        get different masks, as one device's heads do."""
        self._plan = plan
        self._sum_grads = tuple(sum_grads)
        self._sharded_rng = tuple(sharded_rng)

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list) -> list:
        losses = super().forward_backward(case, setup, micro_batches)
        patterns = getattr(self, "_sum_grads", ())  # subclasses may not call __init__
        if patterns:
            group = setup.state["mesh"].get_group()
            for name, param in setup.model.named_parameters():
                if param.grad is not None and any(fnmatch.fnmatchcase(name, p) for p in patterns):
                    dist.all_reduce(param.grad, group=group)
        return losses

    def plan(self, model: nn.Module) -> dict[str, ParallelStyle]:
        """The plan applied (pass ``plan=`` or override to try another one)."""
        return expand_plan(model, getattr(self, "_plan", None))

    def setup(self, case: Case, ctx: DistContextLike) -> RankSetup:
        dims = ParallelDims(tp=ctx.world_size)
        model = case.build_model(ctx.device)
        mesh = dims.build_mesh(ctx.device.type)
        apply_tensor_parallel(model, mesh, self.plan(model))
        patterns = getattr(self, "_sharded_rng", ())
        if patterns:
            ShardedRegionRNG(case.seed, mesh.get_local_rank()).attach(model, patterns)
        return RankSetup.on_mesh(case, ctx, model, dims, mesh)



class ShardedRegionRNG:
    """Megatron's model-parallel RNG tracker on the CPU generator: modules matching the given
    patterns draw from a generator state of this tensor-parallel rank's own (seeded with
    ``seed + 2718 + tp_rank``, Megatron's offset), everything else from the default generator
    that every rank of the group shares. Regions whose tensors are sharded over tp (each rank's
    heads) then get independent masks; replicated regions identical ones."""

    OFFSET = 2718

    def __init__(self, seed: int, tp_rank: int):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + self.OFFSET + tp_rank)
            self.state = torch.get_rng_state()
        self._saved: list[torch.Tensor] = []

    def attach(self, model: nn.Module, patterns: Sequence[str]) -> None:
        matched = [m for name, m in model.named_modules() if name and any(fnmatch.fnmatchcase(name, p) for p in patterns)]
        if not matched:
            raise ValueError(f"sharded_rng patterns {list(patterns)} match no module of {type(model).__name__}")
        for module in matched:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self._saved.append(torch.get_rng_state())
        torch.set_rng_state(self.state)

    def _exit(self, module: nn.Module, args: tuple, output: object) -> None:
        self.state = torch.get_rng_state()
        torch.set_rng_state(self._saved.pop())
