"""What each simulated rank did, as the same :class:`~harness.tracing.run_trace.RunTrace` a real
run writes: coordinates, process groups, parameter shapes, samples and collectives per rank.

The collectives come from :class:`CollectiveLog`, a dispatch mode inside the LocalTensorMode:
it sees each functional collective (DTensor's) and each c10d collective (``dist.all_reduce``)
once, as the SPMD program issues it for every group along one mesh dim, and writes one record
per rank with that rank's group along the dim, shapes, dtype and reduce op. A group is named
by its dim and ranks, so members of one group share the name, as they share a real PG's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from harness.parallel_dims import is_dp_dim
from harness.frames import call_site
from harness.tracing.random_ops import MAX_DRAWS, RandomDraw, draw_digest, random_output
from harness.tracing.records import CollectiveRecord
from harness.tracing.run_trace import RankTrace, RunTrace

__all__ = ["CollectiveLog", "MeshGroups", "build_trace", "collective_records"]

# functional collective -> the op name the harness's records use
_FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
    "all_reduce_coalesced": "all_reduce", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
}
# c10d's RedOpType values, as the functional collectives spell them.
_REDUCE_OPS = {0: "sum", 1: "avg", 2: "product", 3: "min", 4: "max", 5: "band", 6: "bor", 7: "bxor", 8: "premul_sum"}
# c10d op (what dist.all_reduce and friends dispatch) -> the records' op name
_C10D = {
    "allreduce_": "all_reduce", "allgather_": "all_gather", "_allgather_base_": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter", "broadcast_": "broadcast",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter", "barrier": "barrier", "allgather_into_tensor_coalesced_": "all_gather",
    "allreduce_coalesced_": "all_reduce",
}


class MeshGroups:
    """The process groups of a simulated world: per mesh dim, every rank's group, read from the
    root DeviceMesh's rank tensor (the groups the mesh really has, whatever was declared)."""

    def __init__(self, mesh: Any, world_size: int):
        self.world_size = world_size
        self.dims: list[str] = []
        self.coords: dict[int, dict[str, int]] = {}
        self.by_dim: dict[str, dict[int, list[int]]] = {}
        self.shape: list[int] = []
        self.rank_tensor: list[Any] = []
        if mesh is None:
            return
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        tensor = _plain(root.mesh)
        self.dims = list(root.mesh_dim_names or [f"dim{i}" for i in range(root.ndim)])
        self.shape = list(tensor.shape)
        self.rank_tensor = tensor.tolist()
        for index in torch.cartesian_prod(*[torch.arange(s) for s in tensor.shape]).reshape(-1, tensor.ndim).tolist():
            rank = int(tensor[tuple(index)])
            self.coords[rank] = dict(zip(self.dims, index))
        for d, dim in enumerate(self.dims):
            groups: dict[int, list[int]] = {}
            moved = tensor.movedim(d, -1).reshape(-1, tensor.shape[d])
            for row in moved.tolist():
                for r in row:
                    groups[int(r)] = [int(x) for x in row]
            self.by_dim[dim] = groups

    def dim_of(self, ranks_of_rank0: Sequence[int]) -> str | None:
        """The mesh dim whose group of rank 0 is ``ranks_of_rank0``."""
        want = sorted(ranks_of_rank0)
        for dim, groups in self.by_dim.items():
            if sorted(groups.get(0, [])) == want:
                return dim
        return None

    def group_name(self, dim: str, rank: int) -> str:
        return f"{dim}:{','.join(map(str, sorted(self.by_dim[dim][rank])))}"

    def describe(self, rank: int) -> dict[str, Any]:
        """The rank's view of the mesh, as :func:`harness.tracing.mesh.describe_mesh` writes it."""
        return {
            "dims": self.dims, "shape": self.shape, "mesh": self.rank_tensor, "coords": self.coords.get(rank, {}),
            "groups": {d: {"name": self.group_name(d, rank), "ranks": self.by_dim[d][rank]} for d in self.dims},
        }


def _plain(t: Any) -> torch.Tensor:
    from torch.distributed._local_tensor import LocalTensor

    return t._local_tensors[min(t._local_tensors)] if isinstance(t, LocalTensor) else t


