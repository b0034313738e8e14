"""What a user hands over: the case (model, data with sample ids, loss, optimizer, schedule).

A case is a plain dataclass so it is easy to write in a test file. Everything random in it is
driven by ``seed``: the harness seeds torch's global RNG before calling ``model_factory``, so
the same case builds the same weights in every process.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import default_collate

__all__ = [
    "Batch",
    "Case",
    "CaseError",
    "Sample",
    "callable_name",
    "cast_floating",
    "SampleDataset",
    "check_dataset",
    "collate",
    "map_tensors",
    "tensors_in",
    "to_batch_values",
]


class CaseError(ValueError):
    """The case cannot be trained or compared as given (the message says what and why)."""


class Sample(NamedTuple):
    """One dataset item. ``id`` is stable and unique within the dataset; it is what the
    harness records to prove which samples each rank consumed. A named tuple, so that
    ``torch.utils.data.default_collate`` stacks a list of them into one ``Sample`` of batched
    ``id``, ``input`` and ``target`` (a framework's own ``DataLoader`` needs no collate_fn).

    ``input`` is a tensor, or a dict of tensors (``input_ids``, ``attention_mask``,
    ``labels``, ...: the model is then called with keyword arguments), or a tuple of them
    (positional arguments). ``target`` is what ``Case.loss_fn`` compares the output with; None
    where the model computes its own loss (``labels`` inside ``input``)."""

    id: int
    input: Any
    target: Any = None


@runtime_checkable
class SampleDataset(Protocol):
    """A map-style dataset whose items are :class:`Sample`. Also accepted: anything with
    ``id``, ``input`` and ``target`` attributes, and mappings with an ``"id"`` key - the
    other keys are the input (``{"id": 7, "input_ids": ..., "labels": ...}``; ``"input"`` /
    ``"target"`` keys are taken as such when present)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...


@dataclass(frozen=True)
class Batch:
    """A (micro-)batch: the stacked inputs/targets and the ids of the samples in it."""

    ids: tuple[int, ...]
    inputs: Any  # a tensor, or a dict / tuple of tensors, stacked along dim 0
    targets: Any  # likewise; None where the model computes its own loss
    step: int | None = None  # the training step it belongs to, where the harness collated it

    def __len__(self) -> int:
        return len(self.ids)


def _sample_at(dataset: SampleDataset, index: int) -> Sample:
    item = dataset[index]
    if isinstance(item, Mapping) and "id" in item:
        rest = {k: v for k, v in item.items() if k != "id"}
        if "input" in rest:
            item = Sample(id=item["id"], input=rest["input"], target=rest.get("target"))
        else:
            target = rest.pop("target", None)
            item = Sample(id=item["id"], input=rest, target=target)
    missing = [a for a in ("id", "input") if not hasattr(item, a)]
    if missing:
        raise CaseError(
            f"dataset {type(dataset).__name__}[{index}] is a {type(item).__name__} without "
            f"{', '.join(missing)}: every sample must carry an id (reference.case.Sample(id, "
            "input, target), or a dict with an 'id' key) so the harness can trace which samples "
            "each rank consumed"
        )
    if isinstance(item.id, bool) or not isinstance(item.id, int):
        raise CaseError(
            f"dataset {type(dataset).__name__}[{index}].id is {item.id!r} "
            f"({type(item.id).__name__}); sample ids must be Python ints"
        )
    if not hasattr(item, "target"):
        item = Sample(id=item.id, input=item.input, target=None)
    return item  # type: ignore[return-value]


def check_dataset(dataset: Any, indices: Iterable[int] | None = None) -> None:
    """Raise :class:`CaseError` unless ``dataset`` is map-style with samples that carry unique
    int ids. Checks ``indices`` (default: all of it)."""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise CaseError(
            f"dataset {type(dataset).__name__} is not map-style (needs __len__ and "
            "__getitem__ returning reference.case.Sample)"
        )
    seen: dict[int, int] = {}
    for index in range(len(dataset)) if indices is None else indices:
        sid = _sample_at(dataset, index).id
        if sid in seen:
            raise CaseError(
                f"dataset {type(dataset).__name__}: samples {seen[sid]} and {index} share id "
                f"{sid}; ids must be unique so duplicated or dropped samples can be detected"
            )
        seen[sid] = index


def callable_name(fn: Any) -> str:
    """A readable name for a factory: ``module.qualname``, with ``functools.partial``
    arguments spelled out."""
    if isinstance(fn, functools.partial):
        args = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in sorted(fn.keywords.items())]
        return f"partial({callable_name(fn.func)}{''.join(', ' + a for a in args)})"
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qualname}"


