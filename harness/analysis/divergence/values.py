"""How one rank's value stands against the reference's, by its placement, under the probe's
rule (see :mod:`harness.analysis.divergence`), and how two op logs are aligned."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from harness.analysis.probe_checks import PROBE_ATOL, PROBE_RTOL
from harness.record.probe import OpCapture

__all__ = ["Judged", "aligned", "corresponding", "difference", "group_sum", "judge", "keyed", "placement_kind",
           "peer_sum", "same_on_every_rank", "summed", "tolerance", "tp_of"]


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    widen = max(1.0, torch.finfo(dtype).eps / torch.finfo(torch.float32).eps / 4096) if dtype.is_floating_point else 1.0
    return PROBE_RTOL * widen, PROBE_ATOL * widen


def difference(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float, float]:
    """(within, max_abs, max_rel) of ``actual`` against ``expected`` under the rule above."""
    a, e = actual.double(), expected.double()
    diff = (a - e).abs()
    scale = max(float(e.abs().max()), 1e-6) if e.numel() else 1.0
    within = bool((diff <= rtol * e.abs() + atol * scale).all()) and bool(torch.isfinite(a).all() or not torch.isfinite(e).all())
    max_abs = float(diff.max()) if diff.numel() else 0.0
    return within, max_abs, max_abs / scale


def placement_kind(placements: str | None) -> tuple[str, int | None]:
    """``("whole" | "shard" | "partial" | "other", dim)`` of a capture's placements string."""
    if placements is None:
        return "plain", None
    parts = [p.strip() for p in placements.strip("()").split("),") if p.strip()]
    kinds = [p for p in parts if not p.startswith("Replicate")]
    if not kinds:
        return "whole", None
    if len(kinds) > 1:
        return "other", None
    only = kinds[0]
    if only.startswith("Shard"):
        digits = "".join(ch for ch in only.split("=")[-1] if ch.isdigit())
        return ("shard", int(digits)) if digits else ("other", None)
    if only.startswith("Partial"):
        return "partial", None
    return "other", None


def tp_of(entry: dict[str, Any]) -> tuple[int | None, list[int]]:
    group = list(entry["groups"].get("tp") or [])
    coord = entry["mesh"].get("tp")
    return (int(coord) if coord is not None else None), group


def summed(held: list[Any], shape: torch.Size, value: str = "output", reduce: str = "sum") -> torch.Tensor | None:
    """The sum (``reduce="max"``: the elementwise max) of the group's held values (captures or
    ops; their ``output``, or another attribute such as a capture's ``grad``), or None where
    the group is empty or one of them has no such value of that shape."""
    values = [getattr(h, value, None) if h is not None else None for h in held]
    if not values or any(v is None or v.shape != shape for v in values):
        return None
    stacked = torch.stack(values)
    return stacked.amax(0) if reduce == "max" else stacked.sum(0)


def group_sum(by_rank: dict[int, dict[str, Any]], group: list[int], name: str, shape: torch.Size,
               value: str = "output") -> torch.Tensor | None:
    """The sum of module ``name``'s outputs (or their ``grad``) over the ranks of ``group`` (:func:`summed`)."""
    return summed([by_rank[r]["captures"].get(name) for r in group if r in by_rank], shape, value)


@dataclass
class Judged:
    """How one held value (a module's or an op's output on one rank) stands against the
    reference's: ``within``, ``partial`` (it matches only summed over the tensor-parallel
    group: a partial sum a later op may reduce) or ``departs``."""

    status: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    compared: str = "whole"


