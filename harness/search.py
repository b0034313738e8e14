"""Search parallel configurations with Hypothesis, so bugs that appear only in some of them are
found and shrunk to the smallest configuration that shows them.

Many parallel bugs need a particular configuration: a dataset size that does not divide the
replicas (``DistributedSampler`` pads by repeating samples), one micro-batch, a batch of one
per replica, more pipeline stages than micro-batches. A fixed grid misses them; this module
generates *valid* configurations for a strategy from what the strategy declares it needs,
runs each one on the warm rank pool and compares it with the single-device reference::

    from harness.search import assert_matches_reference_for_all

    def test_ddp_matches_for_all_configs(rank_runner, reference_cache):
        assert_matches_reference_for_all("ddp", rank_runner, max_world=2, max_examples=8, cache=reference_cache)

Pieces:

* :class:`ParallelConfig`: world size and named mesh dims (``pp, dp, tp``), global batch,
  micro-batches, dataset size, steps, the tiny transformer's sizes, dtype, optimizer and the
  strategy's own options. :meth:`ParallelConfig.validate` names every constraint that fails
  ("tp-divides-dim: hidden size 30 is not divisible by tp=4").
* :class:`StrategySpec` and the registry (:func:`register_strategy`, :func:`get_spec`): which
  mesh dims a strategy uses and what it needs (tp divides heads / hidden size / MLP width,
  pp divides the layers, at least pp micro-batches, ...).
* Hypothesis strategies :func:`parallel_configs` (valid configs, built to satisfy the
  constraints rather than filtered, so they shrink well) and :func:`invalid_configs` (configs
  that break one named constraint, for testing error messages).
* :func:`check_config` / :func:`assert_config_matches` (one example: one ``RankRunner.run``
  call on the warm pool), :func:`assert_matches_reference_for_all` (the one-line property) and
  :func:`given_configs` (a ``@given`` with the harness's settings for custom checks). A
  mismatch raises :class:`ConfigMismatch` whose message shows the config and its diagnosis
  codes (a crash or hang: :class:`ConfigCrashed`); Hypothesis shrinks to the smallest failing
  config, and its database and ``--hypothesis-seed`` work as usual.

Hypothesis runs in the calling (pytest) process, which only generates configs and reads the
results; cases, strategies and the reference are built on the ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hypothesis import HealthCheck, Phase, assume, event, given, note, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from .parallel_dims import DIM_ORDER, ParallelConfigError, ParallelDims

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .codes import Diagnosis
    from .remote import RankRunner
    from .run import RunResult
    from .strategy import DistContextLike, Strategy

__all__ = [
    "DTYPES",
    "EXAMPLE_DEADLINE",
    "OPTIMIZER_NAMES",
    "ConfigCrashed",
    "ConfigFailure",
    "ConfigMismatch",
    "Constraint",
    "ExampleOutcome",
    "InvalidConfig",
    "InvalidConfigError",
    "ParallelConfig",
    "SearchReport",
    "StrategySpec",
    "Violation",
    "assert_config_matches",
    "assert_matches_reference_for_all",
    "available_strategies",
    "check_config",
    "constraints_for",
    "example_deadline",
    "get_spec",
    "given_configs",
    "invalid_configs",
    "parallel_configs",
    "register_strategy",
    "search_settings",
    "smallest_config",
    "warm_up",
]

DTYPES = ("float32", "bfloat16", "float16", "float64")
OPTIMIZER_NAMES = ("adamw", "sgd")  # cases.catalog.OPTIMIZERS (not imported: it pulls in torch)
MAX_SEQ_LEN = 16  # transformer_case's model is built with max_seq_len 16

# Measured on 2 CPU cores with warm pools: 0.2-1.3 s per example of the smallest models in
# float64, 1-5 s for generated float32/bf16 configs with calibrated tolerances (up to ~12 s for
# 4 ranks on 2 cores). The deadline leaves room for that on a loaded CI machine while still
# flagging a pathologically slow config. A rank that hangs is stopped by the RankRunner
# timeout, which is longer, with every rank's stack and last collectives in the report.
EXAMPLE_DEADLINE = timedelta(seconds=30)
RANK_TIMEOUT_S = 120.0


def example_deadline(max_world: int) -> timedelta:
    """:data:`EXAMPLE_DEADLINE`, stretched when the ranks outnumber the CPU cores (4 ranks on 2
    cores: a 4-stage pipeline example measured up to 24 s there)."""
    cores = os.cpu_count() or 1
    return EXAMPLE_DEADLINE * max(1, -(-max_world // cores))

_INT_FIELDS = (
    "dp", "tp", "pp", "global_batch_size", "micro_batches", "num_samples", "steps",
    "seq_len", "dim", "heads", "hidden", "layers", "vocab",
)


# -- the configuration ---------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelConfig:
    """One parallel training configuration of the tiny transformer case.

    The mesh is ``pp x dp x tp`` (outermost first, as :class:`ParallelDims`); its product is
    the world size. ``global_batch_size`` samples per step are split over ``dp`` replicas and
    ``micro_batches`` accumulation steps; ``num_samples`` is the dataset size (it need not
    divide the replicas: that is one of the things the search is for). ``options`` are the
    strategy's own constructor choices (e.g. ``(("schedule", "1f1b"),)``)."""

    strategy: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    global_batch_size: int = 2
    micro_batches: int = 1
    num_samples: int = 2
    steps: int = 1
    seq_len: int = 4
    dim: int = 8
    heads: int = 2
    hidden: int = 8
    layers: int = 1
    vocab: int = 16
    dtype: str = "float32"
    optimizer: str = "adamw"
    options: tuple[tuple[str, Any], ...] = ()

    # -- derived ----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dims(self) -> ParallelDims:
        """The mesh as :class:`ParallelDims` (raises :class:`ParallelConfigError` on bad degrees)."""
        return ParallelDims(dp=self.dp, tp=self.tp, pp=self.pp)

    @property
    def mesh(self) -> dict[str, int]:
        """Named mesh dims of size > 1, outermost first (``{"dp": 2}`` for 2-way DDP)."""
        named = {n: getattr(self, n) for n in DIM_ORDER if getattr(self, n) > 1}
        return named or {"dp": self.dp}

    @property
    def per_replica_batch(self) -> int:
        return self.global_batch_size // self.dp

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch on one replica."""
        return self.global_batch_size // (self.dp * self.micro_batches)

    @property
    def option_dict(self) -> dict[str, Any]:
        return dict(self.options)

    def model_config(self) -> dict[str, int]:
        """The sizes :class:`cases.models.TinyTransformer` takes (and ``ParallelDims.check_model`` reads)."""
        return {"vocab": self.vocab, "dim": self.dim, "heads": self.heads, "hidden": self.hidden, "layers": self.layers}

    @property
    def case_name(self) -> str:
        parts = [
            f"search-d{self.dim}h{self.heads}f{self.hidden}l{self.layers}v{self.vocab}s{self.seq_len}",
            f"b{self.global_batch_size}m{self.micro_batches}n{self.num_samples}k{self.steps}",
            self.dtype,
            self.optimizer,
        ]
        return "-".join(parts)

    def case(self):  # -> reference.case.Case (torch imported only here)
        """The :class:`reference.case.Case` this config trains (call on the ranks or anywhere)."""
        import torch

        from cases.catalog import transformer_case

        return transformer_case(
            self.optimizer,
            steps=self.steps,
            global_batch_size=self.global_batch_size,
            micro_batches=self.micro_batches,
            dtype=getattr(torch, self.dtype),
            num_samples=self.num_samples,
            seq_len=self.seq_len,
            vocab=self.vocab,
            dim=self.dim,
            heads=self.heads,
            hidden=self.hidden,
            layers=self.layers,
            name=self.case_name,
        )

    def describe(self) -> str:
        """One line a person reads in a failure report."""
        mesh = " x ".join(f"{n}={s}" for n, s in self.mesh.items())
        opts = "".join(f", {k}={v}" for k, v in self.options)
        return (
            f"{self.strategy} on {self.world_size} rank{'s' if self.world_size != 1 else ''} [{mesh}]{opts}: "
            f"global batch {self.global_batch_size} = dp {self.dp} x {self.micro_batches} micro-batch"
            f"{'es' if self.micro_batches != 1 else ''} x {self.micro_batch_size if self._ints_ok() else '?'}, "
            f"dataset {self.num_samples} samples, {self.steps} step{'s' if self.steps != 1 else ''}, "
            f"seq {self.seq_len}, dim {self.dim}, heads {self.heads}, MLP {self.hidden}, "
            f"layers {self.layers}, vocab {self.vocab}, {self.dtype}, {self.optimizer}"
        )

    def _ints_ok(self) -> bool:
        return all(isinstance(getattr(self, f), int) and getattr(self, f) >= 1 for f in _INT_FIELDS) and not (
            self.global_batch_size % (self.dp * self.micro_batches)
        )

    def replace(self, **changes: Any) -> ParallelConfig:
        return dataclasses.replace(self, **changes)

    # -- checking ---------------------------------------------------------------------------

    def violations(self, spec: StrategySpec | None = None, *, max_world: int | None = None) -> list[Violation]:
        """Every constraint this config breaks for ``spec`` (default: the registered spec of
        :attr:`strategy`), in the order they are declared; empty when it is valid."""
        spec = spec if spec is not None else get_spec(self.strategy)
        found: list[Violation] = []
        for constraint in constraints_for(spec, max_world=max_world):
            message = constraint.check(self, spec, max_world)
            if message:
                found.append(Violation(constraint.name, message))
                if constraint.fatal:  # later checks would divide by zero or compare junk
                    break
        return found

    def validate(self, spec: StrategySpec | None = None, *, max_world: int | None = None) -> ParallelConfig:
        """Raise :class:`InvalidConfigError` naming each failing constraint; return self when valid."""
        if spec is None:
            try:
                spec = get_spec(self.strategy)
            except KeyError:
                known = ", ".join(available_strategies())
                raise InvalidConfigError(
                    self, [Violation("known-strategy", f"strategy {self.strategy!r} is not registered; known: {known}")]
                ) from None
        found = self.violations(spec, max_world=max_world)
        if found:
            raise InvalidConfigError(self, found)
        return self


@dataclass(frozen=True)
class Violation:
    constraint: str  # the constraint's stable name, e.g. "tp-divides-dim"
    message: str  # what is wrong and what is allowed


class InvalidConfigError(ParallelConfigError):
    """A :class:`ParallelConfig` breaks one or more constraints; ``violations`` names them."""

    def __init__(self, config: ParallelConfig, violations: Sequence[Violation]):
        self.config = config
        self.violations = list(violations)
        lines = "\n".join(f"  - {v.constraint}: {v.message}" for v in self.violations)
        super().__init__(f"invalid parallel config for strategy {config.strategy!r} ({_brief(config)}):\n{lines}")

    @property
    def constraints(self) -> list[str]:
        return [v.constraint for v in self.violations]


def _brief(config: ParallelConfig) -> str:
    try:
        return f"world {config.world_size}, " + ", ".join(f"{n}={getattr(config, n)}" for n in DIM_ORDER)
    except TypeError:
        return ", ".join(f"{n}={getattr(config, n)!r}" for n in DIM_ORDER)


# -- constraints -------------------------------------------------------------------------------

CheckFn = Callable[[ParallelConfig, "StrategySpec", "int | None"], "str | None"]
# draw, a valid config, the spec, max_world -> a config that breaks the constraint (None: cannot from this one)
ViolateFn = Callable[[Callable[[SearchStrategy[Any]], Any], ParallelConfig, "StrategySpec", int], "ParallelConfig | None"]


@dataclass(frozen=True)
class Constraint:
    """A named requirement on a config. ``check`` returns None when it holds, else a message
    saying what is wrong and what is allowed. ``violate`` (optional) turns a valid config into
    one that breaks it, which :func:`invalid_configs` uses (from a base config with at least the
    degrees in ``needs``, e.g. ``{"tp": 2}``); ``fatal`` stops further checks (values that are
    not even positive ints)."""

    name: str
    check: CheckFn
    violate: ViolateFn | None = None
    fatal: bool = False
    doc: str = ""
    needs: Mapping[str, int] = field(default_factory=dict)  # min degrees a config needs before it can break this
    breakable: Callable[[StrategySpec], bool] | None = None  # None: any spec's configs can break it


def _check_ints(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    bad = [
        f"{f}={getattr(c, f)!r}" for f in _INT_FIELDS
        if isinstance(getattr(c, f), bool) or not isinstance(getattr(c, f), int) or getattr(c, f) < 1
    ]
    return f"{', '.join(bad)}: each must be a positive int" if bad else None


def _violate_ints(draw, c, spec, max_world):
    name = draw(st.sampled_from(("global_batch_size", "micro_batches", "num_samples", "steps", "seq_len", "layers")))
    return c.replace(**{name: draw(st.integers(-2, 0))})


def _check_strategy_options(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if not isinstance(c.options, tuple) or not all(isinstance(o, tuple) and len(o) == 2 for o in c.options):
        return f"options must be a tuple of (name, value) pairs, got {c.options!r}"
    problems = []
    for key, value in c.options:
        if key not in spec.options:
            allowed = ", ".join(spec.options) or "none"
            problems.append(f"option {key!r} is not an option of {spec.name!r} (allowed: {allowed})")
        elif value not in spec.options[key]:
            problems.append(f"option {key}={value!r} is not allowed for {spec.name!r} (allowed: {', '.join(map(repr, spec.options[key]))})")
    missing = [k for k in spec.options if k not in c.option_dict]
    if missing:
        problems.append(f"option(s) {', '.join(missing)} missing (allowed values: " + "; ".join(
            f"{k}: {', '.join(map(repr, spec.options[k]))}" for k in missing) + ")")
    return "; ".join(problems) or None


def _violate_options(draw, c, spec, max_world):
    if not spec.options:
        return c.replace(options=c.options + (("no_such_option", 1),))
    key = draw(st.sampled_from(sorted(spec.options)))
    return c.replace(options=tuple((k, "no-such-value" if k == key else v) for k, v in c.options))


def _check_dims_used(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    unused = [f"{n}={getattr(c, n)}" for n in DIM_ORDER if n not in spec.dims and getattr(c, n) != 1]
    if unused:
        return (
            f"{spec.name!r} parallelizes along {', '.join(spec.dims)} only; {', '.join(unused)} is not allowed "
            f"(set {'it' if len(unused) == 1 else 'them'} to 1)"
        )
    return None


def _violate_dims_used(draw, c, spec, max_world):
    free = [n for n in DIM_ORDER if n not in spec.dims]
    if not free:
        return None
    return c.replace(**{draw(st.sampled_from(free)): 2})


def _check_min_degree(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    low = [f"{n}={getattr(c, n)} (needs >= {m})" for n, m in spec.min_degree.items() if getattr(c, n) < m]
    return f"{spec.name!r} needs " + ", ".join(low) if low else None


def _violate_min_degree(draw, c, spec, max_world):
    dims = [n for n, m in spec.min_degree.items() if m > 1]
    if not dims:
        return None
    name = draw(st.sampled_from(dims))
    return c.replace(**{name: 1})


def _check_world(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if max_world is not None and c.world_size > max_world:
        return (
            f"world size {c.world_size} (pp*dp*tp = {c.pp}*{c.dp}*{c.tp}) exceeds the {max_world} "
            f"rank{'s' if max_world != 1 else ''} this search allows"
        )
    return None


def _violate_world(draw, c, spec, max_world):
    dim = spec.dims[0]
    factor = max_world // (c.world_size // getattr(c, dim)) + 1  # smallest degree that overflows
    return c.replace(**{dim: factor})


def _check_batch_split(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if c.global_batch_size % (c.dp * c.micro_batches):
        return (
            f"global batch {c.global_batch_size} is not divisible by dp x micro-batches = "
            f"{c.dp} x {c.micro_batches} = {c.dp * c.micro_batches}; every replica needs equal micro-batches "
            f"(allowed: a multiple of {c.dp * c.micro_batches})"
        )
    return None


def _violate_batch_split(draw, c, spec, max_world):
    unit = c.dp * c.micro_batches
    if unit == 1:
        c = c.replace(micro_batches=2)
        unit = c.dp * 2
    batch = unit * draw(st.integers(0, 2)) + draw(st.integers(1, unit - 1))
    return c.replace(global_batch_size=batch, num_samples=max(c.num_samples, batch))


def _check_dataset(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if c.num_samples < c.global_batch_size:
        return f"dataset size {c.num_samples} is smaller than one global batch ({c.global_batch_size} samples)"
    return None


def _violate_dataset(draw, c, spec, max_world):
    if c.global_batch_size < 2:
        c = c.replace(global_batch_size=2 * c.dp * c.micro_batches)
    return c.replace(num_samples=draw(st.integers(1, c.global_batch_size - 1)))


def _check_heads_divide_dim(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if c.dim % c.heads:
        return f"hidden size {c.dim} is not divisible by heads={c.heads} (each head needs a whole head dim)"
    return None


def _violate_heads_divide_dim(draw, c, spec, max_world):
    heads = max(c.heads, 2)
    # keep tp | dim when tp > 1 (so only this constraint breaks where that is possible)
    step = c.tp if heads % c.tp == 0 and c.tp > 1 else 1
    dims = [d for d in range(step, 8 * heads, step) if d % heads]
    if not dims:
        return None
    return c.replace(heads=heads, dim=draw(st.sampled_from(dims)))


def _check_seq_len(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if c.seq_len > MAX_SEQ_LEN:
        return f"sequence length {c.seq_len} exceeds the model's max_seq_len {MAX_SEQ_LEN} (allowed: 1..{MAX_SEQ_LEN})"
    return None


def _violate_seq_len(draw, c, spec, max_world):
    return c.replace(seq_len=draw(st.integers(MAX_SEQ_LEN + 1, 4 * MAX_SEQ_LEN)))


def _check_dtype(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if c.dtype not in spec.dtypes:
        return f"dtype {c.dtype!r} is not allowed for {spec.name!r} (allowed: {', '.join(spec.dtypes)})"
    return None


def _violate_dtype(draw, c, spec, max_world):
    return c.replace(dtype=draw(st.sampled_from(("int8", "float8", "complex64", "torch.float32"))))


def _check_optimizer(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if c.optimizer not in spec.optimizers:
        return f"optimizer {c.optimizer!r} is not allowed for {spec.name!r} (allowed: {', '.join(spec.optimizers)})"
    return None


def _violate_optimizer(draw, c, spec, max_world):
    return c.replace(optimizer=draw(st.sampled_from(("adam", "lamb", "Adamw"))))


def _tp_check(key: str, label: str) -> CheckFn:
    def check(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
        value = getattr(c, key)
        if value % c.tp:
            return f"{label} {value} is not divisible by tp={c.tp} (allowed: a multiple of {c.tp})"
        return None

    return check


def _tp_violate(key: str) -> ViolateFn:
    def violate(draw, c, spec, max_world):
        if c.tp < 2:
            return None
        value = c.tp * draw(st.integers(0, 3)) + draw(st.integers(1, c.tp - 1))
        if key == "heads":  # keep heads | dim so only the tp constraint breaks
            return c.replace(heads=value, dim=value * max(1, c.dim // c.heads))
        if key == "dim":  # dim % tp != 0 cannot keep heads | dim with tp | heads: use one head
            return c.replace(dim=value, heads=1) if value > 0 else None
        return c.replace(**{key: value})

    return violate


def _check_pp_layers(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if spec.pp_layers == "divisible" and c.layers % c.pp:
        return f"layer count {c.layers} is not divisible by pp={c.pp} (each stage needs the same number of layers)"
    if c.layers < c.pp:
        return f"layer count {c.layers} is smaller than pp={c.pp}: each pipeline stage needs at least one layer"
    return None


def _violate_pp_layers(draw, c, spec, max_world):
    if c.pp < 2:
        return None
    if spec.pp_layers == "divisible":
        return c.replace(layers=c.pp * draw(st.integers(0, 2)) + draw(st.integers(1, c.pp - 1)))
    return c.replace(layers=draw(st.integers(1, c.pp - 1)))


def _covers_stages(spec: StrategySpec, options: Iterable[tuple[str, Any]]) -> bool:
    """Whether ``spec`` with these options needs micro_batches >= pp."""
    rule = spec.micro_batches_cover_stages
    if "pp" not in spec.dims or rule is False:
        return False
    return True if rule is True else bool(rule(dict(options)))


def _check_micro_cover_stages(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if _covers_stages(spec, c.options) and c.micro_batches < c.pp:
        return (
            f"micro-batches {c.micro_batches} < pp={c.pp}: the pipeline schedule needs at least one "
            f"micro-batch per stage (allowed: micro_batches >= {c.pp})"
        )
    return None


def _violate_micro_cover_stages(draw, c, spec, max_world):
    if c.pp < 2 or not _covers_stages(spec, c.options):
        return None
    micro = draw(st.integers(1, c.pp - 1))
    batch = c.dp * micro * max(1, c.micro_batch_size)
    return c.replace(micro_batches=micro, global_batch_size=batch, num_samples=max(c.num_samples, batch))


COMMON_CONSTRAINTS: tuple[Constraint, ...] = (
    Constraint("positive-ints", _check_ints, _violate_ints, fatal=True, doc="every size and count is an int >= 1"),
    Constraint("strategy-options", _check_strategy_options, _violate_options, doc="options are the strategy's, with allowed values"),
    Constraint("dims-used", _check_dims_used, _violate_dims_used, doc="mesh dims the strategy does not use are 1",
               breakable=lambda spec: len(spec.dims) < len(DIM_ORDER)),
    Constraint("min-degree", _check_min_degree, _violate_min_degree, doc="the strategy's minimum degree per dim",
               breakable=lambda spec: any(v > 1 for v in spec.min_degree.values())),
    Constraint("world-size-limit", _check_world, _violate_world, doc="world size <= max_world"),
    Constraint("batch-divides", _check_batch_split, _violate_batch_split, doc="global batch % (dp * micro_batches) == 0"),
    Constraint("dataset-holds-a-batch", _check_dataset, _violate_dataset, doc="num_samples >= global batch"),
    Constraint("heads-divide-dim", _check_heads_divide_dim, _violate_heads_divide_dim, doc="dim % heads == 0"),
    Constraint("seq-len-fits", _check_seq_len, _violate_seq_len, doc=f"seq_len <= {MAX_SEQ_LEN}"),
    Constraint("dtype", _check_dtype, _violate_dtype, doc="dtype is one the strategy supports"),
    Constraint("optimizer", _check_optimizer, _violate_optimizer, doc="optimizer is one the strategy supports"),
)

TP_CONSTRAINTS: tuple[Constraint, ...] = (
    Constraint("tp-divides-heads", _tp_check("heads", "head count"), _tp_violate("heads"), doc="heads % tp == 0", needs={"tp": 2}),
    Constraint("tp-divides-dim", _tp_check("dim", "hidden size"), _tp_violate("dim"), doc="dim % tp == 0", needs={"tp": 2}),
    Constraint("tp-divides-hidden", _tp_check("hidden", "MLP width"), _tp_violate("hidden"), doc="MLP width % tp == 0", needs={"tp": 2}),
)

PP_CONSTRAINTS: tuple[Constraint, ...] = (
    Constraint("pp-layers", _check_pp_layers, _violate_pp_layers, doc="layers >= pp (and layers % pp == 0 where declared)", needs={"pp": 2}),
)

MICRO_CONSTRAINT = Constraint(
    "micro-batches-cover-stages", _check_micro_cover_stages, _violate_micro_cover_stages, doc="micro_batches >= pp",
    needs={"pp": 2},
)


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


def _prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


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


# -- valid configs -----------------------------------------------------------------------------

_FIELDS = {f.name for f in dataclasses.fields(ParallelConfig)} - {"strategy"}
_OVERRIDABLE = _FIELDS | {"world_size", "head_dim"}


def _factorizations(world: int, spec: StrategySpec, min_degree: Mapping[str, int] | None = None) -> list[dict[str, int]]:
    """Every way to write ``world`` as a product over the spec's dims (respecting the spec's
    and ``min_degree``'s minimum degrees), simplest first: the non-data-parallel dims as small
    as possible."""
    lows = {d: max(spec.min_degree.get(d, 1), (min_degree or {}).get(d, 1)) for d in spec.dims}
    out = []
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for combo in itertools.product(divisors, repeat=len(spec.dims)):
        if _prod(combo) != world:
            continue
        degrees = dict(zip(spec.dims, combo))
        if all(degrees[d] >= lows[d] for d in spec.dims):
            out.append(degrees)
    order = [d for d in ("tp", "pp", "dp") if d in spec.dims]
    return sorted(out, key=lambda g: tuple(g[d] for d in order))


def _worlds(spec: StrategySpec, min_world: int, max_world: int, min_degree: Mapping[str, int] | None = None) -> list[int]:
    return [w for w in range(min_world, max_world + 1) if _factorizations(w, spec, min_degree)]


def _pick(draw, fixed: Mapping[str, Any], name: str, default: SearchStrategy[Any]) -> Any:
    if name in fixed:
        value = fixed[name]
        return draw(value) if isinstance(value, SearchStrategy) else value
    return draw(default)


def parallel_configs(
    strategy: str | StrategySpec,
    *,
    max_world: int,
    min_world: int = 1,
    min_degree: Mapping[str, int] | None = None,
    max_micro_batches: int = 4,
    max_micro_batch_size: int = 3,
    max_steps: int = 3,
    max_seq_len: int = 8,
    min_dim: int = 4,
    **fixed: Any,
) -> SearchStrategy[ParallelConfig]:
    """Valid :class:`ParallelConfig` s for ``strategy`` with world sizes ``min_world..max_world``
    (never more: a test that allows 2 ranks never gets a 4-rank config).

    Configs are *built* to meet the spec's constraints (heads, hidden size and MLP width are
    multiples of tp, layers at least pp, micro-batches >= pp, the global batch a multiple of
    dp x micro-batches, the dataset at least one global batch and often not a multiple of the
    replicas), so every example is runnable and shrinking moves toward the smallest world,
    batch, dataset and model. ``min_degree`` asks for more than the spec's minimum per dim
    (``{"tp": 2}``: only real tensor parallelism). Any field (and ``world_size`` /
    ``head_dim``) may be fixed with a value or a Hypothesis strategy:
    ``parallel_configs("ddp", max_world=2, dtype="float32", steps=st.integers(2, 3))``; a
    fixed value that breaks a constraint is filtered out (Hypothesis reports it unsatisfiable
    if nothing is left). ``min_dim`` (default 4) keeps the hidden size out of the range where
    LayerNorm is degenerate: over 2 features its output is +-1 whatever the input, so every
    gradient through it is exactly 0 in exact arithmetic and a comparison sees only rounding
    noise (float32 strategies then "mismatch" by factors of 16 on the correct DDP and TP)."""
    spec = get_spec(strategy)
    unknown = sorted(set(fixed) - _OVERRIDABLE)
    if unknown:
        raise TypeError(f"parallel_configs: unknown field(s) {unknown}; allowed: {', '.join(sorted(_OVERRIDABLE))}")
    for name, value in (("max_world", max_world), ("min_world", min_world), ("max_micro_batches", max_micro_batches),
                        ("max_micro_batch_size", max_micro_batch_size), ("max_steps", max_steps), ("max_seq_len", max_seq_len),
                        ("min_dim", min_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel_configs: {name} must be an int >= 1, got {value!r}")
    if max_seq_len > MAX_SEQ_LEN:
        raise ValueError(f"parallel_configs: max_seq_len {max_seq_len} exceeds the model's max_seq_len {MAX_SEQ_LEN}")
    min_degree = dict(min_degree or {})
    bad = {d: v for d, v in min_degree.items() if d not in spec.dims or isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"parallel_configs: min_degree {bad} must name dims of {spec.name!r} ({', '.join(spec.dims)}) with ints >= 1")
    worlds = _worlds(spec, min_world, max_world, min_degree)
    if not worlds:
        needs = {d: max(spec.min_degree.get(d, 1), min_degree.get(d, 1)) for d in spec.dims}
        raise ValueError(
            f"parallel_configs: {spec.name!r} cannot run on {min_world}..{max_world} ranks: it needs "
            + ", ".join(f"{d} >= {v}" for d, v in needs.items())
            + f" (at least {_prod(needs.values())} ranks); raise max_world"
        )
    extra_names = {c.name for c in spec.extra}

    @st.composite
    def build(draw) -> ParallelConfig:
        world = _pick(draw, fixed, "world_size", st.sampled_from(worlds))
        wanted = {d: _pick(draw, fixed, d, st.just(1)) for d in DIM_ORDER if d in fixed}
        choices = [
            g for g in (_factorizations(world, spec, min_degree) if isinstance(world, int) and 1 <= world <= max_world else [])
            if all(g.get(d, 1) == v for d, v in wanted.items())
        ]
        if not choices:
            reject()  # a fixed world size / degree outside what this search allows
        degrees = draw(st.sampled_from(choices))
        dp, tp, pp = (degrees.get(d, 1) for d in ("dp", "tp", "pp"))
        if "options" in fixed:
            options = tuple(_pick(draw, fixed, "options", st.just(())))
        else:
            options = tuple((k, draw(st.sampled_from(v))) for k, v in sorted(spec.options.items()))
        lo = pp if _covers_stages(spec, options) else 1
        micro = _pick(draw, fixed, "micro_batches", st.integers(lo, max(lo, max_micro_batches)))
        per = draw(st.integers(1, max_micro_batch_size))
        batch = _pick(draw, fixed, "global_batch_size", st.just(dp * micro * per))
        extra = draw(st.integers(0, 2 * batch)) if isinstance(batch, int) and batch > 0 else 0
        num_samples = _pick(draw, fixed, "num_samples", st.just(batch + extra))
        steps = _pick(draw, fixed, "steps", st.integers(1, max_steps))
        heads = _pick(draw, fixed, "heads", st.integers(1, 2).map(lambda k: tp * k))
        low = -(-min_dim // heads) if isinstance(heads, int) and heads > 0 else 1  # ceil: dim >= min_dim
        head_dim = _pick(draw, fixed, "head_dim", st.integers(low, max(low, 4)))
        dim = _pick(draw, fixed, "dim", st.just(heads * head_dim))
        hidden = _pick(draw, fixed, "hidden", st.integers(1, 4).map(lambda k: tp * k))
        layer_unit = pp if spec.pp_layers == "divisible" else 1
        layers = _pick(draw, fixed, "layers", st.integers(0, 1).map(lambda k: pp + k * layer_unit))
        seq_len = _pick(draw, fixed, "seq_len", st.integers(1, max_seq_len))
        vocab = _pick(draw, fixed, "vocab", st.just(16))
        dtype = _pick(draw, fixed, "dtype", st.sampled_from(spec.dtypes))
        optimizer = _pick(draw, fixed, "optimizer", st.sampled_from(spec.optimizers))
        config = ParallelConfig(
            strategy=spec.name, dp=dp, tp=tp, pp=pp, global_batch_size=batch, micro_batches=micro,
            num_samples=num_samples, steps=steps, seq_len=seq_len, dim=dim, heads=heads, hidden=hidden,
            layers=layers, vocab=vocab, dtype=dtype, optimizer=optimizer, options=options,
        )
        found = config.violations(spec, max_world=max_world)
        if found:
            if not fixed and any(v.constraint not in extra_names for v in found):
                # the construction above is meant to meet every built-in constraint
                raise AssertionError(f"harness.search built an invalid config (a generator bug): {found} for {config!r}")
            reject()  # a fixed field or one of the spec's extra constraints rules this one out
        return config

    return build()


# -- invalid configs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class InvalidConfig:
    """A config that breaks ``constraint`` (and possibly others it implies)."""

    config: ParallelConfig
    constraint: str


def invalid_configs(
    strategy: str | StrategySpec,
    *,
    max_world: int,
    constraints: Sequence[str] | None = None,
    **fixed: Any,
) -> SearchStrategy[InvalidConfig]:
    """Configs for ``strategy`` that each break one named constraint (``constraints``: only
    these; default every constraint that can be broken for this strategy within
    ``max_world``). ``validate(max_world=max_world)`` must reject each with an
    :class:`InvalidConfigError` that names the constraint."""
    spec = get_spec(strategy)
    candidates = [c for c in constraints_for(spec, max_world=max_world) if c.violate is not None]
    if constraints is not None:
        known = {c.name for c in candidates}
        unknown = [n for n in constraints if n not in known]
        if unknown:
            raise ValueError(f"invalid_configs: {unknown} cannot be broken for {spec.name!r}; choose from {sorted(known)}")
        candidates = [c for c in candidates if c.name in constraints]
    # A constraint that can only be broken from a base with some degree > 1 needs a world that allows it.
    def reachable(c: Constraint) -> bool:
        if c.breakable is not None and not c.breakable(spec):
            return False
        needs = {d: v for d, v in c.needs.items() if d in spec.dims}
        if len(needs) != len(c.needs):
            return False
        return bool(_worlds(spec, 1, max_world, needs))

    usable = [c for c in candidates if reachable(c)]
    unreachable = [c.name for c in candidates if c not in usable]
    if unreachable and constraints is not None:
        raise ValueError(f"invalid_configs: {unreachable} cannot be broken within max_world={max_world} for {spec.name!r}")
    if not usable:
        raise ValueError(f"invalid_configs: no constraint of {spec.name!r} can be broken within max_world={max_world}")

    @st.composite
    def build(draw) -> InvalidConfig:
        constraint = draw(st.sampled_from(usable))
        base = draw(parallel_configs(spec, max_world=max_world, min_degree=dict(constraint.needs), **fixed))
        bad = constraint.violate(draw, base, spec, max_world)
        assume(bad is not None)
        return InvalidConfig(bad, constraint.name)

    return build()


# -- running examples on the warm pool ---------------------------------------------------------


def run_example(
    ctx: DistContextLike,
    factory: Callable[[ParallelConfig], Strategy],
    config: ParallelConfig,
    cache: str | None = None,
    workdir: str | None = None,
    tolerance: Any = "auto",
) -> RunResult | None:
    """On each rank: build the case and the strategy from ``config`` and run it against the
    reference. Returns the :class:`RunResult` on rank 0 (None elsewhere)."""
    from .run import run_strategy

    if ctx.world_size != config.world_size:
        raise ParallelConfigError(f"config needs {config.world_size} ranks ({config.describe()}), running on {ctx.world_size}")
    strategy = factory(config)
    result = run_strategy(config.case(), strategy, ctx, workdir=workdir, cache=cache, tolerance=tolerance)
    return result if ctx.rank == 0 else None


def noop(ctx: DistContextLike) -> int:
    """Used by :func:`warm_up` to start a pool."""
    return ctx.world_size


@dataclass
class ExampleOutcome:
    """One config's run: the comparison, its diagnosis and how long the example took."""

    config: ParallelConfig
    result: RunResult
    diagnoses: list[Diagnosis]
    diagnose_note: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.result.passed

    @property
    def codes(self) -> list[str]:
        return [d.code for d in self.diagnoses]

    def report(self) -> str:
        """The config, its diagnosis codes (or the first divergence) and the comparison."""
        verdict = "matches the reference" if self.passed else "does NOT match the reference"
        lines = [f"{self.config.strategy} {verdict} for", f"  config: {self.config.describe()}", f"  {self.config!r}"]
        if not self.passed:
            if self.diagnoses:
                lines.append("  diagnosis: " + ", ".join(self.codes))
                lines += [f"    {d.code}: {d.summary}" for d in self.diagnoses]
            else:
                div = self.result.comparison.first_divergence
                lines.append(f"  diagnosis: none ({self.diagnose_note})")
                if div is not None:
                    lines.append(f"  {div.line()}")
        lines += ["  " + line for line in self.result.summary().splitlines()]
        return "\n".join(lines)


