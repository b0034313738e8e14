"""One small class owns the mesh: the degrees of each parallelism, the named DeviceMesh built
from them, and each rank's coordinates, groups and :class:`RankLayout`.

Dims are ordered outermost first as ``pp, dp, tp`` (torchtitan's order): tensor-parallel peers
are adjacent ranks (fastest links), pipeline stages the farthest apart. Only dims of size > 1
are in the mesh, so ``ParallelDims(dp=2, tp=2)`` is a 2x2 mesh named ``("dp", "tp")``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Mesh dim names whose groups synchronize data-parallel gradients.
DP_DIM_NAMES = ("dp", "dp_shard", "dp_replicate", "fsdp", "hsdp", "ddp", "data", "dp_cp", "dp_shard_cp")

def is_dp_dim(name: str) -> bool:
    """Whether a mesh dim of that name is data-parallel (its groups synchronize gradients)."""
    return name in DP_DIM_NAMES or name.startswith("dp")


@dataclass(frozen=True)
class RankLayout:
    """Where a rank sits in a parallel run.

    - ``dp_rank`` / ``dp_size``: its data-parallel replica (which samples it consumes);
    - ``stages``: pipeline stage index of each local model chunk (None: no pipeline), with
      ``num_stages`` in total;
    - ``holds_loss``: whether its micro-batch losses are its replica's loss (exactly one rank
      per replica, e.g. tensor-parallel rank 0 of the last pipeline stage);
    - ``mesh``: its coordinate per named mesh dim; ``groups``: the ranks of each process group
      it belongs to, by name. Both are recorded as evidence for the diagnosis.
    """

    dp_rank: int = 0
    dp_size: int = 1
    stages: tuple[int, ...] | None = None
    num_stages: int = 1
    holds_loss: bool = True
    mesh: Mapping[str, int] = field(default_factory=dict)
    groups: Mapping[str, Sequence[int]] = field(default_factory=dict)

    @classmethod
    def data_parallel(cls, rank: int, world_size: int) -> "RankLayout":
        """Plain data parallelism: every rank is its own replica and holds its loss."""
        return cls(dp_rank=rank, dp_size=world_size, mesh={"dp": rank}, groups={"dp": list(range(world_size))})

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["stages"] = list(self.stages) if self.stages is not None else None
        data["mesh"] = dict(self.mesh)
        data["groups"] = {k: list(v) for k, v in self.groups.items()}
        return data



__all__ = ["DIM_ORDER", "ParallelConfigError", "ParallelDims", "RankLayout"]

DIM_ORDER = ("pp", "dp", "tp")


class ParallelConfigError(ValueError):
    """A parallel configuration that cannot work (the message names the failing constraint)."""


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in DIM_ORDER:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelConfigError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1) -> "ParallelDims":
        """The data-parallel degree is what is left of ``world_size`` after tp and pp."""
        if world_size % (tp * pp):
            raise ParallelConfigError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}")
        return cls(dp=world_size // (tp * pp), tp=tp, pp=pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def names(self) -> tuple[str, ...]:
        names = tuple(n for n in DIM_ORDER if getattr(self, n) > 1)
        return names or ("dp",)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in self.names)

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ParallelConfigError(
                f"world size {world_size} does not match the mesh {self.describe()} "
                f"(pp*dp*tp = {self.pp}*{self.dp}*{self.tp} = {self.world_size})"
            )

    def check_model(self, config: Mapping[str, Any]) -> None:
        """Check a model config (keys as :class:`cases.models.TinyTransformer`'s) against the
        degrees: heads, dim and MLP width must divide by tp, layers by pp."""
        for key, label in (("heads", "head count"), ("dim", "hidden size"), ("hidden", "MLP width")):
            if key in config and config[key] % self.tp:
                raise ParallelConfigError(f"{label} {config[key]} is not divisible by tp={self.tp}")
        if "layers" in config and config["layers"] % self.pp:
            raise ParallelConfigError(f"layer count {config['layers']} is not divisible by pp={self.pp}")

    def describe(self) -> str:
        return " x ".join(f"{n}={getattr(self, n)}" for n in self.names)

    # -- coordinates, computed without a process group -----------------------------------

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate per dim (row-major over :attr:`names`)."""
        if not 0 <= rank < self.world_size:
            raise ParallelConfigError(f"rank {rank} is outside the {self.world_size}-rank mesh {self.describe()}")
        out: dict[str, int] = {}
        rest = rank
        for name, size in zip(reversed(self.names), reversed(self.shape)):
            out[name] = rest % size
            rest //= size
        return {n: out[n] for n in self.names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for name, size in zip(self.names, self.shape):
            rank = rank * size + coords.get(name, 0)
        return rank

    def coord(self, rank: int, dim: str) -> int:
        return self.coords(rank).get(dim, 0)

    def group_ranks(self, rank: int, dim: str) -> list[int]:
        """The ranks of ``rank``'s group along ``dim``: those that differ from it only there."""
        if dim not in self.names:
            return [rank]
        mine = self.coords(rank)
        return [self.rank_of({**mine, dim: i}) for i in range(getattr(self, dim))]

    def all_groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``: a partition of the world."""
        seen: list[list[int]] = []
        for r in range(self.world_size):
            g = self.group_ranks(r, dim)
            if g not in seen:
                seen.append(g)
        return seen

    def layout(self, rank: int, *, stages: Sequence[int] | None = None, num_stages: int | None = None) -> RankLayout:
        """The :class:`RankLayout` the recorder needs. With pipeline parallelism, ``stages``
        defaults to one stage per pp rank; the loss is held by tp rank 0 of the rank that owns
        the last stage."""
        c = self.coords(rank)
        if self.pp > 1 and stages is None:
            stages = (c["pp"],)
        total = num_stages if num_stages is not None else (self.pp if stages is not None else 1)
        holds_last = stages is None or (total - 1) in stages
        return RankLayout(
            dp_rank=c.get("dp", 0),
            dp_size=self.dp,
            stages=tuple(stages) if stages is not None else None,
            num_stages=total,
            holds_loss=holds_last and c.get("tp", 0) == 0,
            mesh=c,
            groups={d: self.group_ranks(rank, d) for d in self.names},
        )

    def build_mesh(self, device_type: str):
        """The named ``DeviceMesh`` (collective: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)

    def __str__(self) -> str:
        return f"ParallelDims({self.describe()}, world {self.world_size})"


