"""Random-op fingerprints: what each rank's random number generator produced, op by op.

Dropout, ``torch.rand`` and friends are ATen ops tagged ``nondeterministic_seeded``; a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every one of them however it was
called - ``nn.Dropout``, ``F.dropout`` inside a ``forward``, ``torch.rand`` in a loop - so no
module type has to be known. :class:`RandomOpLog` keeps, for the first training step, each such
op's name, output shape and dtype, a digest of its values and the Python call site.

The ranks of one tensor-parallel group feed the same batch through the same model and, to match
the single-device reference, must draw the same random numbers in the same order
(:func:`check_random_ops`): a rank that draws an extra number shifts its stream (the draw
sequences differ), and a rank seeded differently draws other values at the same position. Both
are ``rng-desync``, named with the op, the ranks and the call site. The check only speaks for a
run whose comparison already failed: draws that differ without changing the result are no bug.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.codes import Diagnosis
from harness.frames import call_site
from reference.draws import random_output

__all__ = ["RandomDraw", "RandomOpLog", "check_random_ops", "draw_digest"]

MAX_DRAWS = 4096  # per rank: the first step of a small correctness case needs far fewer


@dataclass
class RandomDraw:
    """One random op of one rank, in issue order."""

    index: int
    op: str
    shape: list[int]
    dtype: str
    digest: str
    call_site: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RandomDraw:
        return cls(int(data["index"]), str(data["op"]), list(data["shape"]), str(data["dtype"]), str(data["digest"]),
                   str(data.get("call_site", "")))

    def describe(self) -> str:
        return f"{self.op} {self.shape} {self.dtype}"


def draw_digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous().reshape(-1)
    if data.dtype == torch.bool:
        data = data.to(torch.uint8)
    return hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class RandomOpLog(TorchDispatchMode):
    """A dispatch mode that fingerprints every random op run under it (``with RandomOpLog() as
    log: ...``; then ``log.draws``)."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[RandomDraw] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags and len(self.draws) < MAX_DRAWS:
            drawn = random_output(func, args, kwargs, out)
            first = out[0] if isinstance(out, (tuple, list)) else out
            if drawn is not False and isinstance(first, torch.Tensor) and type(first) is torch.Tensor:  # plain tensors only
                self.draws.append(RandomDraw(
                    index=len(self.draws), op=str(func.overloadpacket.__name__), shape=list(first.shape),
                    dtype=str(first.dtype).removeprefix("torch."), digest=draw_digest(drawn) if drawn is not None else "",
                    call_site=call_site(2),
                ))
        return out


def _tp_groups(layouts: Iterable[Mapping[str, Any]]) -> list[list[int]]:
    groups: list[list[int]] = []
    for layout in layouts:
        ranks = sorted(int(r) for r in (layout.get("groups") or {}).get("tp", []) or [])
        if len(ranks) > 1 and ranks not in groups:
            groups.append(ranks)
    return groups


def check_random_ops(draws: Mapping[int, Sequence[RandomDraw]], layouts: Iterable[Mapping[str, Any]]) -> list[Diagnosis]:
    """``rng-desync`` for each tensor-parallel group whose ranks drew different random numbers
    in their first step (see the module docstring)."""
    out: list[Diagnosis] = []
    for group in _tp_groups(layouts):
        members = [r for r in group if r in draws]
        if len(members) < 2:
            continue
        first, others = members[0], members[1:]
        for other in others:
            a, b = list(draws[first]), list(draws[other])
            for i in range(max(len(a), len(b))):
                da, db = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
                if da is not None and db is not None and (da.op, da.shape, da.dtype, da.digest) == (db.op, db.shape, db.dtype, db.digest):
                    continue
                out.append(_desync(group, first, other, da, db, i))
                break
            if out:
                break
    return out


def _desync(group: list[int], ra: int, rb: int, da: RandomDraw | None, db: RandomDraw | None, i: int) -> Diagnosis:
    def said(rank: int, d: RandomDraw | None) -> str:
        return f"rank {rank} drew {d.describe()} at {hooks_short(d.call_site)}" if d is not None else f"rank {rank} drew nothing more"

    if da is not None and db is not None and (da.op, da.shape, da.dtype) == (db.op, db.shape, db.dtype):
        summary = (f"random op #{i} of the first step drew different values on tensor-parallel ranks {group}: "
                   f"{said(ra, da)}, {said(rb, db)} - the ranks' generators are in different states")
        likely = "the ranks of a tensor-parallel group seed or advance their RNG differently (e.g. seeding with the rank)"
    else:
        summary = (f"the random draws of tensor-parallel ranks {group} go out of step at draw #{i} of the first step: "
                   f"{said(ra, da)}; {said(rb, db)}")
        likely = "one rank draws random numbers the others do not (an extra torch.rand / dropout on some ranks), shifting its stream"
    return Diagnosis(
        "rng-desync",
        summary,
        {"ranks": group, "draw": i, "per_rank": {str(ra): da.to_json() if da else None, str(rb): db.to_json() if db else None},
         "likely_source": likely},
    )


def hooks_short(site: str) -> str:
    from harness.tracing.fr import short_site

    return short_site(site) or site or "an unknown call site"
