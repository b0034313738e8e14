"""Any rank's state -> full tensors under reference names, one tensor at a time.

Layouts handled:

- DTensor with any placements (Shard on any dim, Replicate, Partial), including FSDP2
  ``fully_shard`` parameters, gradients and optimizer state: ``DTensor.full_tensor()``, i.e.
  PyTorch's own redistribution, run by the ranks of the tensor's mesh;
- plain tensors replicated on every rank (DDP, single device);
- plain tensors sharded by hand, declared with :func:`annotate_shard` (dim + process group or
  mesh dim): all-gathered along that dim over that group, uneven shards allowed;
- pipeline stages: each rank declares its stage; the union over stages is taken, and a name
  held by two stages or by none (:class:`StageCoverageError`) is an error.

Wrapper prefixes (DDP's and DeepSpeed's ``module.``, ``torch.compile``'s ``_orig_mod.``,
activation checkpointing's ``_checkpoint_wrapped_module.``, FSDP1's ``_fsdp_wrapped_module.``,
Lightning Fabric's ``_forward_module.``: :data:`WRAPPER_ATTRS`) are removed by walking the
module tree, the same rule as ``torch.distributed.checkpoint``'s FQNs.

:class:`GatheredTensors` is a collective iterator: every rank of the default group iterates it
in the same order; ``dst`` receives each full tensor (others get ``None``), so memory stays
near one full tensor plus the model.
"""

from __future__ import annotations

import hashlib
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from reference.record import is_dtensor, optimizer_state_items

__all__ = [
    "GatherError",
    "GatheredTensors",
    "LocalTensor",
    "ShardSpec",
    "StageCoverageError",
    "annotate_shard",
    "full_tensor",
    "gather_state",
    "local_state",
    "reference_name",
    "reference_named_parameters",
    "rename_parameters",
    "shard_spec",
    "tensor_digest",
]

STATE_KINDS = ("grad", "param", "optim")


class GatherError(RuntimeError):
    """Local state that cannot be assembled into full reference tensors."""


class StageCoverageError(GatherError):
    """Pipeline stages do not cover the model exactly once.

    ``missing``: reference names no stage holds; ``duplicated``: name -> stages holding it."""

    def __init__(self, message: str, missing: Sequence[str], duplicated: dict[str, list[int]]):
        super().__init__(message)
        self.missing = list(missing)
        self.duplicated = dict(duplicated)


# -- reference names -----------------------------------------------------------------------


# Wrapper classes of the frameworks people train with, by class name (anywhere in the MRO, so
# subclasses such as DeepSpeed's PipelineEngine count) -> the attribute holding the user's
# module. Names, not imports: a framework that is not installed costs nothing, and any module
# path (torch's or Megatron-Core's DistributedDataParallel) matches.
WRAPPER_ATTRS: dict[str, str] = {
    "DistributedDataParallel": "module",  # torch DDP, Megatron-Core DDP
    "DataParallel": "module",
    "DeepSpeedEngine": "module",
    "Float16Module": "module",  # Megatron-Core's mixed-precision wrapper
    "OptimizedModule": "_orig_mod",  # torch.compile
    "ActivationWrapper": "_checkpoint_wrapped_module",  # checkpoint / offload wrappers
    "FullyShardedDataParallel": "_fsdp_wrapped_module",  # FSDP1
    "_FabricModule": "_forward_module",  # Lightning Fabric
}


def _wrapped_attr(module: Any) -> str | None:
    """The attribute through which a wrapper module holds the user's module, if it is one."""
    for cls in type(module).__mro__:
        attr = WRAPPER_ATTRS.get(cls.__name__)
        if attr is not None and isinstance(getattr(module, attr, None), nn.Module):
            return attr
    return None


def reference_name(model: nn.Module, name: str) -> str:
    """``model``'s parameter/buffer name ``name`` without wrapper components, e.g.
    ``module._orig_mod.layers.0._checkpoint_wrapped_module.w`` -> ``layers.0.w``."""
    out: list[str] = []
    current: Any = model
    for part in name.split("."):
        if current is not None and _wrapped_attr(current) == part:
            current = getattr(current, part)
            continue
        out.append(part)
        current = getattr(current, part, None) if isinstance(current, nn.Module) else None
    return ".".join(out)


