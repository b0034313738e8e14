"""The strategy registry: :class:`StrategySpec` (which mesh dims a strategy uses, what it needs
from a config and the factory that builds it on the ranks), :func:`register_strategy` /
:func:`get_spec` / :func:`available_strategies`, the optimizer names a config may use
(:func:`register_optimizers`), and :func:`violations` / :func:`validate` of a config against
its strategy's constraints. It holds what it is given: the bundled strategies and optimizers
are registered by :mod:`harness.search.builtins`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import math

from harness.parallel_dims import DIM_ORDER
from harness.search.config import DTYPES, InvalidConfigError, ParallelConfig, Violation
from harness.search.constraints import Constraint, check, constraints_for

if TYPE_CHECKING:  # pragma: no cover - typing only
    from harness.strategy import Strategy

__all__ = [
    "StrategySpec",
    "available_strategies",
    "constraints_for",
    "get_spec",
    "optimizer_names",
    "register_optimizers",
    "register_strategy",
    "validate",
    "violations",
]


# -- the registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategySpec:
    """What a strategy needs from a config, and how to build it on the ranks.

    ``factory(config)`` returns the strategy object; it must be picklable (a module-level
    function or class) because it is sent to the ranks. ``dims`` are the mesh dims it
    parallelizes along (others must be 1); ``min_degree`` a minimum per dim (a 2-D strategy
    may need both dims > 1). Using ``tp`` adds the tp-divides constraints, ``pp`` the layer
    constraint (``pp_layers``: ``"at_least"`` or ``"divisible"``) and, with
    ``micro_batches_cover_stages`` (True, or a function of the options dict, e.g. only for
    1F1B), micro-batches >= pp. ``options`` are constructor choices
    the search draws from (``{"schedule": ("gpipe", "1f1b")}``); ``extra`` are further
    constraints (configs breaking them are filtered out of the search)."""

    name: str
    factory: Callable[[ParallelConfig], Strategy]
    dims: tuple[str, ...] = ("dp",)
    min_degree: Mapping[str, int] = field(default_factory=dict)
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float64")
    optimizers: tuple[str, ...] | None = None  # None: every registered optimizer
    options: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    pp_layers: str = "at_least"
    micro_batches_cover_stages: bool | Callable[[dict[str, Any]], bool] = True
    extra: tuple[Constraint, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        where = f"StrategySpec {self.name!r}"
        if not self.dims or any(d not in DIM_ORDER for d in self.dims):
            raise ValueError(f"{where}: dims {self.dims!r} must be a non-empty subset of {DIM_ORDER}")
        if len(set(self.dims)) != len(self.dims):
            raise ValueError(f"{where}: dims {self.dims!r} repeat a dim")
        bad = {k: v for k, v in self.min_degree.items() if k not in self.dims or not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"{where}: min_degree {bad} must name used dims ({', '.join(self.dims)}) with ints >= 1")
        unknown = [d for d in self.dtypes if d not in DTYPES]
        if not self.dtypes or unknown:
            raise ValueError(f"{where}: dtypes {self.dtypes!r} must be a non-empty subset of {DTYPES}")
        if self.optimizers is not None and not self.optimizers:
            raise ValueError(f"{where}: optimizers must be None (every registered optimizer) or a non-empty tuple of names")
        if self.pp_layers not in ("at_least", "divisible"):
            raise ValueError(f"{where}: pp_layers must be 'at_least' or 'divisible', got {self.pp_layers!r}")
        for key, choices in self.options.items():
            if not isinstance(choices, tuple) or not choices:
                raise ValueError(f"{where}: option {key!r} needs a non-empty tuple of choices, got {choices!r}")
        if not callable(self.factory):
            raise TypeError(f"{where}: factory must be callable (a module-level function taking the ParallelConfig)")

    @property
    def min_world(self) -> int:
        return math.prod(self.min_degree.get(d, 1) for d in self.dims)

    @property
    def allowed_optimizers(self) -> tuple[str, ...]:
        """The optimizer names a config of this strategy may use."""
        return self.optimizers if self.optimizers is not None else optimizer_names()

    def derive(self, name: str, factory: Callable[[ParallelConfig], Strategy], **changes: Any) -> StrategySpec:
        """The same requirements for another strategy, e.g. a deliberately buggy variant."""
        return dataclasses.replace(self, name=name, factory=factory, **changes)


_REGISTRY: dict[str, StrategySpec] = {}
_OPTIMIZERS: list[str] = []


def register_optimizers(names: tuple[str, ...] | list[str]) -> None:
    """Add optimizer names a config may use (those of the case catalogue it builds from)."""
    _OPTIMIZERS.extend(n for n in names if n not in _OPTIMIZERS)


def optimizer_names() -> tuple[str, ...]:
    """Every registered optimizer name, in registration order."""
    return tuple(_OPTIMIZERS)


def register_strategy(spec: StrategySpec, *, replace: bool = False) -> StrategySpec:
    """Add ``spec`` to the registry under ``spec.name`` (so configs can name it)."""
    if spec.name in _REGISTRY and not replace and _REGISTRY[spec.name] != spec:
        raise ValueError(f"a strategy named {spec.name!r} is already registered; pass replace=True to replace it")
    _REGISTRY[spec.name] = spec
    return spec


def available_strategies() -> list[str]:
    """Names of the registered strategies."""
    return sorted(_REGISTRY)


def get_spec(strategy: str | StrategySpec) -> StrategySpec:
    """The registered :class:`StrategySpec` of ``strategy`` (a spec passes through)."""
    if isinstance(strategy, StrategySpec):
        return strategy
    try:
        return _REGISTRY[strategy]
    except KeyError:
        raise KeyError(
            f"no strategy {strategy!r} in the search registry; known: {', '.join(sorted(_REGISTRY)) or 'none'} "
            "(register one with harness.search.register_strategy(StrategySpec(...)))"
        ) from None


def violations(config: ParallelConfig, spec: StrategySpec | None = None, *, max_world: int | None = None) -> list[Violation]:
    """Every constraint ``config`` breaks for ``spec`` (default: the registered spec of its
    strategy), in the order they are declared; empty when it is valid."""
    return check(config, spec if spec is not None else get_spec(config.strategy), max_world=max_world)


def validate(config: ParallelConfig, spec: StrategySpec | None = None, *, max_world: int | None = None) -> ParallelConfig:
    """Raise :class:`InvalidConfigError` naming each failing constraint; return ``config``
    when it is valid."""
    if spec is None:
        try:
            spec = get_spec(config.strategy)
        except KeyError:
            known = ", ".join(available_strategies())
            raise InvalidConfigError(
                config, [Violation("known-strategy", f"strategy {config.strategy!r} is not registered; known: {known}")]
            ) from None
    found = check(config, spec, max_world=max_world)
    if found:
        raise InvalidConfigError(config, found)
    return config
