"""The strategy registry: :class:`StrategySpec` (which mesh dims a strategy uses, what it needs
from a config and the factory that builds it on the ranks), :func:`constraints_for` (the
constraints a config must meet for a spec), :func:`register_strategy` / :func:`get_spec` /
:func:`available_strategies`, and the built-in strategies (``build_*`` factories, module-level
so they pickle to the ranks by name)."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..parallel_dims import DIM_ORDER
from .config import (
    COMMON_CONSTRAINTS,
    DTYPES,
    MICRO_CONSTRAINT,
    OPTIMIZER_NAMES,
    PP_CONSTRAINTS,
    TP_CONSTRAINTS,
    Constraint,
    ParallelConfig,
    _prod,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ..strategy import Strategy

__all__ = [
    "StrategySpec",
    "available_strategies",
    "build_ddp",
    "build_ddp_tp",
    "build_fsdp",
    "build_fsdp_tp",
    "build_pipeline",
    "build_tp",
    "constraints_for",
    "get_spec",
    "register_strategy",
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
    optimizers: tuple[str, ...] = OPTIMIZER_NAMES
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
        if not self.optimizers or any(o not in OPTIMIZER_NAMES for o in self.optimizers):
            raise ValueError(f"{where}: optimizers {self.optimizers!r} must be a non-empty subset of {OPTIMIZER_NAMES}")
        if self.pp_layers not in ("at_least", "divisible"):
            raise ValueError(f"{where}: pp_layers must be 'at_least' or 'divisible', got {self.pp_layers!r}")
        for key, choices in self.options.items():
            if not isinstance(choices, tuple) or not choices:
                raise ValueError(f"{where}: option {key!r} needs a non-empty tuple of choices, got {choices!r}")
        if not callable(self.factory):
            raise TypeError(f"{where}: factory must be callable (a module-level function taking the ParallelConfig)")

    @property
    def min_world(self) -> int:
        return _prod(self.min_degree.get(d, 1) for d in self.dims)

    def derive(self, name: str, factory: Callable[[ParallelConfig], Strategy], **changes: Any) -> StrategySpec:
        """The same requirements for another strategy, e.g. a deliberately buggy variant."""
        return dataclasses.replace(self, name=name, factory=factory, **changes)


def constraints_for(spec: StrategySpec, *, max_world: int | None = None) -> list[Constraint]:
    """The constraints a config must meet for ``spec``, in the order they are checked."""
    out = [c for c in COMMON_CONSTRAINTS if max_world is not None or c.name != "world-size-limit"]
    if "tp" in spec.dims:
        out += TP_CONSTRAINTS
    if "pp" in spec.dims:
        out += PP_CONSTRAINTS
        if spec.micro_batches_cover_stages is not False:
            out.append(MICRO_CONSTRAINT)
    return out + list(spec.extra)


_REGISTRY: dict[str, StrategySpec] = {}
# name -> loader returning the spec, or None while its module does not import (checked on lookup)
_LAZY: dict[str, Callable[[], StrategySpec | None]] = {}


def register_strategy(spec: StrategySpec, *, replace: bool = False) -> StrategySpec:
    """Add ``spec`` to the registry under ``spec.name`` (so configs can name it)."""
    if spec.name in _REGISTRY and not replace and _REGISTRY[spec.name] != spec:
        raise ValueError(f"a strategy named {spec.name!r} is already registered; pass replace=True to replace it")
    _REGISTRY[spec.name] = spec
    return spec


def _load_lazy() -> None:
    for name, loader in list(_LAZY.items()):
        if name in _REGISTRY:
            continue
        spec = loader()
        if spec is not None:
            _REGISTRY[name] = spec


def available_strategies() -> list[str]:
    """Names of the registered strategies whose implementation imports here."""
    _load_lazy()
    return sorted(_REGISTRY)


def get_spec(strategy: str | StrategySpec) -> StrategySpec:
    """The registered :class:`StrategySpec` of ``strategy`` (a spec passes through)."""
    if isinstance(strategy, StrategySpec):
        return strategy
    if strategy not in _REGISTRY:
        _load_lazy()
    try:
        return _REGISTRY[strategy]
    except KeyError:
        raise KeyError(
            f"no strategy {strategy!r} in the search registry; known: {', '.join(sorted(_REGISTRY)) or 'none'} "
            "(register one with harness.search.register_strategy(StrategySpec(...)))"
        ) from None


# The built-in strategies. Factories are module-level so they pickle to the ranks; a strategy
# whose module does not import here (not written yet, or broken) is simply not searchable.


def build_ddp(config: ParallelConfig) -> Strategy:
    from cases.strategies.ddp import DDPStrategy

    return DDPStrategy()


def build_fsdp(config: ParallelConfig) -> Strategy:
    from cases.strategies.fsdp import FSDPStrategy

    return FSDPStrategy(reshard_after_forward=config.option_dict.get("reshard_after_forward", True))


def build_pipeline(config: ParallelConfig) -> Strategy:
    from cases.strategies.pipeline import PipelineStrategy

    opts = config.option_dict
    return PipelineStrategy(opts.get("schedule", "gpipe"), pp=config.pp, tp=config.tp, dp_mode=opts.get("dp_mode", "fsdp"))


def build_tp(config: ParallelConfig) -> Strategy:
    from cases.strategies.tp import TensorParallelStrategy

    return TensorParallelStrategy()


def build_ddp_tp(config: ParallelConfig) -> Strategy:
    from cases.strategies.hybrid import DDPTensorParallelStrategy

    return DDPTensorParallelStrategy(tp=config.tp)


def build_fsdp_tp(config: ParallelConfig) -> Strategy:
    from cases.strategies.hybrid import FSDPTensorParallelStrategy

    return FSDPTensorParallelStrategy(tp=config.tp)


def _check_pipeline_tp_mode(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if c.tp > 1 and c.option_dict.get("dp_mode") == "ddp":
        return f"dp_mode='ddp' cannot be combined with tp={c.tp} (DDP does not handle DTensor parameters); allowed: dp_mode='fsdp'"
    return None


def _violate_pipeline_tp_mode(draw, c, spec, max_world):
    if c.tp < 2:
        return None
    return c.replace(options=tuple((k, "ddp" if k == "dp_mode" else v) for k, v in c.options))


def _when_importable(module: str, spec: Callable[[], StrategySpec]) -> Callable[[], StrategySpec | None]:
    def load() -> StrategySpec | None:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - not searchable here
            return None
        return spec()

    return load


register_strategy(StrategySpec("ddp", build_ddp, dims=("dp",), description="DistributedDataParallel over every rank"))
_LAZY["fsdp"] = _when_importable("cases.strategies.fsdp", lambda: StrategySpec(
    "fsdp", build_fsdp, dims=("dp",), options={"reshard_after_forward": (True, False)},
    description="FSDP2 fully_shard per block and the root over every rank"))
_LAZY["pipeline"] = _when_importable("cases.strategies.pipeline", lambda: StrategySpec(
    "pipeline", build_pipeline, dims=("pp", "dp", "tp"), min_degree={"pp": 2},
    options={"schedule": ("gpipe", "1f1b"), "dp_mode": ("fsdp", "ddp")},
    pp_layers="divisible", micro_batches_cover_stages=lambda opts: opts.get("schedule") == "1f1b",
    extra=(Constraint("pipeline-tp-needs-fsdp", _check_pipeline_tp_mode, _violate_pipeline_tp_mode,
                      doc="tp > 1 composes with dp_mode='fsdp' only", needs={"tp": 2}),),
    description="torch.distributed.pipelining GPipe / 1F1B over pp stages, replicas by FSDP2 or DDP, optional tp"))
# tp >= 2: one rank is no tensor parallelism (and there, with an MLP of width 1, DTensor cannot
# view the size-1 "sharded" dim: the search's first finding on this strategy).
_LAZY["tp"] = _when_importable("cases.strategies.tp", lambda: StrategySpec(
    "tp", build_tp, dims=("tp",), min_degree={"tp": 2},
    description="parallelize_module Megatron-style TP over every rank"))
_LAZY["ddp-tp"] = _when_importable("cases.strategies.hybrid", lambda: StrategySpec(
    "ddp-tp", build_ddp_tp, dims=("dp", "tp"), min_degree={"dp": 2, "tp": 2},
    description="dp x tp: TP inside each replica, replicate() over the dp ranks"))
_LAZY["fsdp-tp"] = _when_importable("cases.strategies.hybrid", lambda: StrategySpec(
    "fsdp-tp", build_fsdp_tp, dims=("dp", "tp"), min_degree={"dp": 2, "tp": 2},
    description="FSDP2 x TP on a (dp, tp) mesh"))
