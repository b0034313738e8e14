"""The strategy protocol: how a parallel strategy wraps the model, picks its rank's data, runs
forward/backward and steps. The harness owns the training loop and the recording, so a
strategy (or a deliberately buggy variant of one) is a few small methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from reference.case import Batch, Case, collate
from reference.schedule import batch_weight, replica_micro_batch_indices

from harness.parallel_dims import RankLayout

__all__ = ["DistContextLike", "RankSetup", "Strategy", "StrategyBase", "default_checkpoint_state", "default_rank_state",
           "load_default_checkpoint_state",
           "rng_state", "set_rng_state"]


@runtime_checkable
class DistContextLike(Protocol):
    """What a strategy needs to know about its rank (the pytest plugin's ``dist_ctx`` fits)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str

    @property
    def device(self) -> torch.device: ...


@dataclass
class RankSetup:
    """What :meth:`Strategy.setup` returns for its rank.

    ``model`` is the wrapped model (or the list of local pipeline chunks) whose parameter
    names, once wrapper prefixes are stripped, are the reference's; ``optimizer`` steps its
    parameters; ``layout`` says which replica/stage the rank is; ``state`` holds anything else
    the strategy needs later (a pipeline schedule, device meshes, ...)."""

    model: nn.Module | Sequence[nn.Module]
    optimizer: torch.optim.Optimizer
    layout: RankLayout
    device: torch.device
    state: dict[str, Any] = field(default_factory=dict)
    # The case's lr schedule over ``optimizer`` (the harness builds it after setup when the
    # case has one and the strategy did not; it is stepped after every optimizer step).
    lr_scheduler: Any = None

    def start_lr_scheduler(self, case: Case) -> None:
        """Build the case's lr scheduler over ``optimizer`` unless the strategy built its own."""
        if self.lr_scheduler is None:
            self.lr_scheduler = case.build_lr_scheduler(self.optimizer)

    def step_lr_scheduler(self) -> None:
        """After the optimizer step: the lr of the next step."""
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    @classmethod
    def on_mesh(cls, case: Case, ctx: DistContextLike, model: nn.Module, dims: Any, mesh: Any, **state: Any) -> RankSetup:
        """The setup of a model parallelized over ``dims``' (:class:`~harness.parallel_dims.ParallelDims`)
        ``mesh``: the case's optimizer over its parameters, the rank's layout from ``dims``,
        and ``mesh`` / ``dims`` (plus ``state``) kept for later steps."""
        return cls(
            model=model,
            optimizer=case.build_optimizer(model.parameters()),
            layout=dims.layout(ctx.rank),
            device=ctx.device,
            state={"mesh": mesh, "dims": dims, **state},
        )


@runtime_checkable
class Strategy(Protocol):
    name: str

    def setup(self, case: Case, ctx: DistContextLike) -> RankSetup:
        """Build the model with ``case.build_model`` (same weights everywhere), parallelize
        it, and build the optimizer with ``case.build_optimizer``."""
        ...

    def local_batches(self, case: Case, setup: RankSetup, step: int) -> list[Batch]:
        """The micro-batches this rank consumes at ``step`` (with their sample ids)."""
        ...

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
        """Run forward and backward over the micro-batches so that the gradients are those of
        the mean loss over the global batch (see :meth:`Case.loss_weight`). Return each
        micro-batch's unweighted mean loss, or None where this rank computes no loss."""
        ...

    def optimizer_step(self, case: Case, setup: RankSetup) -> None:
        """Apply the optimizer (gradients are zeroed by the harness after recording)."""
        ...


# -- a checkpoint's defaults (harness.record.checkpoint saves and loads them) -------------------
def _modules(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _state_dict_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def rng_state() -> dict[str, torch.Tensor]:
    """This rank's torch RNG: the CPU generator and, with CUDA, the current device's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def default_checkpoint_state(case: Any, setup: Any) -> dict[str, Any]:
    """``{"model", "optim"}`` from ``get_state_dict`` (DCP's, by fully qualified name, any
    wrapper stripped) and ``{"rank": {"rng", "lr_scheduler"}}`` of this rank. The optimizer's
    state dict is flattened (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``, torchtitan's
    choice): nested, its ``param_groups.0.*`` keys name a group by its index, and pipeline
    stages, whose groups hold different parameters, would overwrite each other's in DCP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    models = _modules(setup.model)
    model_sd, optim_sd = get_state_dict(models if len(models) > 1 else models[0], setup.optimizer,
                                        options=_state_dict_options())
    return {"model": model_sd, "optim": optim_sd, "rank": default_rank_state(setup)}


def default_rank_state(setup: Any) -> dict[str, Any]:
    """This rank's own part of a checkpoint: ``{"rng"}``, with one ``{"lr_scheduler"}``, and
    the digests of its model's persistent buffers (``{"buffers"}``: the load gate's witness of
    state the forward reads that no optimizer holds; the buffers themselves travel with the
    model's state dict)."""
    rank: dict[str, Any] = {"rng": rng_state()}
    if setup.lr_scheduler is not None:
        rank["lr_scheduler"] = setup.lr_scheduler.state_dict()
    buffers = buffer_digests(setup.model)
    if buffers:
        rank["buffers"] = buffers
    return rank


def buffer_digests(model: nn.Module | Sequence[nn.Module] | None) -> dict[str, str]:
    """Name -> SHA-256 prefix of each persistent buffer of ``model`` (this rank's local values:
    a DTensor's shard), as ``state_dict()`` names it."""
    import hashlib

    if model is None:
        return {}
    out: dict[str, str] = {}
    for i, module in enumerate(_modules(model)):
        prefix = f"{i}." if not isinstance(model, nn.Module) else ""
        for owner_name, owner in module.named_modules():
            for name, buffer in owner.named_buffers(recurse=False):
                if buffer is None or name in getattr(owner, "_non_persistent_buffers_set", ()):
                    continue
                if hasattr(buffer, "to_local") and not all(p.is_replicate() for p in buffer.placements):
                    continue  # a sharded buffer's local piece depends on the layout: not one value to witness
                local = buffer.to_local() if hasattr(buffer, "to_local") else buffer
                data = local.detach().to("cpu").contiguous().reshape(-1)
                key = f"{prefix}{owner_name + '.' if owner_name else ''}{name}"
                out[key] = hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16] if data.numel() else "empty"
    return out


def load_default_checkpoint_state(case: Any, setup: Any, state: dict[str, Any]) -> None:
    """Apply what :func:`default_checkpoint_state` saved (``set_state_dict``, the RNG and the
    lr scheduler); per-rank parts that were not transferable to this layout are absent."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    models = _modules(setup.model)
    set_state_dict(models if len(models) > 1 else models[0], setup.optimizer,
                   model_state_dict=state["model"], optim_state_dict=state["optim"], options=_state_dict_options())
    rank = state.get("rank", {})
    if "rng" in rank:
        set_rng_state(rank["rng"])
    if setup.lr_scheduler is not None and "lr_scheduler" in rank:
        setup.lr_scheduler.load_state_dict(rank["lr_scheduler"])



def accumulate_micro_batches(
    case: Case,
    setup: RankSetup,
    micro_batches: list[Batch],
    *,
    model: Any = None,
    grad_reduction: str = "mean",
    scale: float = 1.0,
    sync: Callable[[bool], Any] | None = None,
    forward: Callable[[Any, Batch], torch.Tensor] | None = None,
) -> list[torch.Tensor | None]:
    """The micro-batch loop of a strategy: each micro-batch's loss (``forward(model, batch)``,
    default :meth:`~reference.case.Case.forward_loss`), weighted by
    :meth:`~reference.case.Case.loss_weight` over the layout's data-parallel replicas (times
    ``scale``: 1 unless the weighting itself is what a variant changes), then ``backward``;
    gradients accumulate over the micro-batches. ``sync(last)`` is called before each one and
    may return a context manager the micro-batch runs in (DDP: ``no_sync()`` on all but the
    last; FSDP2: ``set_requires_gradient_sync(last)``). Returns the unweighted losses where
    this rank holds its replica's loss (``layout.holds_loss``), else None."""
    model = setup.model if model is None else model
    forward = forward or case.forward_loss
    losses: list[torch.Tensor | None] = []
    for i, batch in enumerate(micro_batches):
        context = sync(i == len(micro_batches) - 1) if sync is not None else None
        with context if context is not None else contextlib.nullcontext():
            loss = forward(model, batch)
            weight = batch_weight(case, batch, setup.layout.dp_size, grad_reduction=grad_reduction)
            (loss * weight * scale if scale != 1.0 else loss * weight).backward()
        losses.append(loss.detach() if setup.layout.holds_loss else None)
    return losses