def corresponding(local: torch.Tensor, placements: str | None, expected: torch.Tensor, coord: int | None,
                   group: list[int], group_sum: Callable[[], torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor, str, str] | None:
    """(what the rank's value stands for, the reference's piece it must equal, how they
    correspond, the placement kind) by the value's placement (module docstring); None where
    the layout does not say how they correspond."""
    kind, dim = placement_kind(placements)
    compared = "whole"
    if kind in ("plain", "partial", "whole") and local.shape != expected.shape \
            and [n for n in local.shape if n != 1] == [n for n in expected.shape if n != 1]:
        expected = expected.reshape(local.shape)  # the same values, a kept dim of size 1 apart (sum(keepdim=True))
    if kind == "shard" or (kind == "plain" and local.shape != expected.shape):
        if kind == "plain":
            differing = [d for d in range(local.dim()) if local.shape[d] != expected.shape[d]] \
                if local.dim() == expected.dim() else []
            if len(differing) != 1 or not group or coord is None:
                return None  # not a split the layout explains
            dim = differing[0]
            size, whole = local.shape[dim], expected.shape[dim]
            chunks = torch.chunk(expected, len(group), dim=dim)
            if size * len(group) < whole and not (coord < len(chunks) and chunks[coord].shape[dim] == size):
                return None  # smaller than the rank's part of any split of the group
            if size * len(group) > whole and not (coord < len(chunks) and chunks[coord].shape[dim] == size):
                # A padded split (a vocabulary padded to a multiple of the group, Megatron's
                # convention): rank r holds the reference's rows [r*size, (r+1)*size) and pad
                # rows past its end; only the real rows are compared.
                start = coord * size
                real = max(0, min(size, whole - start))
                if real == 0:
                    return None
                return (local.narrow(dim, 0, real), expected.narrow(dim, start, real),
                        f"rows {start}..{start + real - 1} along dim {dim} (a shard of {size} padded past the reference's {whole})",
                        kind)
        if coord is None or dim is None or dim >= expected.dim():
            return None
        pieces = torch.chunk(expected, len(group) if group else 1, dim=dim)
        if coord >= len(pieces) or pieces[coord].shape != local.shape:
            return None
        expected, compared = pieces[coord], f"chunk {coord} of {len(pieces)} along dim {dim}"
    elif kind == "partial":
        summed = group_sum()
        if summed is None:
            return None
        local, compared = summed, f"sum over the tensor-parallel group {group}"
    elif kind == "other" or local.shape != expected.shape:
        return None
    return local, expected, compared, kind


def judge(local: torch.Tensor, placements: str | None, expected: torch.Tensor, coord: int | None, group: list[int],
           group_sum: Callable[[], torch.Tensor | None], rtol: float, atol: float,
           group_max: Callable[[], torch.Tensor | None] | None = None) -> Judged | None:
    """Compare what a rank holds with the reference's value by its placement (module
    docstring); None where the layout does not say how they correspond (not compared).
    ``group_max`` (ops only): the elementwise max over the group - a plain value that matches
    only as that is a partial max (a local max over a vocabulary shard) an all-reduce(MAX)
    completes, like a partial sum."""
    pieces = corresponding(local, placements, expected, coord, group, group_sum)
    if pieces is None:
        return None
    local, expected, compared, kind = pieces
    within, max_abs, max_rel = difference(local, expected, rtol, atol)
    if within:
        return Judged("partial" if kind == "partial" else "within", max_abs, max_rel, compared)
    if kind == "plain" and compared == "whole" and len(group) > 1:
        tried = []
        for reduce, total in (("sum", group_sum), ("max", group_max)):
            value = total() if total is not None else None  # of the local value's shape, as ``expected`` now is
            if value is None:
                continue
            reduced_within, reduced_abs, _ = difference(value, expected, rtol, atol)
            if reduced_within:
                return Judged("partial", max_abs, max_rel, f"{reduce} over the tensor-parallel group {group}")
            tried.append(f"its {reduce} over the tensor-parallel group {group} by max abs {reduced_abs:.3g}")
        if tried:
            compared = f"whole; nor as a partial: {', '.join(tried)}"
    return Judged("departs", max_abs, max_rel, compared)


def same_on_every_rank(local: torch.Tensor, summed: torch.Tensor | None, group: list[int], rtol: float, atol: float) -> bool:
    """This rank's value equals the group's mean: with the group's sum right, each rank holds
    the same share (a whole scaled by 1/N), not a piece of a sum."""
    return summed is not None and len(group) > 1 and difference(local, summed / len(group), rtol, atol)[0]


# -- the op inside the module ---------------------------------------------------------------
def keyed(ops: list[OpCapture]) -> dict[tuple[str, str, int], OpCapture]:
    """Ops by (module, op, occurrence): the same program on every rank of a group logs the
    same keys, so a peer's value of an op is found by its key."""
    seen: dict[tuple[str, str], int] = {}
    out = {}
    for o in ops:
        n = seen.get((o.module, o.op), 0)
        seen[(o.module, o.op)] = n + 1
        out[(o.module, o.op, n)] = o
    return out


def aligned(held: list[OpCapture], ref: list[OpCapture]) -> list[tuple[OpCapture, OpCapture, str]]:
    """Pairs (held, reference, how) in the held log's order. Equal runs of op names pair one
    to one (exact). A run that differs pairs by position where both sides have as many ops
    (fuzzy), else only at its ends: one op written as several (``addmm`` as ``mm`` + ``add``)
    differs inside, but the run's last value is the same value on both sides. Collectives (no
    output) are not paired."""
    a = [o for o in held if o.output is not None]
    b = [o for o in ref if o.output is not None]
    pairs = []
    matcher = difflib.SequenceMatcher(None, [o.op for o in a], [o.op for o in b], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs += [(a[i1 + k], b[j1 + k], "exact") for k in range(i2 - i1)]
        elif tag == "replace" and i2 - i1 == j2 - j1:
            pairs += [(a[i1 + k], b[j1 + k], "by position") for k in range(i2 - i1)
                      if a[i1 + k].output.dim() == b[j1 + k].output.dim()]
        elif tag == "replace" and a[i2 - 1].output.dim() == b[j2 - 1].output.dim():
            pairs.append((a[i2 - 1], b[j2 - 1], f"at the end of a run written as {i2 - i1} ops against the reference's {j2 - j1}"))
    return pairs


def peer_sum(by_rank: dict[int, dict[str, Any]], group: list[int], log: str,
             held: list[OpCapture], reduce: str = "sum") -> Callable[[OpCapture], torch.Tensor | None]:
    """For an op of ``held`` (one rank's log ``log``: "ops", "backward_ops"), the sum (or
    ``reduce="max"``: the max) of its output over the ranks of ``group`` - each rank's op of
    the same key (:func:`keyed`); None where one of them has none of that shape."""
    peers = {r: keyed(by_rank[r].get(log) or []) for r in group if r in by_rank}
    keys = {id(o): k for k, o in keyed(held).items()}

    def total(op: OpCapture) -> torch.Tensor | None:
        return summed([peers[r].get(keys[id(op)]) for r in group if r in peers], op.output.shape, reduce=reduce)

    return total

