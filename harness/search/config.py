"""What a parallel configuration is: :class:`ParallelConfig` (values and what follows from
them), :class:`Violation` and :class:`InvalidConfigError`. Values only: the constraints a
config must meet are :mod:`harness.search.constraints`, which strategy needs which is the
registry's (:mod:`harness.search.registry`), and the case a config trains is built by
:mod:`harness.search.builtins`. Imports neither torch nor the other search modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness.parallel_dims import DIM_ORDER, ParallelConfigError, ParallelDims

__all__ = ["DTYPES", "INT_FIELDS", "MAX_SEQ_LEN", "InvalidConfigError", "ParallelConfig", "Violation"]

DTYPES = ("float32", "bfloat16", "float16", "float64")
MAX_SEQ_LEN = 16  # transformer_case's model is built with max_seq_len 16

INT_FIELDS = (
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
        return all(isinstance(getattr(self, f), int) and getattr(self, f) >= 1 for f in INT_FIELDS) and not (
            self.global_batch_size % (self.dp * self.micro_batches)
        )

    def replace(self, **changes: Any) -> ParallelConfig:
        return dataclasses.replace(self, **changes)


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