class StrategyBase:
    """Defaults shared by most strategies: data follows ``DistributedSampler`` over the
    layout's data-parallel replicas; forward and backward are :meth:`accumulate` over the
    micro-batches; the optimizer step is ``optimizer.step()``."""

    name = "strategy"

    def accumulate(self, case: Case, setup: RankSetup, micro_batches: list[Batch], **options: Any) -> list[torch.Tensor | None]:
        """:func:`accumulate_micro_batches` (its keyword ``options``: ``model``,
        ``grad_reduction``, ``scale``, ``sync``, ``forward``)."""
        return accumulate_micro_batches(case, setup, micro_batches, **options)

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
        """Every micro-batch's weighted loss backward on ``setup.model`` (no sync of its own:
        a strategy synchronizes in its model wrapper or overrides this)."""
        return self.accumulate(case, setup, micro_batches)

    def local_batches(self, case: Case, setup: RankSetup, step: int) -> list[Batch]:
        layout = setup.layout
        return [
            collate(case.dataset, indices, device=setup.device, dtype=case.dtype, step=step)
            for indices in replica_micro_batch_indices(case, step, layout.dp_rank, layout.dp_size)
        ]

    def clip_gradients(self, case: Case, setup: RankSetup) -> None:
        """Clip to ``case.grad_clip`` before the gradients are recorded (no-op without it);
        :meth:`reference.case.Case.clip_gradients` reduces DTensor norms over their shards."""
        if case.grad_clip is not None:
            models = [setup.model] if isinstance(setup.model, nn.Module) else list(setup.model)
            case.clip_gradients(p for m in models for p in m.parameters())

    def optimizer_step(self, case: Case, setup: RankSetup) -> None:
        setup.optimizer.step()

    def checkpoint_state(self, case: Case, setup: RankSetup) -> dict[str, Any]:
        """What a checkpoint of this rank holds: ``{"model", "optim"}`` (saved and resharded by
        DCP) and ``{"rank": {...}}`` (this rank's own: RNG, lr scheduler; a strategy that keeps
        a data position adds it here), see :mod:`harness.record.checkpoint`."""
        return default_checkpoint_state(case, setup)

    def load_checkpoint_state(self, case: Case, setup: RankSetup, state: dict[str, Any]) -> None:
        """Apply a loaded :meth:`checkpoint_state` to this freshly set-up rank."""
        load_default_checkpoint_state(case, setup, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
