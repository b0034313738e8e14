"""Where training frameworks keep the state the harness records, and where their step is.

A framework that keeps gradients and optimizer state in its own flat partitions (DeepSpeed
ZeRO 1-3: ``p.grad`` is None when the step runs) is read through its own accessors, at the
moment of its step; wrappers are unwrapped by :data:`harness.record.gather.WRAPPER_ATTRS`.
Frameworks are recognised by class name, never imported here: one that is not installed
costs nothing.

- :func:`watched_objects`: what ``run.watch`` was handed -> the user's module, the optimizer
  whose param groups hold the hyperparameters, and a :class:`StateReader` where the torch
  view (``p.grad``, ``optimizer.state[p]``) is not the framework's truth;
- :func:`hook_step`: calls ``before(step)`` / ``after(step)`` around the framework's own
  optimizer step (torch's step hooks on the innermost torch optimizer, or DeepSpeed's ZeRO
  optimizer), so a framework loop needs no step counter and no accumulation guard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from harness.record.gather import LocalTensor, reference_named_parameters

__all__ = ["DeepSpeedZeroState", "FrameworkError", "StateReader", "hook_step", "is_deepspeed_engine", "watched_objects"]


class FrameworkError(RuntimeError):
    """A framework object the harness cannot read (the message says why and what works)."""


class StateReader(Protocol):
    """A rank's full state where the framework keeps it, under reference names."""

    def local_state(self, kind: str) -> list[LocalTensor]: ...

    def param_groups(self, names: dict[int, str]) -> list[dict[str, Any]]: ...


def _class_names(obj: Any) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def is_deepspeed_engine(obj: Any) -> bool:
    return "DeepSpeedEngine" in _class_names(obj)


def watched_objects(model: Any, optimizer: Any) -> tuple[Any, Any, StateReader | None]:
    """``(module, optimizer, reader)`` for what ``run.watch`` was handed. A DeepSpeed engine
    stands for both: its ``module``, its optimizer, and (ZeRO stage 1-3) a reader of the
    partitioned state through DeepSpeed's ``safe_get_full_*`` accessors."""
    if is_deepspeed_engine(model):
        engine = model
        if optimizer is not None and optimizer is not engine.optimizer and optimizer is not _base_optimizer(engine.optimizer):
            raise FrameworkError(
                "run.watch(engine, optimizer): the optimizer is not the one deepspeed.initialize returned; "
                "pass the engine alone (run.watch(engine, layout=...))"
            )
        if engine.optimizer is None:
            raise FrameworkError("the DeepSpeed engine has no optimizer: give deepspeed.initialize one (optimizer= or the config's)")
        stage = int(engine.zero_optimization_stage())
        if stage == 0:
            return engine.module, _base_optimizer(engine.optimizer), None
        if "PipelineEngine" in _class_names(engine):
            raise FrameworkError("DeepSpeed's PipelineEngine with ZeRO is not read by the harness (its stages hold "
                                 "parts of the model); record each stage's module with a pipeline layout instead")
        return engine.module, _base_optimizer(engine.optimizer), DeepSpeedZeroState(engine)
    return model, (None if optimizer is None else _base_optimizer(optimizer)), None


def _base_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrappers (accelerate's AcceleratedOptimizer,
    Fabric's _FabricOptimizer, DeepSpeed's ZeRO optimizers all hold it as ``.optimizer``)."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


class DeepSpeedZeroState:
    """Full gradients, fp32 parameters and optimizer state of a DeepSpeed ZeRO stage 1-3
    engine, identical on every rank (each accessor is a collective over the data-parallel
    group). Read between ``engine.backward`` on the accumulation boundary and the optimizer
    step for gradients, after the step for the rest: :func:`hook_step` calls at those moments."""

    def __init__(self, engine: Any):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

        self.engine = engine
        self._grad, self._param, self._state = safe_get_full_grad, safe_get_full_fp32_param, safe_get_full_optimizer_state

    def _named(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in reference_named_parameters(self.engine.module) if p.requires_grad]

    def local_state(self, kind: str) -> list[LocalTensor]:
        out: list[LocalTensor] = []
        if kind == "grad":
            for name, p in self._named():
                g = self._grad(p)
                if g is not None:
                    out.append(LocalTensor(name, g.detach().clone().view(_full_shape(p))))
        elif kind == "param":
            for name, p in reference_named_parameters(self.engine.module):
                value = self._param(p) if p.requires_grad else None
                if value is None:  # frozen: DeepSpeed keeps no fp32 copy; the module's own (gathered) tensor
                    value = p.detach()
                out.append(LocalTensor(name, value.detach().clone().view(_full_shape(p))))
        else:
            # The base optimizer's state of one flat partition gives the keys, and the value of
            # a per-parameter scalar (Adam's ``step``), the same for every partition.
            states = [s for s in _base_optimizer(self.engine.optimizer).state.values() if s]
            first = states[0] if states else {}
            scalars = {key: _scalar(value) for key, value in first.items()}
            for name, p in self._named():
                for key in sorted(first):
                    value = scalars[key] if scalars[key] is not None else self._state(p, key)
                    if value is not None:
                        out.append(LocalTensor(f"{name}.{key}", value.detach().clone().view(_full_shape(p)) if value.dim() else value.detach().clone()))
        return out

    def param_groups(self, names: dict[int, str]) -> list[dict[str, Any]]:
        """The base optimizer's hyperparameters with the model parameters each group holds
        (its own ``params`` are DeepSpeed's flat partitions)."""
        from reference.record import optimizer_param_groups

        zero = self.engine.optimizer
        groups = getattr(zero, "bit16_groups", None) or getattr(zero, "fp16_groups", None)
        plain = optimizer_param_groups(_base_optimizer(zero), {})
        if groups is None or len(groups) != len(plain):
            return plain
        for entry, params in zip(plain, groups):
            entry["params"] = [names.get(id(p), "?") for p in params]
        return plain


def _scalar(value: Any) -> torch.Tensor | None:
    if isinstance(value, (int, float)):
        return torch.tensor(float(value))
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value
    return None


def _full_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the full shape beside an empty tensor


def hook_step(model: Any, optimizer: Any, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
    """Call ``before()`` just before and ``after()`` just after each optimizer step the
    framework takes (only on its accumulation boundary); returns a function removing the
    hooks. A DeepSpeed engine's ZeRO optimizer is wrapped on the instance (its step runs the
    base optimizer once per param group); anything else gets torch's step hooks on the
    innermost torch optimizer (accelerate and Fabric step it only when they synchronise)."""
    target = model.optimizer if is_deepspeed_engine(model) else optimizer
    if is_deepspeed_engine(model) and not isinstance(target, torch.optim.Optimizer):
        original = target.step

        def step(*args: Any, **kwargs: Any) -> Any:
            before()
            out = original(*args, **kwargs)
            after()
            return out

        target.step = step
        return lambda: target.__dict__.pop("step", None)
    inner = _base_optimizer(target)
    if not isinstance(inner, torch.optim.Optimizer):
        raise FrameworkError(
            f"run.watch(..., hook_step=True): {type(target).__name__} holds no torch optimizer to hook; call "
            "run.before_step(step) / run.after_step(step) around your optimizer step instead"
        )
    pre = inner.register_step_pre_hook(lambda *_: before())
    post = inner.register_step_post_hook(lambda *_: after())

    def remove() -> None:
        pre.remove()
        post.remove()

    return remove