def _group_ranks(group: Any) -> list[int] | None:
    from torch.distributed import distributed_c10d as c10d

    try:
        pg = c10d._resolve_process_group(group) if isinstance(group, str) else group
        return list(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - an unknown group: recorded without ranks
        return None


class CollectiveLog(TorchDispatchMode):
    """Dispatch mode: every collective the simulated program issues, with its group's ranks
    (rank 0's group), op, local shapes, dtypes and reduce op, tagged with the step and phase
    the loop says it is in."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []
        self.step: int | None = None
        self.phase = "setup"
        self.random_draws: dict[int, list[RandomDraw]] = defaultdict(list)  # rank -> the first step's draws

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", "")
        name = func._opname if hasattr(func, "_opname") else str(func)
        if namespace == "_c10d_functional" and name in _FUNCTIONAL:
            self._log(_FUNCTIONAL[name], args, functional=True)
        elif namespace == "c10d" and name in _C10D:
            self._log(_C10D[name], args, functional=False)
        out = func(*args, **kwargs)
        if self.step == 0 and self.phase == "train" and torch.Tag.nondeterministic_seeded in func.tags:
            self._log_draw(func, args, kwargs, out)
        return out

    def _log_draw(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Each rank's draw of a random op, fingerprinted as
        :class:`~harness.tracing.random_ops.RandomOpLog` does on a real rank."""
        from torch.distributed._local_tensor import LocalTensor

        drawn = random_output(func, args, kwargs, out)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if drawn is False or not isinstance(first, LocalTensor):
            return
        site = call_site(3)
        for r, value in first._local_tensors.items():
            draws = self.random_draws[r]
            if len(draws) < MAX_DRAWS:
                digest = draw_digest(drawn._local_tensors[r]) if isinstance(drawn, LocalTensor) else ""
                draws.append(RandomDraw(index=len(draws), op=str(func.overloadpacket.__name__), shape=list(value.shape),
                                        dtype=str(value.dtype).removeprefix("torch."), digest=digest, call_site=site))

    def _log(self, op: str, args: tuple, *, functional: bool) -> None:
        tensors = [a for a in _flat(args[0] if args else ()) if isinstance(a, torch.Tensor)]
        group: Any = None
        reduce_op = ""
        for a in args[1:]:
            kind = _script_class(a)
            if functional and isinstance(a, str):
                if a in _REDUCE_OPS.values():
                    reduce_op = a
                else:
                    group = a  # the group name, the last string argument
            elif kind == "ProcessGroup":
                group = dist.ProcessGroup.unbox(a)
            elif kind == "ReduceOp":
                reduce_op = _REDUCE_OPS.get(int(a.op()), str(a.op()))
        self.calls.append({
            "op": op, "ranks": _group_ranks(group) if group is not None else None,
            "shapes": [list(t.shape) for t in tensors], "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "reduce_op": reduce_op, "step": self.step, "phase": self.phase,
        })


def _script_class(value: Any) -> str:
    """The c10d class name of a TorchScript object argument (``ProcessGroup``, ``ReduceOp``)."""
    if isinstance(value, torch.ScriptObject):
        return value._type().qualified_name().rsplit(".", 1)[-1]
    return ""


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


def collective_records(
    calls: Sequence[dict[str, Any]], groups: MeshGroups, to_global: Mapping[int, int] | None = None
) -> dict[int, list[CollectiveRecord]]:
    """Each logged call as a record on every rank, in that rank's group along the call's dim,
    numbered per group. ``to_global`` maps the simulated world's ranks to the job's (a layout
    check simulates one pipeline stage's ranks at a time); default: the same ranks."""
    rank_of = dict(to_global) if to_global is not None else {r: r for r in range(groups.world_size)}
    per_rank: dict[int, list[CollectiveRecord]] = defaultdict(list)
    seq: dict[tuple[str, int], int] = defaultdict(int)
    for call in calls:
        dim = groups.dim_of(call["ranks"]) if call["ranks"] is not None else None
        for local, r in rank_of.items():
            if dim is not None:
                members, desc = [rank_of[x] for x in groups.by_dim[dim][local]], f"mesh_{dim}"
                name = f"{dim}:{','.join(map(str, sorted(members)))}"
            elif call["ranks"] is not None and local in call["ranks"]:
                members, desc = [rank_of[x] for x in call["ranks"]], "hand-built group"
                name = "pg:" + ",".join(map(str, members))
            elif call["ranks"] is None:
                members, name, desc = sorted(rank_of.values()), "world", "default group"
            else:
                continue
            seq[(name, r)] += 1
            per_rank[r].append(CollectiveRecord(
                rank=r, index=len(per_rank[r]), op=call["op"], group=name, group_desc=desc, group_ranks=sorted(members),
                seq=seq[(name, r)], shapes=call["shapes"], dtypes=call["dtypes"], reduce_op=call["reduce_op"],
                step=call["step"], phase=call["phase"], source="simulated",
            ))
    return per_rank


def build_trace(
    world_size: int,
    groups: MeshGroups,
    layouts: Mapping[int, Any],
    params: Mapping[str, dict[str, Any]],
    samples: Mapping[int, Mapping[int, list[list[int]]]],
    records: Mapping[int, list[CollectiveRecord]],
    meta: Mapping[str, Any],
    random_draws: Mapping[int, list[RandomDraw]] | None = None,
) -> RunTrace:
    """One :class:`RankTrace` per simulated rank: its declared layout, its real groups along
    each mesh dim, parameters, samples and collective ``records`` (:func:`collective_records`)."""
    ranks: dict[int, RankTrace] = {}
    for r in range(world_size):
        rank_groups = {
            groups.group_name(d, r): {"ranks": groups.by_dim[d][r], "desc": f"mesh_{d}", "dims": [d],
                                      "roles": ["grad-sync"] if is_dp_dim(d) else []}
            for d in groups.dims
        }
        ranks[r] = RankTrace(
            rank=r, world_size=world_size, backend="fake (simulated)", layout=layouts[r].to_json(),
            device_meshes=[groups.describe(r)] if groups.dims else [], groups=rank_groups, params=dict(params),
            samples={s: list(v) for s, v in samples.get(r, {}).items()}, collectives=list(records.get(r, [])),
            random_ops=list((random_draws or {}).get(r, [])),
        )
    return RunTrace(ranks=ranks, meta={**meta, "world_size": world_size, "simulated": True})
