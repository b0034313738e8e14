"""Fully sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Every rank is a data-parallel replica that holds only a dim-0 shard (a ``DTensor``) of each
parameter, its gradient and its optimizer state. ``fully_shard`` is applied bottom-up: to each
transformer block (one all-gather / reduce-scatter group per block), then to the root, which
takes the remaining parameters (embedding, positions, final norm, head). For models without
blocks (the two-layer MLP) each direct child that owns parameters is its own group.

FSDP2 reduce-scatters gradients *averaged* over the data-parallel ranks, exactly like DDP, so
each micro-batch's mean loss is weighted by :meth:`Case.loss_weight` with the dp size. With
several micro-batches, ``set_requires_gradient_sync(False)`` keeps unsharded gradients local
until the last one (FSDP2's ``no_sync``): one reduce-scatter per step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from harness.parallel_dims import ParallelDims
from harness.strategy import DistContextLike, RankSetup, StrategyBase, accumulate_micro_batches
from reference.case import Batch, Case

__all__ = ["FSDPStrategy", "apply_fsdp", "blocks_of_class", "fsdp_units", "repeated_blocks", "run_accumulating", "sum_gradients"]


def repeated_blocks(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The model's repeated block list: the ``ModuleList`` / ``ModuleDict`` of two or more
    children of one class that each own parameters, holding the most parameters (a Hugging Face
    ``model.layers`` or ``transformer.h``, torchtitan's ``layers``, ``TinyTransformer.layers``).
    Returns its name and blocks, or None."""
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        blocks = list(module.values()) if isinstance(module, nn.ModuleDict) else list(module)
        if len(blocks) < 2 or len({type(b) for b in blocks}) != 1:
            continue
        sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
        if min(sizes) == 0:
            continue
        if best is None or sum(sizes) > best[0]:
            best = (sum(sizes), name, blocks)
    return (best[1], best[2]) if best is not None else None


def blocks_of_class(*classes: type | str) -> Callable[[nn.Module], list[nn.Module]]:
    """FSDP units: every submodule of one of ``classes`` (types or class names such as
    ``"LlamaDecoderLayer"``), outermost first; nested matches inside a matched unit are skipped."""
    wanted = tuple(c for c in classes if isinstance(c, type))
    names = {c for c in classes if isinstance(c, str)}

    def units(model: nn.Module) -> list[nn.Module]:
        found: list[nn.Module] = []
        inside: set[str] = set()
        for name, module in model.named_modules():
            if module is model or any(name.startswith(p + ".") for p in inside):
                continue
            if isinstance(module, wanted) or type(module).__name__ in names:
                found.append(module)
                inside.add(name)
        if not found:
            raise ValueError(
                f"FSDP units: {type(model).__name__} has no submodule of class "
                f"{sorted(names | {c.__name__ for c in wanted})}; its classes include "
                f"{sorted({type(m).__name__ for m in model.modules()})[:12]}"
            )
        return found

    units.__name__ = f"blocks_of_class({', '.join(sorted(names | {c.__name__ for c in wanted}))})"
    return units


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The submodules that get their own ``fully_shard`` group: the blocks of the model's
    repeated block list (:func:`repeated_blocks`). A model without one falls back to every
    direct child that owns parameters, with a warning naming them. The root is sharded after
    these and takes what is left."""
    found = repeated_blocks(model)
    if found is not None:
        return found[1]
    children: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            # A container has no forward to wrap (a pipeline stage's one block in its ModuleDict):
            # its members are the units.
            members = child.items() if isinstance(child, nn.ModuleDict) else enumerate(child)
            children += [(f"{name}.{k}", m) for k, m in members if any(True for _ in m.parameters())]
        elif any(True for _ in child.parameters()):
            children.append((name, child))
    warnings.warn(
        f"FSDP units: {type(model).__name__} has no repeated block list (a ModuleList of one block "
        f"class); sharding each direct child that owns parameters instead: {[n for n, _ in children]}. "
        "Pass units=blocks_of_class(...) to choose",
        stacklevel=2,
    )
    return [c for _, c in children]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    units: Callable[[nn.Module], list[nn.Module]] | None = fsdp_units,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """``fully_shard`` each unit of ``model`` (``units(model)``; None: root only), then the
    root, over the 1-D data-parallel mesh ``dp_mesh``. Parameters that are already DTensors
    on a sibling mesh (tensor parallelism) become 2-D DTensors. Returns ``model`` (now an
    ``FSDPModule``)."""
    if dp_mesh.ndim != 1:
        raise ValueError(
            f"apply_fsdp shards over a 1-D data-parallel mesh, got a {dp_mesh.ndim}-d mesh "
            f"{dp_mesh.mesh_dim_names}; pass mesh['dp']"
        )
    for unit in units(model) if units is not None else []:
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    # The root's parameters are used first in backward's last step: no point resharding them.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    return model


def run_accumulating(case: Case, setup: RankSetup, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
    """Forward/backward over ``micro_batches`` of an FSDP2 root model: gradients stay unsharded
    and local until the last micro-batch, whose backward reduce-scatters (averaging over dp).
    Returns each micro-batch's unweighted mean loss where this rank holds the loss."""
    model = setup.model
    if not isinstance(model, FSDPModule):
        raise TypeError(f"run_accumulating needs a fully_shard-ed root module, got {type(model).__name__}")
    # Reduce-scatter only in the last micro-batch's backward.
    return accumulate_micro_batches(case, setup, micro_batches, grad_reduction=setup.state.get("grad_reduction", "mean"),
                                    sync=model.set_requires_gradient_sync)


def sum_gradients(model: nn.Module) -> None:
    """Make every FSDP2 group of ``model`` *sum* its reduce-scattered gradients over the
    data-parallel ranks instead of averaging them (torchtitan's convention, which scales the
    loss itself): divide factor 1 and a plain SUM (gloo has no PREMUL_SUM)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


class FSDPStrategy(StrategyBase):
    """FSDP2 over all ranks: one ``fully_shard`` group per block plus the root.

    ``units=None`` shards only the root (one group for the whole model);
    ``reshard_after_forward=False`` keeps unsharded parameters between forward and backward
    (ZeRO-2-like)."""

    name = "fsdp"

    def __init__(
        self,
        *,
        units: Callable[[nn.Module], list[nn.Module]] | None = fsdp_units,
        reshard_after_forward: bool = True,
        grad_reduction: str = "mean",
    ):
        """``grad_reduction="sum"``: gradients are summed over the dp ranks (torchtitan's
        convention) and the loss weight says so (:meth:`reference.case.Case.loss_weight`)."""
        if grad_reduction not in ("mean", "sum"):
            raise ValueError(f"FSDPStrategy: grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
        self.units = units
        self.reshard_after_forward = reshard_after_forward
        self.grad_reduction = grad_reduction

    def setup(self, case: Case, ctx: DistContextLike) -> RankSetup:
        dims = ParallelDims(dp=ctx.world_size)
        mesh = dims.build_mesh(ctx.device.type)
        model = case.build_model(ctx.device)
        apply_fsdp(model, mesh, units=self.units, reshard_after_forward=self.reshard_after_forward)
        if self.grad_reduction == "sum":
            sum_gradients(model)
        return RankSetup.on_mesh(case, ctx, model, dims, mesh, grad_reduction=self.grad_reduction)

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
        return run_accumulating(case, setup, micro_batches)

    def __repr__(self) -> str:
        units = "root only" if self.units is None else getattr(self.units, "__name__", repr(self.units))
        return f"FSDPStrategy(units={units}, reshard_after_forward={self.reshard_after_forward})"