class ConfigFailure(AssertionError):
    """A generated (or given) config on which the strategy failed; ``config`` is the config and
    ``search_report`` (set by :func:`assert_matches_reference_for_all`) what the search ran."""

    config: ParallelConfig
    search_report: SearchReport | None = None


class ConfigMismatch(ConfigFailure):
    """A strategy did not match the reference for ``config``; the message is the full report
    (config, diagnosis codes, comparison)."""

    def __init__(self, outcome: ExampleOutcome):
        super().__init__(outcome.report())
        self.outcome = outcome
        self.config = outcome.config
        self.codes = outcome.codes


class ConfigCrashed(ConfigFailure):
    """A rank raised, died or hung on ``config``; the message is the config and the launcher's
    per-rank report (the failing rank's traceback, or every rank's stack on a hang)."""

    def __init__(self, config: ParallelConfig, report: str, *, hung: bool):
        what = "hung (timed out)" if hung else "crashed"
        super().__init__(f"{config.strategy} {what} for\n  config: {config.describe()}\n  {config!r}\n{report}")
        self.config = config
        self.report = report
        self.hung = hung
        self.codes: list[str] = []


def _diagnose(result: RunResult) -> tuple[list[Diagnosis], str]:
    """The diagnosis engine's codes for ``result`` when :mod:`harness.diagnose` provides
    ``diagnose_result``; otherwise none, with the reason (the report then shows the first
    divergence)."""
    try:
        from .diagnose import diagnose_result  # type: ignore[attr-defined]
    except ImportError as exc:
        return [], f"no diagnosis engine: {exc}"
    try:
        return list(diagnose_result(result)), "diagnosed"
    except Exception as exc:  # noqa: BLE001 - a broken engine must not hide the mismatch
        return [], f"the diagnosis engine failed: {type(exc).__name__}: {exc}"


