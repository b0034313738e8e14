"""What a user hands over: the case (model, data with sample ids, loss, optimizer, schedule).

A case is a plain dataclass so it is easy to write in a test file. Everything random in it is
driven by ``seed``: the harness seeds torch's global RNG before calling ``model_factory``, so
the same case builds the same weights in every process.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

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
]


class CaseError(ValueError):
    """The case cannot be trained or compared as given (the message says what and why)."""


@dataclass(frozen=True)
class Sample:
    """One dataset item. ``id`` is stable and unique within the dataset; it is what the
    harness records to prove which samples each rank consumed."""

    id: int
    input: torch.Tensor
    target: torch.Tensor


@runtime_checkable
class SampleDataset(Protocol):
    """A map-style dataset whose items are :class:`Sample` (anything with ``id``, ``input``
    and ``target`` attributes is accepted)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...


@dataclass(frozen=True)
class Batch:
    """A (micro-)batch: the stacked inputs/targets and the ids of the samples in it."""

    ids: tuple[int, ...]
    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)


def _sample_at(dataset: SampleDataset, index: int) -> Sample:
    item = dataset[index]
    missing = [a for a in ("id", "input", "target") if not hasattr(item, a)]
    if missing:
        raise CaseError(
            f"dataset {type(dataset).__name__}[{index}] is a {type(item).__name__} without "
            f"{', '.join(missing)}: every sample must carry an id (reference.case.Sample(id, "
            "input, target)) so the harness can trace which samples each rank consumed"
        )
    if isinstance(item.id, bool) or not isinstance(item.id, int):
        raise CaseError(
            f"dataset {type(dataset).__name__}[{index}].id is {item.id!r} "
            f"({type(item.id).__name__}); sample ids must be Python ints"
        )
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


def collate(
    dataset: SampleDataset,
    indices: Sequence[int],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Batch:
    """Stack the samples at ``indices`` into a :class:`Batch` on ``device``; floating tensors
    are cast to ``dtype``."""
    if not indices:
        raise CaseError("cannot collate an empty batch")
    samples = [_sample_at(dataset, int(i)) for i in indices]
    inputs = torch.stack([s.input for s in samples])
    targets = torch.stack([s.target for s in samples])
    return Batch(
        ids=tuple(s.id for s in samples),
        inputs=_to_dtype(inputs, dtype).to(device) if device is not None else _to_dtype(inputs, dtype),
        targets=_to_dtype(targets, dtype).to(device) if device is not None else _to_dtype(targets, dtype),
    )


@dataclass(frozen=True, eq=False)
class Case:
    """A training problem with a known single-device answer.

    - ``model_factory()`` builds the model; it is called right after ``torch.manual_seed(seed)``
      and must be deterministic given that (checked: two builds must be identical).
    - ``dataset`` is map-style with :class:`Sample` items carrying unique ids.
    - ``loss_fn(output, targets)`` returns the *mean* loss over the samples it is given (like
      ``F.mse_loss``/``F.cross_entropy`` defaults); the harness weights micro-batches so the
      step loss is the mean over the global batch.
    - ``optimizer_factory(params)`` builds the optimizer, e.g. ``functools.partial(AdamW, lr=1e-2)``.
    - Each step consumes ``global_batch_size`` samples in ``micro_batches`` equal micro-batches
      (gradient accumulation); the order follows ``torch.utils.data.DistributedSampler``
      (``shuffle`` with ``seed + epoch``), see :mod:`reference.schedule`.
    - ``dtype`` is the dtype of parameters and floating inputs.
    """

    name: str
    model_factory: Callable[[], nn.Module]
    dataset: SampleDataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    global_batch_size: int
    micro_batches: int = 1
    steps: int = 3
    seed: int = 0
    dtype: torch.dtype = torch.float32
    shuffle: bool = True

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
        for field_name in ("model_factory", "loss_fn", "optimizer_factory"):
            if not callable(getattr(self, field_name)):
                raise CaseError(f"{where}: {field_name} must be callable")
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

    def loss_weight(self, num_samples: int, replicas: int = 1) -> float:
        """Factor for a micro-batch's mean loss before ``backward``.

        With ``replicas`` data-parallel replicas whose gradients are *averaged* (DDP, FSDP),
        weighting each micro-batch's mean loss by ``num_samples * replicas / global_batch_size``
        makes the averaged gradient the gradient of the mean loss over the global batch.
        """
        return num_samples * replicas / self.global_batch_size

    def describe(self) -> dict[str, Any]:
        """A JSON-able, human-readable summary (what a record's ``meta.json`` shows)."""
        return {
            "name": self.name,
            "model_factory": callable_name(self.model_factory),
            "dataset": f"{type(self.dataset).__module__}.{type(self.dataset).__qualname__}",
            "dataset_len": len(self.dataset),
            "loss_fn": callable_name(self.loss_fn),
            "optimizer_factory": callable_name(self.optimizer_factory),
            "global_batch_size": self.global_batch_size,
            "micro_batches": self.micro_batches,
            "steps": self.steps,
            "seed": self.seed,
            "dtype": str(self.dtype),
            "shuffle": self.shuffle,
        }

    def replace(self, **changes: Any) -> "Case":
        """A copy with some fields changed (e.g. ``dtype=torch.float64`` for calibration)."""
        return dataclasses.replace(self, **changes)

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
