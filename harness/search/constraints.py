"""The named requirements a :class:`~harness.search.config.ParallelConfig` must meet: each
:class:`Constraint` has a ``check`` that says what is wrong and what is allowed, and a
``violate`` that breaks it for :func:`~harness.search.invalid_configs`. :func:`constraints_for`
says which apply to a strategy's spec, :func:`check` lists what a config breaks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from harness.parallel_dims import DIM_ORDER
from harness.search.config import INT_FIELDS, MAX_SEQ_LEN, ParallelConfig, Violation

__all__ = [
    "COMMON_CONSTRAINTS",
    "MICRO_CONSTRAINT",
    "PP_CONSTRAINTS",
    "TP_CONSTRAINTS",
    "CheckFn",
    "Constraint",
    "ViolateFn",
    "check",
    "constraints_for",
    "covers_stages",
]

# A harness.search.registry.Spec: the registry imports this module, not the reverse.
Spec = Any
CheckFn = Callable[[ParallelConfig, Spec, "int | None"], "str | None"]
# draw, a valid config, the spec, max_world -> a config that breaks the constraint (None: cannot from this one)
ViolateFn = Callable[[Callable[[SearchStrategy[Any]], Any], ParallelConfig, Spec, int], "ParallelConfig | None"]


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
    breakable: Callable[[Spec], bool] | None = None  # None: any spec's configs can break it


def _check_ints(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
    bad = [
        f"{f}={getattr(c, f)!r}" for f in INT_FIELDS
        if isinstance(getattr(c, f), bool) or not isinstance(getattr(c, f), int) or getattr(c, f) < 1
    ]
    return f"{', '.join(bad)}: each must be a positive int" if bad else None


def _violate_ints(draw, c, spec, max_world):
    name = draw(st.sampled_from(("global_batch_size", "micro_batches", "num_samples", "steps", "seq_len", "layers")))
    return c.replace(**{name: draw(st.integers(-2, 0))})


def _check_strategy_options(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
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


def _check_dims_used(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
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


def _check_min_degree(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
    low = [f"{n} >= {m}, got {n}={getattr(c, n)}" for n, m in spec.min_degree.items() if getattr(c, n) < m]
    return f"{spec.name!r} needs " + "; ".join(low) if low else None


def _violate_min_degree(draw, c, spec, max_world):
    dims = [n for n, m in spec.min_degree.items() if m > 1]
    if not dims:
        return None
    name = draw(st.sampled_from(dims))
    return c.replace(**{name: 1})


def _check_world(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
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


def _check_batch_split(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
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


def _check_dataset(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
    if c.num_samples < c.global_batch_size:
        return f"dataset size {c.num_samples} is smaller than one global batch ({c.global_batch_size} samples)"
    return None


def _violate_dataset(draw, c, spec, max_world):
    if c.global_batch_size < 2:
        c = c.replace(global_batch_size=2 * c.dp * c.micro_batches)
    return c.replace(num_samples=draw(st.integers(1, c.global_batch_size - 1)))


def _check_heads_divide_dim(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
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


def _check_seq_len(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
    if c.seq_len > MAX_SEQ_LEN:
        return f"sequence length {c.seq_len} exceeds the model's max_seq_len {MAX_SEQ_LEN} (allowed: 1..{MAX_SEQ_LEN})"
    return None


def _violate_seq_len(draw, c, spec, max_world):
    return c.replace(seq_len=draw(st.integers(MAX_SEQ_LEN + 1, 4 * MAX_SEQ_LEN)))


def _check_dtype(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
    if c.dtype not in spec.dtypes:
        return f"dtype {c.dtype!r} is not allowed for {spec.name!r} (allowed: {', '.join(spec.dtypes)})"
    return None


def _violate_dtype(draw, c, spec, max_world):
    return c.replace(dtype=draw(st.sampled_from(("int8", "float8", "complex64", "torch.float32"))))


def _check_optimizer(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
    if c.optimizer not in spec.allowed_optimizers:
        return f"optimizer {c.optimizer!r} is not allowed for {spec.name!r} (allowed: {', '.join(spec.allowed_optimizers)})"
    return None


def _violate_optimizer(draw, c, spec, max_world):
    return c.replace(optimizer=draw(st.sampled_from(("adam", "lamb", "Adamw"))))


def _tp_check(key: str, label: str) -> CheckFn:
    def check(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
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


def _check_pp_layers(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
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


def covers_stages(spec: Spec, options: Iterable[tuple[str, Any]]) -> bool:
    """Whether ``spec`` with these options needs micro_batches >= pp."""
    rule = spec.micro_batches_cover_stages
    if "pp" not in spec.dims or rule is False:
        return False
    return True if rule is True else bool(rule(dict(options)))


def _check_micro_cover_stages(c: ParallelConfig, spec: Spec, max_world: int | None) -> str | None:
    if covers_stages(spec, c.options) and c.micro_batches < c.pp:
        return (
            f"micro-batches {c.micro_batches} < pp={c.pp}: the pipeline schedule needs at least one "
            f"micro-batch per stage (allowed: micro_batches >= {c.pp})"
        )
    return None


def _violate_micro_cover_stages(draw, c, spec, max_world):
    if c.pp < 2 or not covers_stages(spec, c.options):
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


def constraints_for(spec: Any, *, max_world: int | None = None) -> list[Constraint]:
    """The constraints a config must meet for ``spec``, in the order they are checked."""
    out = [c for c in COMMON_CONSTRAINTS if max_world is not None or c.name != "world-size-limit"]
    if "tp" in spec.dims:
        out += TP_CONSTRAINTS
    if "pp" in spec.dims:
        out += PP_CONSTRAINTS
        if spec.micro_batches_cover_stages is not False:
            out.append(MICRO_CONSTRAINT)
    return out + list(spec.extra)


def check(config: ParallelConfig, spec: Any, *, max_world: int | None = None) -> list[Violation]:
    """Every constraint ``config`` breaks for ``spec``, in the order they are declared; empty
    when it is valid."""
    found: list[Violation] = []
    for constraint in constraints_for(spec, max_world=max_world):
        message = constraint.check(config, spec, max_world)
        if message:
            found.append(Violation(constraint.name, message))
            if constraint.fatal:  # later checks would divide by zero or compare junk
                break
    return found