def _factory_of(strategy: str | StrategySpec) -> tuple[StrategySpec, Callable[[ParallelConfig], Strategy]]:
    spec = get_spec(strategy)
    return spec, spec.factory


def check_config(
    runner: RankRunner,
    strategy: str | StrategySpec,
    config: ParallelConfig,
    *,
    cache: str | os.PathLike[str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    tolerance: Any = "calibrated",
    timeout: float = RANK_TIMEOUT_S,
    max_world: int | None = None,
) -> ExampleOutcome:
    """Validate ``config`` for ``strategy`` (clear error naming the failing constraint), run it
    on ``config.world_size`` warm ranks and diagnose the comparison. One ``runner.run`` call.
    ``tolerance`` as :func:`harness.run.run_strategy`; calibrated by default, see
    :func:`assert_matches_reference_for_all`. Raises ``RanksFailed`` / ``RanksHung`` when a rank
    fails, dies or hangs."""
    spec, factory = _factory_of(strategy)
    if config.strategy != spec.name:
        config = config.replace(strategy=spec.name)
    config.validate(spec, max_world=max_world)
    own_workdir = workdir is None  # a passing example's records are removed, a failing one's kept
    workdir = tempfile.mkdtemp(prefix=f"harness-search-{spec.name}-") if own_workdir else workdir
    start = time.perf_counter()
    values = runner.run(
        run_example,
        nproc=config.world_size,
        kwargs={
            "factory": factory, "config": config, "cache": None if cache is None else str(cache),
            "workdir": str(workdir), "tolerance": tolerance,
        },
        timeout=timeout,
    ).values
    seconds = time.perf_counter() - start
    result = values[0]
    diagnoses, why = _diagnose(result) if not result.passed else ([], "passed")
    if own_workdir and result.passed:
        shutil.rmtree(workdir, ignore_errors=True)
    return ExampleOutcome(config, result, diagnoses, why, seconds)


def assert_config_matches(
    runner: RankRunner,
    strategy: str | StrategySpec,
    config: ParallelConfig,
    **kwargs: Any,
) -> ExampleOutcome:
    """:func:`check_config`, raising :class:`ConfigMismatch` (config + diagnosis codes) on a mismatch."""
    outcome = check_config(runner, strategy, config, **kwargs)
    if not outcome.passed:
        raise ConfigMismatch(outcome)
    return outcome


def smallest_config(strategy: str | StrategySpec, world_size: int) -> ParallelConfig:
    """The simplest valid config of ``strategy`` on ``world_size`` ranks (what shrinking heads for)."""
    spec = get_spec(strategy)
    choices = _factorizations(world_size, spec)
    if not choices:
        raise ValueError(f"{spec.name!r} cannot run on {world_size} ranks (dims {', '.join(spec.dims)}, minimum degrees {dict(spec.min_degree) or 'none'})")
    g = choices[0]
    dp, tp, pp = (g.get(d, 1) for d in ("dp", "tp", "pp"))
    options = tuple((k, v[0]) for k, v in sorted(spec.options.items()))
    micro = pp if _covers_stages(spec, options) else 1
    batch = dp * micro
    return ParallelConfig(
        strategy=spec.name, dp=dp, tp=tp, pp=pp, global_batch_size=batch, micro_batches=micro, num_samples=batch,
        steps=1, seq_len=1, dim=tp * -(-4 // tp), heads=tp, hidden=tp, layers=pp, dtype=spec.dtypes[0],
        optimizer=spec.optimizers[0], options=options,
    )


def warm_up(
    runner: RankRunner,
    strategy: str | StrategySpec,
    worlds: Iterable[int],
    *,
    cache: str | os.PathLike[str] | None = None,
    timeout: float = RANK_TIMEOUT_S,
) -> dict[int, float]:
    """Start the warm pool of every world size and run the strategy's smallest config there
    once, so pool start-up and first-use imports (DDP pulls in torch._dynamo: seconds per
    rank) never count against an example's deadline. A smallest config that fails or
    mismatches is left for the search to find. Returns seconds per world size."""
    from .remote import RanksFailed

    spec = get_spec(strategy)
    took = {}
    for world in sorted(set(worlds)):
        start = time.perf_counter()
        runner.run(noop, nproc=world, timeout=timeout)
        try:
            runner.run(
                run_example, nproc=world, timeout=timeout,
                kwargs={"factory": spec.factory, "config": smallest_config(spec, world),
                        "cache": None if cache is None else str(cache), "tolerance": "default"},
            )
        except RanksFailed:
            pass
        took[world] = time.perf_counter() - start
    return took


def search_settings(**overrides: Any) -> settings:
    """Hypothesis settings for multi-rank examples: the profile's values (database, seed,
    verbosity) with a per-example deadline that fits a warm multi-rank run
    (:data:`EXAMPLE_DEADLINE`), a small default ``max_examples`` and the too-slow health check
    off (each example is a real multi-rank training), and no explain phase (it reruns variants of
    the shrunk example to say which fields vary freely: many more multi-rank runs). ``overrides`` win."""
    base = {
        "deadline": EXAMPLE_DEADLINE,
        "max_examples": 10,
        "suppress_health_check": [HealthCheck.too_slow],
        # the explain phase reruns many variants of the shrunk example: minutes of ranks
        "phases": tuple(p for p in Phase if p is not Phase.explain),
    }
    base.update(overrides)
    return settings(**base)


@dataclass
class SearchReport:
    """What a passing search ran: how many examples, per world size, and the time per example."""

    strategy: str
    examples: int = 0
    seconds: list[float] = field(default_factory=list)
    worlds: dict[int, int] = field(default_factory=dict)
    warm_up_s: dict[int, float] = field(default_factory=dict)
    configs: list[ParallelConfig] = field(default_factory=list)

    @property
    def mean_seconds(self) -> float:
        return sum(self.seconds) / len(self.seconds) if self.seconds else 0.0

    def summary(self) -> str:
        per_world = ", ".join(f"world {w}: {n}" for w, n in sorted(self.worlds.items()))
        return (
            f"{self.strategy}: {self.examples} examples ({per_world}), "
            f"{self.mean_seconds * 1000:.0f} ms per example on the warm pool "
            f"(min {min(self.seconds, default=0) * 1000:.0f}, max {max(self.seconds, default=0) * 1000:.0f})"
        )


def _database_digest(key: str, spec: StrategySpec, config_kwargs: Mapping[str, Any]) -> bytes:
    text = repr((key, spec.name, getattr(spec.factory, "__module__", ""), getattr(spec.factory, "__qualname__", ""),
                 sorted((k, repr(v)) for k, v in config_kwargs.items())))
    return hashlib.sha256(text.encode()).digest()


def assert_matches_reference_for_all(
    strategy: str | StrategySpec,
    runner: RankRunner,
    *,
    max_world: int,
    max_examples: int | None = None,
    cache: str | os.PathLike[str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    tolerance: Any = "calibrated",
    hypothesis_settings: Mapping[str, Any] | None = None,
    key: str | None = None,
    configs: SearchStrategy[ParallelConfig] | None = None,
    warm: bool = True,
    seed: int | None = None,
    **space: Any,
) -> SearchReport:
    """The one-line property: for every generated config, ``strategy`` matches the reference.

    Each Hypothesis example is one :func:`check_config` call on ``runner``'s warm pools
    (started beforehand by :func:`warm_up`, so start-up is outside the deadline). On a failure
    Hypothesis shrinks to the smallest failing config and raises :class:`ConfigMismatch` (a
    crash or hang: :class:`ConfigCrashed`) whose message is that config, its diagnosis codes
    (the first divergence if the engine names none) and the comparison; its ``search_report``
    says how many examples ran and how long each took.

    ``tolerance`` defaults to ``"calibrated"``: generated configs reach gradients that are sums
    of cancelling terms, where the fixed per-dtype float32 defaults flag the correct DDP and TP
    (the noise of another accumulation order is what calibration measures). ``space`` fixes
    fields as :func:`parallel_configs` does; ``configs`` replaces the generator.
    ``hypothesis_settings`` (keyword arguments of ``hypothesis.settings``: database,
    derandomize, phases, ...) go over :func:`search_settings` with :func:`example_deadline`.
    The database key is derived from ``key`` (default: the running pytest test's id), the
    strategy and the space, so a failure replays from Hypothesis's database on the next run;
    ``--hypothesis-seed`` applies as for any ``@given`` test, and ``seed`` fixes the search like
    ``@hypothesis.seed`` (which, like ``derandomize``, turns the database off). ``warm=False``
    skips :func:`warm_up`. Returns a :class:`SearchReport`."""
    from .remote import RanksFailed, RanksHung

    spec = get_spec(strategy)
    space_kwargs = {k: v for k, v in space.items()}
    configs = configs if configs is not None else parallel_configs(spec, max_world=max_world, **space_kwargs)
    min_world = space_kwargs.get("min_world", 1)
    report = SearchReport(strategy=spec.name)
    worlds = [w for w in _worlds(spec, min_world, max_world, space_kwargs.get("min_degree"))
              if not isinstance(space_kwargs.get("world_size"), int) or w == space_kwargs["world_size"]]
    if warm:
        report.warm_up_s = warm_up(runner, spec, worlds, cache=cache)
    own_workdir = workdir is None
    base = tempfile.mkdtemp(prefix=f"harness-search-{spec.name}-") if own_workdir else str(workdir)

    def example(config: ParallelConfig) -> None:
        note(f"config: {config.describe()}")
        event(f"world {config.world_size} [{' x '.join(f'{n}={s}' for n, s in config.mesh.items())}]")
        event("dataset divides the replicas" if config.num_samples % config.dp == 0 else "dataset does not divide the replicas")
        report.examples += 1
        report.worlds[config.world_size] = report.worlds.get(config.world_size, 0) + 1
        report.configs.append(config)
        start = time.perf_counter()
        try:
            outcome = check_config(runner, spec, config, cache=cache, workdir=base, tolerance=tolerance, max_world=max_world)
        except RanksFailed as exc:
            report.seconds.append(time.perf_counter() - start)
            raise ConfigCrashed(config, exc.report, hung=isinstance(exc, RanksHung)) from None
        report.seconds.append(outcome.seconds)
        if not outcome.passed:
            raise ConfigMismatch(outcome)

    digest_key = key or os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or "harness.search"
    example._hypothesis_internal_add_digest = _database_digest(digest_key, spec, space_kwargs)  # type: ignore[attr-defined]
    example.__qualname__ = f"assert_matches_reference_for_all[{spec.name}]"
    overrides = {"deadline": example_deadline(max_world), **dict(hypothesis_settings or {})}
    if max_examples is not None:
        overrides["max_examples"] = max_examples
    test = search_settings(**overrides)(given(configs)(example))
    if seed is not None:  # @hypothesis.seed: a fixed search (Hypothesis then turns the database off)
        test = hypothesis_seed(seed)(test)
    try:
        test()
    except ConfigFailure as exc:
        exc.search_report = report  # records stay in the workdir: the report's paths point at them
        raise
    except Exception as group:  # an ExceptionGroup: several distinct failures (report_multiple_bugs)
        for exc in getattr(group, "exceptions", ()):
            if isinstance(exc, ConfigFailure):
                exc.search_report = report
        raise
    if own_workdir:
        shutil.rmtree(base, ignore_errors=True)
    return report


def given_configs(
    strategy: str | StrategySpec,
    *,
    max_world: int,
    argname: str = "config",
    hypothesis_settings: Mapping[str, Any] | None = None,
    **space: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@given(config=parallel_configs(...))`` with :func:`search_settings`, for a test that
    runs its own check per config (pytest fixtures such as ``rank_runner`` still arrive, and
    the test is an ordinary Hypothesis test: database, ``--hypothesis-seed``, statistics)::

        @given_configs("ddp", max_world=2, hypothesis_settings={"max_examples": 5})
        def test_custom(rank_runner, config):
            assert_config_matches(rank_runner, "ddp", config)

    Settings go in ``hypothesis_settings`` (Hypothesis refuses a second ``@settings``)."""
    configs = parallel_configs(strategy, max_world=max_world, **space)
    chosen = search_settings(**{"deadline": example_deadline(max_world), **dict(hypothesis_settings or {})})

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if argname not in inspect.signature(fn).parameters:
            raise TypeError(f"given_configs: {fn.__qualname__} has no parameter {argname!r} to receive the config")
        return chosen(given(**{argname: configs})(fn))

    return decorate