def cast_floating(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``model``'s floating-point parameters and buffers to ``dtype`` in place and return
    it. Unlike ``model.to(dtype)``, complex tensors (torchtitan's complex64 RoPE cache) and
    integer ones are left alone: ``.to`` would drop a complex tensor's imaginary part."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                module._buffers[name] = buf.to(dtype)
    return model


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and every buffer, persistent or not (a non-persistent RoPE cache is not in the
    state dict but decides the forward all the same)."""
    state = dict(model.state_dict())
    for name, buf in model.named_buffers():
        state.setdefault(name, buf)
    return state


def _to_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    # Only floating tensors follow the case dtype; token ids and class labels stay integral.
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``fn`` applied to every tensor in ``value`` (a tensor, or dicts / tuples / lists of
    them); anything else is kept as it is."""
    return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, value)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or dicts / tuples / lists of them), in order."""
    return [v for v in tree_leaves(value) if isinstance(v, torch.Tensor)]


def to_batch_values(value: Any, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Any:
    """Floating tensors in ``value`` cast to ``dtype``, every tensor moved to ``device``."""
    return map_tensors(lambda t: _to_dtype(t, dtype).to(device) if device is not None else _to_dtype(t, dtype), value)


def collate(
    dataset: SampleDataset,
    indices: Sequence[int],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    step: int | None = None,
) -> Batch:
    """Stack the samples at ``indices`` into a :class:`Batch` on ``device`` (dicts and tuples
    of tensors key by key, as ``torch.utils.data.default_collate`` does); floating tensors are
    cast to ``dtype``. ``step``: the training step the batch is for (what a case's
    ``loss_normaliser`` needs to weight it)."""
    if not indices:
        raise CaseError("cannot collate an empty batch")
    samples = [_sample_at(dataset, int(i)) for i in indices]
    inputs = default_collate([s.input for s in samples])
    targets = None if all(s.target is None for s in samples) else default_collate([s.target for s in samples])
    return Batch(
        ids=tuple(s.id for s in samples),
        inputs=to_batch_values(inputs, device=device, dtype=dtype),
        targets=to_batch_values(targets, device=device, dtype=dtype),
        step=step,
    )


LOSS_REDUCTIONS = ("mean", "sum")
GRAD_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True, eq=False)
class Case:
    """A training problem with a known single-device answer.

    - ``model_factory()`` builds the model; it is called right after ``torch.manual_seed(seed)``
      and must be deterministic given that (checked: two builds must be identical).
    - ``dataset`` is map-style with :class:`Sample` items carrying unique ids.
    - ``loss_fn(output, targets)`` returns the loss of the micro-batch it is given: with
      ``loss_reduction="mean"`` (default) the *mean* over its samples (like ``F.mse_loss`` /
      ``F.cross_entropy`` defaults), with ``"sum"`` their sum. ``loss_fn=None``: the model
      computes its own loss (a Hugging Face model called with ``labels``: ``output.loss``, which
      is a mean). :meth:`loss_weight` turns either into the gradient of the mean loss over the
      global batch, for gradients averaged (DDP, FSDP) or summed (torchtitan) over replicas.
    - ``optimizer_factory(params)`` builds the optimizer, e.g. ``functools.partial(AdamW, lr=1e-2)``.
    - Each step consumes ``global_batch_size`` samples in ``micro_batches`` equal micro-batches
      (gradient accumulation); the order follows ``torch.utils.data.DistributedSampler``
      (``shuffle`` with ``seed + epoch``), see :mod:`reference.schedule`.
    - ``dtype`` is the dtype of parameters and floating inputs.
    """

    name: str
    model_factory: Callable[[], nn.Module]
    dataset: SampleDataset
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    global_batch_size: int
    micro_batches: int = 1
    steps: int = 3
    seed: int = 0
    dtype: torch.dtype = torch.float32
    # Whether each global batch is drawn from a shuffled epoch order (DistributedSampler's
    # shuffle, seeded with seed + epoch) or in dataset order.
    shuffle: bool = True
    # What loss_fn returns per micro-batch: "mean" or "sum" over its samples.
    loss_reduction: str = "mean"
    # Gradient clipping before each optimizer step: the largest total 2-norm of all gradients
    # (torch.nn.utils.clip_grad_norm_), None for none. The reference clips the same way, and
    # the recorded gradients are the clipped ones the optimizer uses.
    grad_clip: float | None = None
    # What a micro-batch's loss is a mean over, when not its samples: a function of the Batch
    # returning that count (the valid tokens of a masked loss: ``lambda b: b.targets["mask"].sum()``).
    # The step's loss is then the mean over all of the step's units, every micro-batch weighted
    # by its count (as a loop normalising by the step's token count computes it).
    loss_normaliser: Callable[[Batch], Any] | None = None
    # Statistics the program computes per data-parallel replica *on purpose* (names of modules
    # - a BatchNorm without sync - or "loss" for the loss itself: a router's load-balancing loss, a
    # per-replica token mean): the contract is then each replica's micro-batches computed on
    # their own and combined as the layout combines them (see README, "per-replica statistics").
    per_replica: tuple[str, ...] = ()
    # The learning-rate schedule: ``lr_scheduler_factory(optimizer)`` builds a
    # ``torch.optim.lr_scheduler`` stepped once after every optimizer step (None: a constant lr).
    # Every trainer steps it the same way, and a checkpoint holds its state.
    lr_scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`CaseError` for numbers that cannot form a batch schedule."""
        where = f"case {self.name!r}"
        for field_name in ("global_batch_size", "micro_batches", "steps"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CaseError(f"{where}: {field_name} must be a positive int, got {value!r}")
        if self.global_batch_size % self.micro_batches:
            raise CaseError(
                f"{where}: global_batch_size {self.global_batch_size} is not divisible by "
                f"micro_batches {self.micro_batches}; micro-batches must be equal"
            )
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise CaseError(f"{where}: dtype must be a floating torch.dtype, got {self.dtype!r}")
        for field_name in ("model_factory", "optimizer_factory"):
            if not callable(getattr(self, field_name)):
                raise CaseError(f"{where}: {field_name} must be callable")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise CaseError(f"{where}: loss_fn must be callable, or None when the model returns its own loss")
        if self.grad_clip is not None and (isinstance(self.grad_clip, bool) or not isinstance(self.grad_clip, (int, float))
                                           or not (self.grad_clip > 0 and math.isfinite(self.grad_clip))):
            raise CaseError(f"{where}: grad_clip must be a finite max norm > 0 or None, got {self.grad_clip!r}")
        if self.loss_normaliser is not None and not callable(self.loss_normaliser):
            raise CaseError(f"{where}: loss_normaliser must be a function of the Batch (or None), got {self.loss_normaliser!r}")
        if isinstance(self.per_replica, str) or not all(isinstance(n, str) and n for n in self.per_replica):
            raise CaseError(f"{where}: per_replica must be a tuple of module names or 'loss', got {self.per_replica!r}")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise CaseError(f"{where}: loss_reduction must be one of {LOSS_REDUCTIONS}, got {self.loss_reduction!r}")
        if not hasattr(self.dataset, "__len__") or not hasattr(self.dataset, "__getitem__"):
            raise CaseError(
                f"{where}: dataset {type(self.dataset).__name__} is not map-style "
                "(needs __len__ and __getitem__ returning reference.case.Sample)"
            )
        if len(self.dataset) < self.global_batch_size:
            raise CaseError(
                f"{where}: dataset has {len(self.dataset)} samples, fewer than one global "
                f"batch ({self.global_batch_size})"
            )

    # -- derived quantities -------------------------------------------------------------------

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch of the whole step (all replicas together)."""
        return self.global_batch_size // self.micro_batches

    @property
    def steps_per_epoch(self) -> int:
        # Like DataLoader(drop_last=True): a partial global batch at the epoch's end is skipped.
        return len(self.dataset) // self.global_batch_size

    def loss_weight(self, num_samples: int, replicas: int = 1, *, grad_reduction: str = "mean") -> float:
        """Factor for a micro-batch's loss (as ``loss_fn`` returns it) before ``backward``, so
        the synchronized gradient is that of the mean loss over the global batch.

        ``replicas`` data-parallel replicas whose gradients are *averaged* (``grad_reduction=
        "mean"``: DDP, FSDP) or *summed* (``"sum"``: torchtitan, a hand-written SUM all-reduce):

        | loss_reduction | grad "mean" | grad "sum" |
        |---|---|---|
        | "mean" | num_samples * replicas / B | num_samples / B |
        | "sum" | replicas / B | 1 / B |

        with B the global batch size."""
        if grad_reduction not in GRAD_REDUCTIONS:
            raise CaseError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {grad_reduction!r}")
        per_loss = num_samples if self.loss_reduction == "mean" else 1
        per_sync = replicas if grad_reduction == "mean" else 1
        return per_loss * per_sync / self.global_batch_size

    def collate_ids(self, sample_ids: Sequence[int], *, step: int | None = None) -> Batch:
        """The batch of the dataset's samples with these ids (a loop's own loader names its
        samples by id; the case's normaliser and the probe's expected input read them)."""
        index = self.__dict__.get("_index_of_id")
        if index is None:
            index = {_sample_at(self.dataset, i).id: i for i in range(len(self.dataset))}
            object.__setattr__(self, "_index_of_id", index)  # a cache, not a field
        return collate(self.dataset, [index[int(i)] for i in sample_ids], dtype=self.dtype, step=step)

    def normaliser(self, batch: Batch) -> float:
        """What ``batch``'s loss is a mean over: ``loss_normaliser(batch)`` (a token count),
        else its number of samples."""
        if self.loss_normaliser is None:
            return float(len(batch))
        value = self.loss_normaliser(batch)
        value = float(value.detach().sum()) if isinstance(value, torch.Tensor) else float(value)
        if not (value >= 0 and math.isfinite(value)):
            raise CaseError(f"case {self.name!r}: loss_normaliser returned {value!r} for a batch; give a count >= 0")
        return value

    def combine_losses(self, losses: Sequence[tuple[float, float]]) -> float:
        """The loss of the samples of several pieces (``(loss, count)`` each, as ``loss_fn``
        returns it per piece, with its :meth:`normaliser`) as ``loss_fn`` would return it for
        them together: the count-weighted mean for "mean", the sum for "sum"."""
        if len(losses) == 1:
            return float(losses[0][0])
        if self.loss_reduction == "sum":
            return float(sum(loss for loss, _ in losses))
        total = sum(n for _, n in losses)
        return float(sum(loss * n for loss, n in losses) / total) if total else math.nan

    def mean_loss(self, total: float, num_samples: float) -> float:
        """A step's loss as recorded: the mean per sample (or per :meth:`normaliser` unit) over
        the global batch, from the ``combine_losses`` of all its samples."""
        return total if self.loss_reduction == "mean" else total / num_samples

    # -- forward ------------------------------------------------------------------------------

    @staticmethod
    def call_model(model: Any, inputs: Any) -> Any:
        """``model(**inputs)`` for a dict of inputs, ``model(*inputs)`` for a tuple or list,
        else ``model(inputs)``."""
        if isinstance(inputs, Mapping):
            return model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return model(*inputs)
        return model(inputs)

    def compute_loss(self, output: Any, targets: Any) -> torch.Tensor:
        """``loss_fn(output, targets)``, or the loss the model returned (``output.loss`` /
        ``output["loss"]``) when the case has no ``loss_fn``."""
        if self.loss_fn is not None:
            return self.loss_fn(output, targets)
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise CaseError(
                f"case {self.name!r} has no loss_fn and the model's output ({type(output).__name__}) "
                "carries no loss: pass the labels in the inputs (e.g. a 'labels' key) or give loss_fn"
            )
        return loss

    def clip_gradients(self, parameters: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """Clip the gradients of ``parameters`` to ``grad_clip`` (their total 2-norm, as
        ``torch.nn.utils.clip_grad_norm_``; DTensor gradients of FSDP2 / TP included, with plain
        replicated ones beside them) and return the norm before clipping; None without
        ``grad_clip``. Call it on every rank between backward and the optimizer step, before
        the harness records the gradients (custom loops: before ``run.before_step``)."""
        if self.grad_clip is None:
            return None
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return None
        # clip_grad_norm_'s arithmetic, but per tensor: a tensor-parallel model mixes DTensor
        # gradients (whose norm is reduced over their shards) with plain replicated ones, which
        # clip_grad_norm_'s foreach kernels refuse.
        norms = []
        for g in grads:
            n = torch.linalg.vector_norm(g.detach().float(), 2.0)
            norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = min(1.0, float(self.grad_clip / (total + 1e-6)))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    def forward_loss(self, model: Any, batch: Batch) -> torch.Tensor:
        """The micro-batch's loss (unweighted, as ``loss_fn`` returns it) from ``model``."""
        return self.compute_loss(self.call_model(model, batch.inputs), batch.targets)

    def describe(self) -> dict[str, Any]:
        """A JSON-able, human-readable summary (what a record's ``meta.json`` shows)."""
        return {
            "name": self.name,
            "model_factory": callable_name(self.model_factory),
            "dataset": f"{type(self.dataset).__module__}.{type(self.dataset).__qualname__}",
            "dataset_len": len(self.dataset),
            "loss_fn": callable_name(self.loss_fn) if self.loss_fn is not None else "the model's own output loss",
            "loss_reduction": self.loss_reduction,
            "grad_clip": self.grad_clip,
            "loss_normaliser": callable_name(self.loss_normaliser) if self.loss_normaliser is not None else None,
            "per_replica": list(self.per_replica),
            "optimizer_factory": callable_name(self.optimizer_factory),
            "global_batch_size": self.global_batch_size,
            "micro_batches": self.micro_batches,
            "steps": self.steps,
            "seed": self.seed,
            "dtype": str(self.dtype),
            "shuffle": self.shuffle,
            # Only when set, so the cache keys of cases without a schedule stay what they were.
            **({"lr_scheduler_factory": callable_name(self.lr_scheduler_factory)} if self.lr_scheduler_factory is not None else {}),
        }

    def replace(self, **changes: Any) -> "Case":
        """A copy with some fields changed (e.g. ``dtype=torch.float64`` for calibration)."""
        return dataclasses.replace(self, **changes)

    def with_steps(self, steps: int | None) -> "Case":
        """This case run for ``steps`` optimizer steps (``--steps``, ``steps=``); None keeps its own."""
        return self if steps is None or steps == self.steps else dataclasses.replace(self, steps=steps)

    def seed_training(self) -> None:
        """Start the training RNG (dropout, random masks) where the reference's starts: every
        trainer calls this right before its first step."""
        torch.manual_seed(self.seed)

    # -- building -----------------------------------------------------------------------------

    def build_model(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> nn.Module:
        """Seed, call ``model_factory``, cast to the case dtype and move to ``device``.

        Weights are created in float32 and then cast, so float64 / bf16 variants of the
        case start from the same values (up to rounding). Only floating-point parameters and
        buffers are cast (:func:`cast_floating`): complex ones (a RoPE cache) and integer ones
        stay as the factory made them."""
        torch.manual_seed(self.seed)
        model = self.model_factory()
        if not isinstance(model, nn.Module):
            raise CaseError(
                f"case {self.name!r}: model_factory returned {type(model).__name__}, "
                "expected torch.nn.Module"
            )
        model = cast_floating(model, dtype or self.dtype)
        if device is not None:
            model = model.to(device)
        return model.train()

    def build_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        opt = self.optimizer_factory(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise CaseError(
                f"case {self.name!r}: optimizer_factory returned {type(opt).__name__}, "
                "expected torch.optim.Optimizer"
            )
        return opt

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        """The case's learning-rate scheduler over ``optimizer`` (None without
        ``lr_scheduler_factory``); step it once after every optimizer step."""
        if self.lr_scheduler_factory is None:
            return None
        scheduler = self.lr_scheduler_factory(optimizer)
        if not callable(getattr(scheduler, "step", None)) or not callable(getattr(scheduler, "state_dict", None)):
            raise CaseError(
                f"case {self.name!r}: lr_scheduler_factory returned {type(scheduler).__name__}, "
                "expected a torch.optim.lr_scheduler.LRScheduler (with step() and state_dict())"
            )
        return scheduler

    def check_model_factory(self) -> None:
        """Raise :class:`CaseError` when two seeded builds differ (the strategy's ranks would
        then not start from the reference's weights)."""
        first, second = (_model_state(self.build_model(device="cpu")) for _ in range(2))
        if list(first) != list(second):
            raise CaseError(
                f"case {self.name!r}: model_factory is not deterministic: two builds have "
                f"different state-dict keys ({list(first)} vs {list(second)})"
            )
        for key, a in first.items():
            b = second[key]
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                diff = (
                    f"max abs diff {(a.double() - b.double()).abs().max().item():.3g}"
                    if a.shape == b.shape
                    else f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
                )
                raise CaseError(
                    f"case {self.name!r}: model_factory is not deterministic: two builds after "
                    f"torch.manual_seed({self.seed}) differ in {key!r} ({diff}). Create weights "
                    "from torch's global RNG (which the harness seeds) or seed inside the "
                    "factory; do not use unseeded random/numpy/time"
                )