_NAMES_ATTR = "_harness_reference_names"


def rename_parameters(model: nn.Module, names: Mapping[str, str] | Callable[[str], str]) -> nn.Module:
    """Declare the reference names of ``model``'s parameters where they differ (a hand-sharded
    model's ``up_w`` is the reference's ``up.weight``): a mapping from this model's names
    (wrapper prefixes already stripped) to the reference's - names it does not list stay as
    they are - or a function of the name. Every gather, record and trace of ``model`` then uses
    the reference names. Returns ``model``."""
    if not (isinstance(names, Mapping) or callable(names)):
        raise TypeError(f"names must be a mapping or a function of a parameter name, got {type(names).__name__}")
    object.__setattr__(model, _NAMES_ATTR, names)
    return model


def _renamed(model: nn.Module, name: str) -> str:
    names = getattr(model, _NAMES_ATTR, None)
    if names is None:
        return name
    renamed = names.get(name, name) if isinstance(names, Mapping) else names(name)
    if not isinstance(renamed, str) or not renamed:
        raise GatherError(f"the names given for {type(model).__name__} map {name!r} to {renamed!r}; give a parameter name")
    return renamed


def reference_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` under reference names (wrapper prefixes stripped, then any
    :func:`rename_parameters`; clear error on collisions)."""
    result: list[tuple[str, nn.Parameter]] = []
    seen: dict[str, str] = {}
    for raw, param in model.named_parameters():
        name = _renamed(model, reference_name(model, raw))
        if name in seen:
            raise GatherError(
                f"parameters {seen[name]!r} and {raw!r} both map to reference name {name!r}"
            )
        seen[name] = raw
        result.append((name, param))
    return result


def prefix_rename(actual: Mapping[str, tuple[int, ...] | None], expected: Mapping[str, tuple[int, ...]]) -> tuple[str, str] | None:
    """``(strip, add)`` when every name of ``actual`` is ``strip + x`` and the reference's is
    ``add + x``, one to one, with matching shapes (``None``: a sharded tensor's local shape,
    not compared): an unknown wrapper around the model (``strip``) or a model that is part
    of the reference's (``add``). None when no such prefix exists or names already match."""
    if set(actual) == set(expected) or len(actual) != len(expected) or not actual:
        return None
    first = min(actual)
    candidates = []
    for ref in expected:
        if first.endswith("." + ref):
            candidates.append((first[: -len(ref)], ""))
        elif ref.endswith("." + first):
            candidates.append(("", ref[: -len(first)]))
    for strip, add in dict.fromkeys(candidates):
        mapped = {name: add + name[len(strip):] for name in actual if name.startswith(strip)}
        if len(mapped) == len(actual) and set(mapped.values()) == set(expected) and all(
            actual[a] is None or tuple(actual[a]) == tuple(expected[r]) for a, r in mapped.items()
        ):
            return strip, add
    return None


def adopt_prefix_names(model: nn.Module, expected: Mapping[str, tuple[int, ...]]) -> tuple[str, str] | None:
    """Apply :func:`prefix_rename` to ``model``'s reference names when it finds a prefix (and
    the user declared no names of their own); returns ``(strip, add)`` for the report's notice."""
    if getattr(model, _NAMES_ATTR, None) is not None:
        return None
    named = reference_named_parameters(model)
    shapes = {n: (None if shard_spec(p) is not None else tuple(p.shape)) for n, p in named}
    found = prefix_rename(shapes, expected)
    if found is not None:
        strip, add = found
        rename_parameters(model, lambda name: add + name[len(strip):] if name.startswith(strip) else name)
    return found


# -- hand-sharded tensors ------------------------------------------------------------------


@dataclass(frozen=True)
class ShardSpec:
    """A plain tensor holding this rank's slice of a full tensor along ``dim``; the slices of
    the ranks of ``group`` (or of ``mesh``'s ``mesh_dim``), in group-rank order, concatenate to
    the full tensor."""

    dim: int
    group: Any = None  # dist.ProcessGroup
    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh
    mesh_dim: int | str | None = None

    def __post_init__(self) -> None:
        if (self.group is None) == (self.mesh is None):
            raise GatherError(
                "ShardSpec needs exactly one of group=<ProcessGroup> or mesh=<DeviceMesh> "
                "(with mesh_dim)"
            )
        if self.mesh is not None and self.mesh.ndim > 1 and self.mesh_dim is None:
            raise GatherError(
                f"ShardSpec on a {self.mesh.ndim}-d mesh needs mesh_dim (one of "
                f"{self.mesh.mesh_dim_names or list(range(self.mesh.ndim))})"
            )

    def process_group(self) -> Any:
        if isinstance(self.group, str):
            return layout_group(self.group)
        return self.group if self.group is not None else self.mesh.get_group(self.mesh_dim)


# Process groups of the rank layout's named dims ("tp"), built once by the collective
# ``run.watch`` for shards declared without a group.
_LAYOUT_GROUPS: dict[str, Any] = {}


def set_layout_group(name: str, group: Any) -> None:
    _LAYOUT_GROUPS[name] = group


def layout_group(name: str) -> Any:
    group = _LAYOUT_GROUPS.get(name)
    if group is None:
        raise GatherError(
            f"a tensor was declared sharded over the layout's {name!r} group (run.shard without group=), but the "
            f"layout given to run.watch has no {name!r} group; pass group=<ProcessGroup> or a layout with "
            f"groups={{{name!r}: [ranks]}}"
        )
    return group


# Declarations live beside the tensor, not on it: an attribute holding a ProcessGroup would
# make ``torch.save(model.state_dict())`` fail to pickle. Keyed by id, dropped with the tensor.
_SPECS: dict[int, ShardSpec] = {}


def annotate_shard(
    tensor: torch.Tensor,
    dim: int,
    *,
    group: Any = None,
    mesh: Any = None,
    mesh_dim: int | str | None = None,
) -> torch.Tensor:
    """Declare that ``tensor`` (usually a parameter of hand-written parallel code) is this
    rank's slice along ``dim`` over ``group`` (or ``mesh``'s ``mesh_dim``; a string names a
    group of the rank layout, e.g. ``"tp"``). Its gradient and same-shaped optimizer state
    are gathered the same way. Returns ``tensor``."""
    if not -tensor.dim() <= dim < max(tensor.dim(), 1):
        raise GatherError(f"annotate_shard: dim {dim} is out of range for a {tensor.dim()}-d tensor")
    key = id(tensor)
    fresh = key not in _SPECS
    _SPECS[key] = ShardSpec(dim % max(tensor.dim(), 1), group, mesh, mesh_dim)
    if fresh:
        weakref.finalize(tensor, _SPECS.pop, key, None)
    return tensor


def shard_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """How ``tensor`` is sharded by hand: declared with :func:`annotate_shard`, or by
    Megatron-Core's tensor-parallel layers (``tensor_model_parallel``, ``partition_dim``)."""
    spec = _SPECS.get(id(tensor))
    if spec is None and getattr(tensor, "tensor_model_parallel", False):
        spec = _megatron_spec(tensor)
    return spec


def _megatron_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """Megatron-Core's shard declaration, over its own tensor-parallel group."""
    stride = getattr(tensor, "partition_stride", 1)
    dim = getattr(tensor, "partition_dim", -1)
    if stride != 1:
        raise GatherError(
            f"a Megatron-Core tensor-parallel parameter of shape {tuple(tensor.shape)} is partitioned with stride "
            f"{stride} along dim {dim}: strided partitions interleave and cannot be gathered by concatenation; "
            "the harness reads partition_stride 1 only"
        )
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized() or dim < 0:
        return None
    return ShardSpec(dim, parallel_state.get_tensor_model_parallel_group())


# -- local state ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalTensor:
    """One named piece of a rank's state before gathering."""

    name: str
    tensor: torch.Tensor
    spec: ShardSpec | None = None
    stage: int | None = None


def local_state(
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    kind: str,
    *,
    stages: Sequence[int] | None = None,
) -> list[LocalTensor]:
    """This rank's ``kind`` ("grad", "param" or "optim") entries under reference names.

    ``model`` may be a list of modules (several pipeline stages on one rank) with one stage
    index each in ``stages``. Parameters without a gradient have no "grad" entry."""
    if kind not in STATE_KINDS:
        raise GatherError(f"unknown state kind {kind!r}; allowed: {', '.join(STATE_KINDS)}")
    modules = [model] if isinstance(model, nn.Module) else list(model)
    if stages is not None and len(stages) != len(modules):
        raise GatherError(f"{len(modules)} modules but {len(stages)} stage indices")
    out: list[LocalTensor] = []
    for i, module in enumerate(modules):
        stage = stages[i] if stages is not None else None
        named = reference_named_parameters(module)
        if kind == "param":
            out += [LocalTensor(n, p, shard_spec(p), stage) for n, p in named]
        elif kind == "grad":
            out += [LocalTensor(n, p.grad, shard_spec(p), stage) for n, p in named if p.grad is not None]
        else:
            if optimizer is None:
                raise GatherError("optimizer state requested but no optimizer given")
            by_name = dict(named)
            for state_name, value in optimizer_state_items(optimizer, named):
                param = by_name[state_name.rpartition(".")[0]]
                spec = shard_spec(param)
                # Scalars like Adam's `step` are replicated even when the parameter is sharded.
                if spec is not None and tuple(value.shape) != tuple(param.shape):
                    spec = None
                out.append(LocalTensor(state_name, value, spec, stage))
    return out


# -- gathering -----------------------------------------------------------------------------


def tensor_digest(t: torch.Tensor) -> str:
    """A short fingerprint of a tensor's bytes (replicas that must agree are compared by it)."""
    data = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def local_digest(t: torch.Tensor) -> str:
    """The digest of a rank's own piece of a tensor: a DTensor's local shard, else the tensor."""
    return tensor_digest(t.to_local() if is_dtensor(t) else t)


def _describe(entry: LocalTensor, check_replicas: bool) -> dict[str, Any]:
    """What other ranks need to know about one local entry (sent with all_gather_object).

    ``group``: the ranks that must take part in assembling the full tensor; ``key``: ranks
    whose local data must be identical share a key (None: no such promise, e.g. Partial)."""
    t = entry.tensor
    # "whole": this rank's local data is the full tensor (a plain replicated tensor, or a DTensor
    # replicated on every mesh dim), so a copy that differs can be sent as it is (gather_copies).
    info: dict[str, Any] = {"stage": entry.stage, "dtype": str(t.dtype), "shape": list(t.shape), "digest": None,
                            "whole": False}
    local = t
    if is_dtensor(t):
        mesh = t.device_mesh
        coord = mesh.get_coordinate() or ()
        local = t.to_local()
        # Replicas agree on their coordinates along the mesh dims that are not Replicate.
        key = [(i, c) for i, (p, c) in enumerate(zip(t.placements, coord)) if not p.is_replicate()]
        partial = any(p.is_partial() for p in t.placements)
        info.update(
            layout="dtensor",
            group=sorted(mesh.mesh.flatten().tolist()),
            key=None if partial else repr(("dtensor", key, [str(p) for p in t.placements])),
            shards=[[p.dim, mesh.size(i)] for i, p in enumerate(t.placements) if p.is_shard() and mesh.size(i) > 1],
            whole=all(p.is_replicate() for p in t.placements),
        )
    elif entry.spec is not None:
        pg = entry.spec.process_group()
        ranks = dist.get_process_group_ranks(pg)
        info.update(
            layout="shard",
            group=list(ranks),
            dim=entry.spec.dim,
            key=repr(("shard", dist.get_group_rank(pg, dist.get_rank()), len(ranks))),
            shards=[[entry.spec.dim, len(ranks)]] if len(ranks) > 1 else [],
        )
    else:
        info.update(layout="plain", group=[dist.get_rank()], key=repr(("full",)), whole=True)
    if check_replicas and info["key"] is not None:
        info["digest"] = tensor_digest(local)
    return info


def _describe_plain(entry: LocalTensor) -> dict[str, Any]:
    return {
        "stage": entry.stage, "dtype": str(entry.tensor.dtype), "key": None, "digest": None,
        "layout": "plain", "shape": list(entry.tensor.shape), "group": [0],
    }


def full_tensor(tensor: torch.Tensor, spec: ShardSpec | None = None, *, local_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """The full value of one rank's piece. Collective for DTensors (the ranks of its mesh)
    and for hand-sharded tensors (the ranks of the spec's group); a plain tensor is returned
    as is. ``local_sizes``: each group member's size along ``spec.dim`` (gathered if None)."""
    if is_dtensor(tensor):
        return tensor.full_tensor()
    if spec is None:
        return tensor
    pg = spec.process_group()
    n = dist.get_world_size(pg)
    local = tensor.detach().contiguous()
    if local_sizes is None:
        size = torch.tensor([local.shape[spec.dim]], device=local.device)
        sizes_t = [torch.empty_like(size) for _ in range(n)]
        dist.all_gather(sizes_t, size, group=pg)
        local_sizes = [int(s.item()) for s in sizes_t]
    biggest = max(local_sizes)
    if local.shape[spec.dim] < biggest:  # all_gather needs equal sizes: pad, then trim
        pad_shape = list(local.shape)
        pad_shape[spec.dim] = biggest - local.shape[spec.dim]
        local = torch.cat([local, local.new_zeros(pad_shape)], dim=spec.dim)
    parts = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(parts, local, group=pg)
    return torch.cat([p.narrow(spec.dim, 0, s) for p, s in zip(parts, local_sizes)], dim=spec.dim)


@dataclass
class _Entry:
    name: str
    holders: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> description


class GatheredTensors:
    """Collective iterator of ``(name, full tensor on dst | None elsewhere)``.

    Construction exchanges every rank's entry descriptions (one ``all_gather_object``) and
    validates them: names must be held by every rank (or, with stages, by exactly one stage),
    with one global shape and dtype. ``replica_mismatches`` lists names whose replicas
    (ranks that must hold identical data) differ: name -> groups of ranks that agree.
    """

    def __init__(
        self,
        entries: Iterable[LocalTensor],
        *,
        dst: int = 0,
        expected: Sequence[str] | None = None,
        check_replicas: bool = True,
        what: str = "state",
    ):
        self.dst = dst
        self.what = what
        entries = list(entries)
        self._local = {e.name: e for e in entries}
        if len(self._local) != len(entries):
            twice = sorted({e.name for e in entries if sum(x.name == e.name for x in entries) > 1})
            raise GatherError(f"{what} entries {twice} appear twice on rank {dist.get_rank() if dist.is_initialized() else 0}")
        if dist.is_available() and dist.is_initialized():
            self._world, self._rank = dist.get_world_size(), dist.get_rank()
            mine = {n: _describe(e, check_replicas and self._world > 1) for n, e in self._local.items()}
            everyone: list[Any] = [None] * self._world
            dist.all_gather_object(everyone, list(mine.items()))
        else:  # a single process: only plain tensors can exist
            self._world, self._rank = 1, 0
            for e in self._local.values():
                if e.spec is not None or is_dtensor(e.tensor):
                    raise GatherError(
                        f"{what} {e.name!r} is sharded but no process group is initialised"
                    )
            everyone = [[(n, _describe_plain(e)) for n, e in self._local.items()]]
        self._entries: dict[str, _Entry] = {}
        for rank, items in enumerate(everyone):
            for name, info in items:
                self._entries.setdefault(name, _Entry(name)).holders[rank] = info
        self.names: list[str] = list(self._entries)
        self._validate(expected)
        self.replica_mismatches = self._replica_mismatches()

    # -- validation --------------------------------------------------------------------------

    def holders(self, name: str) -> list[int]:
        return sorted(self._entries[name].holders)

    def _validate(self, expected: Sequence[str] | None) -> None:
        staged = any(info["stage"] is not None for e in self._entries.values() for info in e.holders.values())
        if staged:
            duplicated: dict[str, list[int]] = {}
            for e in self._entries.values():
                stages = sorted({info["stage"] for info in e.holders.values()}, key=lambda s: (s is None, s))
                if len(stages) > 1:
                    duplicated[e.name] = stages
            missing = [n for n in (expected or []) if n not in self._entries]
            if duplicated or missing:
                parts = []
                if duplicated:
                    parts.append(
                        "held by more than one pipeline stage: "
                        + ", ".join(f"{n!r} (stages {s}, ranks {self.holders(n)})" for n, s in duplicated.items())
                    )
                if missing:
                    parts.append(f"held by no stage: {missing}")
                raise StageCoverageError(
                    f"pipeline stages do not cover the model's {self.what} exactly once; "
                    + "; ".join(parts)
                    + ". Each layer must live on exactly one stage.",
                    missing,
                    duplicated,
                )
        else:
            everyone = set(range(self._world))
            lacking = {n: sorted(everyone - set(e.holders)) for n, e in self._entries.items() if set(e.holders) != everyone}
            missing = [n for n in (expected or []) if n not in self._entries]
            if lacking or missing:
                detail = "; ".join(f"{n!r} is missing on ranks {r} (held by {self.holders(n)})" for n, r in list(lacking.items())[:8])
                if missing:
                    detail += ("; " if detail else "") + f"held by no rank: {missing}"
                raise GatherError(
                    f"ranks hold different {self.what} entries: {detail}. Without pipeline "
                    "stages every rank must hold every name (declare stages when ranks hold "
                    "different layers)"
                )
        for e in self._entries.values():
            dtypes = {info["dtype"] for info in e.holders.values()}
            if len(dtypes) > 1:
                raise GatherError(
                    f"{self.what} {e.name!r} has different dtypes on different ranks: "
                    + ", ".join(f"rank {r}: {i['dtype']}" for r, i in sorted(e.holders.items()))
                )
            layouts = {info["layout"] for info in e.holders.values()}
            if len(layouts) > 1:
                raise GatherError(
                    f"{self.what} {e.name!r} is laid out differently on different ranks: "
                    + ", ".join(f"rank {r}: {i['layout']}" for r, i in sorted(e.holders.items()))
                )
            if layouts != {"shard"}:
                shapes = {tuple(info["shape"]) for info in e.holders.values()}
                if len(shapes) > 1:
                    raise GatherError(
                        f"{self.what} {e.name!r} has different full shapes on different ranks: "
                        + ", ".join(f"rank {r}: {tuple(i['shape'])}" for r, i in sorted(e.holders.items()))
                    )
            for rank, info in e.holders.items():
                absent = [g for g in info["group"] if g not in e.holders]
                if absent:
                    raise GatherError(
                        f"{self.what} {e.name!r} on rank {rank} is sharded over ranks "
                        f"{info['group']} ({info['layout']}) but ranks {absent} hold no shard of it"
                    )

    def _replica_mismatches(self) -> dict[str, list[list[int]]]:
        result: dict[str, list[list[int]]] = {}
        for e in self._entries.values():
            by_key: dict[str, dict[str, list[int]]] = {}
            for rank, info in e.holders.items():
                if info["key"] is not None and info["digest"] is not None:
                    by_key.setdefault(info["key"], {}).setdefault(info["digest"], []).append(rank)
            groups = [sorted(r) for digests in by_key.values() if len(digests) > 1 for r in digests.values()]
            if groups:
                result[e.name] = sorted(groups)
        return result

    # -- iteration ---------------------------------------------------------------------------

    def full_shape(self, name: str) -> tuple[int, ...]:
        e = self._entries[name]
        src = self._source(e)
        info = e.holders[src]
        if info["layout"] != "shard":
            return tuple(info["shape"])
        shape = list(info["shape"])
        shape[info["dim"]] = sum(e.holders[r]["shape"][info["dim"]] for r in info["group"])
        return tuple(shape)

    def sharding(self) -> dict[str, list[list[int]]]:
        """How each sharded entry is split: name -> ``[[tensor dim, number of shards], ...]``
        (one pair per mesh dim that shards it; entries that are whole on every rank are left
        out). Evidence for the diagnosis: a shard code needs a tensor that is sharded."""
        out: dict[str, list[list[int]]] = {}
        for name, e in self._entries.items():
            shards = e.holders[self._source(e)].get("shards") or []
            if shards:
                out[name] = [list(s) for s in shards]
        return out

    def _source(self, e: _Entry) -> int:
        return self.dst if self.dst in e.holders else min(e.holders)

    def gather_copies(self) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
        """Collective: the differing copies of every replicated entry whose replicas disagree
        (``replica_mismatches``), one per group of agreeing ranks, sent to ``dst``: name ->
        ``[(ranks, tensor), ...]`` there, empty elsewhere. Only entries whose local data is the
        whole tensor are sent; the diagnosis weighs the copies (do they sum to the reference
        over a tensor-parallel group? do they differ by more than rounding?)."""
        out: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
        for name, groups in self.replica_mismatches.items():
            e = self._entries[name]
            if not all(info.get("whole") for info in e.holders.values()):
                continue
            for ranks in groups:
                src = min(ranks)
                copy: torch.Tensor | None = None
                if self._rank == src:
                    local = self._local[name].tensor
                    copy = (local.to_local() if is_dtensor(local) else local).detach().contiguous()
                    if src != self.dst:
                        dist.send(copy, dst=self.dst)
                elif self._rank == self.dst:
                    info = e.holders[src]
                    copy = torch.empty(info["shape"], dtype=_dtype(info["dtype"]), device=_comm_device())
                    dist.recv(copy, src=src)
                if self._rank == self.dst and copy is not None:
                    out.setdefault(name, []).append((list(ranks), copy.detach().cpu().clone()))
        return out

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for name in self.names:
            yield name, self._gather_one(name)

    def _gather_one(self, name: str) -> torch.Tensor | None:
        e = self._entries[name]
        src = self._source(e)
        src_info = e.holders[src]
        full: torch.Tensor | None = None
        if self._rank in src_info["group"]:
            local = self._local[name]
            sizes = None
            if src_info["layout"] == "shard":
                sizes = [e.holders[r]["shape"][src_info["dim"]] for r in src_info["group"]]
            full = full_tensor(local.tensor, local.spec, local_sizes=sizes)
        if src != self.dst:
            # Only the destination needs the value: one point-to-point transfer.
            if self._rank == src:
                assert full is not None
                dist.send(full.detach().contiguous(), dst=self.dst)
            elif self._rank == self.dst:
                full = torch.empty(self.full_shape(name), dtype=_dtype(src_info["dtype"]), device=_comm_device())
                dist.recv(full, src=src)
        if self._rank != self.dst:
            return None
        assert full is not None
        return full.detach()


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_state(
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    kind: str,
    *,
    dst: int = 0,
    stages: Sequence[int] | None = None,
    expected: Sequence[str] | None = None,
    check_replicas: bool = True,
    local: Sequence[LocalTensor] | None = None,
) -> GatheredTensors:
    """Collective: this rank's ``kind`` state as a :class:`GatheredTensors` iterator (``local``:
    the rank's entries where a framework keeps them, instead of the torch view)."""
    return GatheredTensors(
        list(local) if local is not None else local_state(model, optimizer, kind, stages=stages),
        dst=dst,
        expected=expected,
        check_replicas=check_replicas,
        what={"grad": "gradient", "param": "parameter", "optim": "optimizer-state"}[kind],
    )
