"""Mesh coordinates and process groups: what each rank records, and the checks.

Recorded per rank (by :class:`~harness.tracing.tracer.Tracer`): the declared coordinate and
groups of the strategy's layout; every DeviceMesh its parameters (DTensor, FSDP2) or the
strategy's state hold, with each dim's process group; DDP's process group; every process
group c10d knows, with its ranks; and each parameter's local and global shape.

:func:`check_mesh` then asks, with the mesh known:

- do the groups of each mesh dim partition the world as the mesh says? The mesh is the
  ranks' declared coordinates; along dim ``d`` a rank's group is the ranks that differ from it
  only in ``d``. Declared groups and the real process groups labelled with a dim (DeviceMesh
  groups, hand-built groups labelled with ``Tracer.label_group``) must be exactly those;
- do the collectives that synchronize data-parallel gradients (DDP's group, the dp dims of a
  mesh, groups labelled ``grad-sync``) run among ranks that hold the same shard (same
  coordinate on every other dim, same local parameter shapes)?

A group built along the wrong dimension is ``swapped-mesh-dims`` with the expected and the
actual group ranks (and, when the actual groups are exactly another dim's, which one).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from harness.codes import Diagnosis

__all__ = ["check_mesh", "describe_mesh", "describe_model", "expected_groups", "is_device_mesh"]


def is_device_mesh(value: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return False
    return isinstance(value, DeviceMesh)


def describe_mesh(mesh: Any) -> dict[str, Any]:
    """A DeviceMesh as JSON: dims, shape, the rank layout, this rank's coordinate and the
    process group of each dim."""
    import torch.distributed as dist

    dims = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)])
    coordinate = mesh.get_coordinate()
    groups = {}
    for i, dim in enumerate(dims):
        try:
            pg = mesh.get_group(i)
            groups[dim] = {"name": pg.group_name, "ranks": dist.get_process_group_ranks(pg)}
        except Exception:  # noqa: BLE001 - a rank outside the mesh
            continue
    return {
        "dims": dims,
        "shape": list(mesh.mesh.shape),
        "mesh": mesh.mesh.tolist(),
        "coords": {d: int(c) for d, c in zip(dims, coordinate)} if coordinate is not None else {},
        "groups": groups,
    }


def describe_model(model: Any) -> tuple[dict[str, dict[str, Any]], list[Any], list[Any]]:
    """(params, device meshes, DDP process groups) of a model or list of model chunks.

    ``params`` maps each reference name to its local shape (the rank's shard), global shape,
    dtype, DTensor placements and mesh dims."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from harness.record.gather import reference_named_parameters

    modules = [model] if isinstance(model, nn.Module) else [m for m in model if isinstance(m, nn.Module)]
    params: dict[str, dict[str, Any]] = {}
    meshes: list[Any] = []
    ddp_groups: list[Any] = []
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, DistributedDataParallel) and getattr(sub, "process_group", None) is not None:
                ddp_groups.append(sub.process_group)
        for name, p in reference_named_parameters(module):
            entry: dict[str, Any] = {"shape": list(p.shape), "local_shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and hasattr(p, "to_local"):
                entry["local_shape"] = list(p.to_local().shape)
                entry["placements"] = [repr(pl) for pl in p.placements]
                entry["mesh_dims"] = list(mesh.mesh_dim_names or [])
                if not any(m is mesh for m in meshes):
                    meshes.append(mesh)
            params[name] = entry
    return params, meshes, ddp_groups


def expected_groups(coords: Mapping[int, Mapping[str, int]], dim: str) -> dict[int, list[int]]:
    """rank -> the ranks of its group along ``dim``: those whose coordinate differs only there."""
    out: dict[int, list[int]] = {}
    for rank, mine in coords.items():
        out[rank] = sorted(
            r for r, theirs in coords.items() if all(theirs.get(d) == v for d, v in mine.items() if d != dim)
        )
    return out


def _partition(groups: Mapping[int, Sequence[int]]) -> list[list[int]]:
    seen: list[list[int]] = []
    for g in groups.values():
        g = sorted(g)
        if g not in seen:
            seen.append(g)
    return sorted(seen)


def _dim_alias(dim: str, dims: Sequence[str]) -> str | None:
    """The declared dim a group label names, if any. Only exact names: a "dp_shard" group of
    an HSDP mesh is a sub-group of the declared "dp" replicas, not its groups (the gradient-sync
    check still covers it)."""
    return dim if dim in dims else None


def check_mesh(trace: Any) -> list[Diagnosis]:
    """``swapped-mesh-dims`` for every mesh dim whose groups (declared or real) are not the
    mesh's, and for gradient-sync groups whose ranks hold different shards."""
    ranks = trace.ranks
    coords = {r: rt.coords for r, rt in ranks.items() if rt.coords}
    if len(coords) < 2 or len(coords) != len(ranks):
        return []
    dims = list(next(iter(ranks.values())).coords)
    findings: list[Diagnosis] = []
    expected = {d: expected_groups(coords, d) for d in dims}

    # 1. the coordinates themselves: distinct, and a full grid.
    if len({tuple(sorted(c.items())) for c in coords.values()}) != len(coords):
        clash = defaultdict(list)
        for r, c in coords.items():
            clash[tuple(sorted(c.items()))].append(r)
        dup = {str(dict(k)): v for k, v in clash.items() if len(v) > 1}
        findings.append(Diagnosis(
            "swapped-mesh-dims",
            f"ranks share a mesh coordinate: {dup}; every rank must have its own place in the mesh",
            {"kind": "duplicate-coordinates", "coordinates": {str(r): c for r, c in coords.items()}, "clashes": dup},
        ))
        return findings

    # 2. per dim: declared groups, then real process groups labelled with the dim.
    actual: dict[str, dict[int, tuple[list[int], str]]] = defaultdict(dict)  # dim -> rank -> (ranks, source)
    for r, rt in ranks.items():
        for name, ranks_ in (rt.layout.get("groups") or {}).items():
            d = _dim_alias(name, dims)
            if d is not None:
                actual[d].setdefault(r, (sorted(ranks_), f"declared group {name!r}"))
        for name, info in rt.groups.items():
            if r not in (info.get("ranks") or []):
                continue
            for label in info.get("dims", []) or []:
                d = _dim_alias(label, dims)
                if d is not None:
                    desc = info.get("desc") or f"pg {name}"
                    actual[f"{d}\0groups"][r] = (sorted(info["ranks"]), f"the process groups of mesh dim {label!r} ({desc})")
    reported: set[str] = set()
    by_dim: dict[str, list[tuple[str, dict[int, tuple[list[int], str]]]]] = defaultdict(list)
    for key, per_rank in actual.items():
        by_dim[key.split("\0", 1)[0]].append((key, per_rank))
    for dim in dims:
        for key, per_rank in by_dim.get(dim, []):
            wrong = {r: g for r, (g, _) in per_rank.items() if g != expected[dim][r]}
            if not wrong or dim in reported:
                continue
            reported.add(dim)
            source = next(iter(per_rank.values()))[1]
            got = _partition({r: g for r, (g, _) in per_rank.items()})
            want = _partition(expected[dim])
            other = [d for d in dims if d != dim and _partition(expected[d]) == got]
            first = min(wrong)
            if other:
                summary = (
                    f"the {dim!r} groups were built along mesh dim {other[0]!r}: {source} gives rank {first} "
                    f"the group {wrong[first]}, the mesh {_fmt(coords, dims)} expects {expected[dim][first]}"
                )
            else:
                summary = (
                    f"the {dim!r} groups do not match the mesh {_fmt(coords, dims)}: {source} gives rank {first} "
                    f"the group {wrong[first]}, expected {expected[dim][first]}"
                )
            findings.append(Diagnosis(
                "swapped-mesh-dims",
                summary,
                {
                    "kind": "swapped" if other else "wrong-groups",
                    "dim": dim,
                    "built_along": other[0] if other else None,
                    "source": source,
                    "expected_groups": want,
                    "actual_groups": got,
                    "per_rank": {str(r): {"expected": expected[dim][r], "actual": g} for r, g in sorted(wrong.items())},
                    "mesh_dims": dims,
                    "coordinates": {str(r): c for r, c in sorted(coords.items())},
                },
            ))

    findings = _merge_enumeration_order(_merge_swaps(findings), ranks, coords, dims)
    flagged = {
        tuple(g)
        for f in findings
        for groups in [f.evidence.get("actual_groups", []), *f.evidence.get("actual", {}).values()]
        for g in groups
    }

    # 3. gradient-sync groups: their ranks must hold the same shard.
    dp_dims = [d for d in dims if _is_dp(d)]
    non_dp = [d for d in dims if d not in dp_dims]
    bad: dict[tuple[int, ...], dict[str, Any]] = {}
    for r, rt in sorted(ranks.items()):
        for name, info in rt.groups.items():
            if "grad-sync" not in (info.get("roles") or []):
                continue
            members = tuple(sorted(m for m in info.get("ranks") or [] if m in coords))
            if len(members) < 2 or members in flagged or members in bad or r != members[0]:
                continue
            differing = sorted({d for d in non_dp for m in members if coords[m].get(d) != coords[r].get(d)})
            # Parameters sharded along a data-parallel dim (FSDP) may differ in local shape.
            shapes = {m: {k: v.get("local_shape") for k, v in ranks[m].params.items() if not _sharded_on_dp(v)} for m in members}
            shape_diff = sorted({k for m in members for k in shapes[m] if shapes[m].get(k) != shapes[members[0]].get(k)})
            if differing or shape_diff:
                bad[members] = {"group": name, "desc": info.get("desc") or f"pg {name}", "differing": differing, "params": shape_diff}
    if bad:
        groups = sorted(bad)
        first = bad[groups[0]]
        differing = sorted({d for b in bad.values() for d in b["differing"]})
        params = sorted({p for b in bad.values() for p in b["params"]})
        want = _partition(expected[dp_dims[0]]) if dp_dims else []
        findings.append(Diagnosis(
            "swapped-mesh-dims",
            f"gradients are synchronized over {first['desc']} groups {[list(g) for g in groups]}, whose ranks hold "
            f"different shards (they differ in mesh dim {', '.join(differing) or '-'}"
            + (f"; local shapes of {params[:3]} differ" if params else "")
            + f"); the data-parallel groups of mesh {_fmt(coords, dims)} are {want}",
            {
                "kind": "grad-sync-across-shards",
                "groups": {",".join(map(str, g)): b["group"] for g, b in sorted(bad.items())},
                "group_desc": first["desc"],
                "actual_groups": [list(g) for g in groups],
                "expected_groups": want,
                "differing_dims": differing,
                "differing_params": params[:20],
                "mesh_dims": dims,
                "coordinates": {str(m): coords[m] for m in sorted(coords)},
            },
        ))
    return findings


def _merge_swaps(findings: list[Diagnosis]) -> list[Diagnosis]:
    """Two dims built along each other are one finding: the dims were swapped."""
    by_dim = {f.evidence.get("dim"): f for f in findings if f.evidence.get("kind") == "swapped"}
    out: list[Diagnosis] = []
    done: set[str] = set()
    for f in findings:
        dim, other = f.evidence.get("dim"), f.evidence.get("built_along")
        if dim in done:
            continue
        partner = by_dim.get(other) if f.evidence.get("kind") == "swapped" else None
        if partner is None or partner.evidence.get("built_along") != dim:
            out.append(f)
            continue
        done.update({dim, other})
        ev = f.evidence
        out.append(Diagnosis(
            "swapped-mesh-dims",
            f"mesh dims {dim!r} and {other!r} are swapped: the {dim!r} groups are {ev['actual_groups']} "
            f"(expected {ev['expected_groups']}) and the {other!r} groups are {partner.evidence['actual_groups']} "
            f"(expected {partner.evidence['expected_groups']}); source: {ev['source']}",
            {
                "kind": "swapped",
                "dims": [dim, other],
                "dim": dim,
                "built_along": other,
                "source": ev["source"],
                "expected_groups": ev["expected_groups"],
                "actual_groups": ev["actual_groups"],
                "expected": {dim: ev["expected_groups"], other: partner.evidence["expected_groups"]},
                "actual": {dim: ev["actual_groups"], other: partner.evidence["actual_groups"]},
                "per_rank": ev["per_rank"],
                "mesh_dims": ev["mesh_dims"],
                "coordinates": ev["coordinates"],
            },
        ))
    return out


def _merge_enumeration_order(
    findings: list[Diagnosis], ranks: Mapping[int, Any], coords: Mapping[int, Mapping[str, int]], dims: Sequence[str]
) -> list[Diagnosis]:
    """Wrong groups on several dims whose DeviceMesh numbers the ranks row-major over the
    same dims in another order (the rank tensor built as ``(pp, tp, dp)`` and named
    ``(pp, dp, tp)``) are one finding: the order the mesh enumerates its dims in."""
    import itertools

    wrong = [f for f in findings if f.evidence.get("kind") in ("wrong-groups", "swapped") and f.evidence.get("dim")]
    if len(wrong) < 2:
        return findings
    actual = {r: (rt.device_meshes[0].get("coords") if rt.device_meshes else None) for r, rt in ranks.items()}
    if any(not c or set(c) != set(dims) for c in actual.values()):
        return findings
    sizes = {d: max(c[d] for c in coords.values()) + 1 for d in dims}

    def row_major(order: Sequence[str], rank: int) -> dict[str, int]:
        out, rest = {}, rank
        for d in reversed(order):
            out[d], rest = rest % sizes[d], rest // sizes[d]
        return out

    for order in itertools.permutations(dims):
        if list(order) == list(dims):
            continue
        if all({d: int(actual[r][d]) for d in dims} == row_major(order, r) for r in ranks):
            moved = [d for d, o in zip(dims, order) if d != o]
            merged = Diagnosis(
                "swapped-mesh-dims",
                f"the DeviceMesh numbers its ranks with dims in the order {tuple(order)} but names them {tuple(dims)}: "
                f"mesh dims {' and '.join(repr(d) for d in moved)} are swapped, so the "
                f"{' and '.join(repr(f.evidence['dim']) for f in wrong)} groups are all wrong (rank 1 sits at "
                f"{dict(actual[1])}, the job declares {dict(coords[1])})",
                {
                    "kind": "enumeration-order",
                    "dims": moved,
                    "declared_order": list(dims),
                    "mesh_order": list(order),
                    "expected": {f.evidence["dim"]: f.evidence["expected_groups"] for f in wrong},
                    "actual": {f.evidence["dim"]: f.evidence["actual_groups"] for f in wrong},
                    "actual_groups": [g for f in wrong for g in f.evidence["actual_groups"]],
                    "mesh_dims": list(dims),
                    "sizes": sizes,
                },
            )
            return [merged, *(f for f in findings if f not in wrong)]
    return findings


def _sharded_on_dp(param: Mapping[str, Any]) -> bool:
    return any(
        _is_dp(dim) and str(pl).startswith(("Shard", "_StridedShard", "S("))
        for dim, pl in zip(param.get("mesh_dims") or [], param.get("placements") or [])
    )


def _is_dp(dim: str) -> bool:
    from harness.parallel_dims import is_dp_dim

    return is_dp_dim(dim)


def _fmt(coords: Mapping[int, Mapping[str, int]], dims: Sequence[str]) -> str:
    sizes = [max(c.get(d, 0) for c in coords.values()) + 1 for d in dims]
    return "(" + ", ".join(f"{d}={s}" for d, s in zip(dims, sizes)) + ")"
