"""Hypothesis strategies over configs: :func:`parallel_configs` (valid configs, built to meet a
spec's constraints rather than filtered, so they shrink toward the smallest world, batch,
dataset and model) and :func:`invalid_configs` (configs that each break one named constraint,
for testing error messages)."""

from __future__ import annotations

import math

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import assume, reject
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from harness.parallel_dims import DIM_ORDER
from harness.search.config import MAX_SEQ_LEN, ParallelConfig
from harness.search.constraints import Constraint, constraints_for, covers_stages
from harness.search.registry import StrategySpec, get_spec, violations

__all__ = ["InvalidConfig", "invalid_configs", "parallel_configs"]


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
        if math.prod(combo) != world:
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
            + f" (at least {math.prod(needs.values())} ranks); raise max_world"
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
        lo = pp if covers_stages(spec, options) else 1
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
        optimizer = _pick(draw, fixed, "optimizer", st.sampled_from(spec.allowed_optimizers))
        config = ParallelConfig(
            strategy=spec.name, dp=dp, tp=tp, pp=pp, global_batch_size=batch, micro_batches=micro,
            num_samples=num_samples, steps=steps, seq_len=seq_len, dim=dim, heads=heads, hidden=hidden,
            layers=layers, vocab=vocab, dtype=dtype, optimizer=optimizer, options=options,
        )
        found = violations(config, spec, max_world=max_world)
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

