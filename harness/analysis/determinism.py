"""The determinism gate: two runs of one target on fresh ranks, compared bitwise.

A correct parallel run may differ from one device by rounding, but two runs of the same
program on the same layout, threads and seeds must not differ at all: a difference there is
nondeterminism (an unseeded random op, a reduction whose order depends on timing, state that
leaks from one run into the next), and it makes every other comparison harder to trust. The
runs are compared step by step, in the order a step happens, by what each rank recorded
(:class:`harness.record.recorder.RankRecorder`): its micro-batch losses (``float.hex``), its
sample ids, the digests of its own local state (a DTensor's local shard, a plain tensor whole)
for gradients, then parameters and optimizer state, the gathered full tensors' SHA-256 of the
record, and each rank's collective trace (op, group, shapes, dtypes, reduction). The first
difference is named with its step, rank and tensor; the pins (threads, deterministic switches,
seeds, world size and layout) are reported beside it, since a run that differs there repeats
differently for a reason the user can see.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from reference.record import KINDS, Record

from harness.codes import Diagnosis

__all__ = ["RepeatComparison", "RepeatDifference", "compare_repeats", "pin_report"]


@dataclass(frozen=True)
class RepeatDifference:
    """One place where two runs differ: ``what`` is "loss", "samples", "local-state",
    "gathered-state", "collectives" or "steps"; ``kind``/``name`` the tensor (local-state,
    gathered-state), ``first``/``second`` each run's value there (a digest, a loss in hex, an
    op)."""

    what: str
    step: int | None
    rank: int | None = None
    kind: str = ""
    name: str = ""
    first: Any = None
    second: Any = None

    def line(self) -> str:
        where = f"step {self.step}" if self.step is not None else "the run"
        rank = f", rank {self.rank}" if self.rank is not None else ""
        tensor = f", {self.kind} {self.name!r}" if self.name else ""
        return f"{self.what} at {where}{rank}{tensor}: {self.first!r} then {self.second!r}"


@dataclass
class RepeatComparison:
    """What :func:`compare_repeats` found: every difference in step order (the first is the
    one to look at: later ones may follow from it) and what was compared."""

    steps: int
    ranks: int
    compared: dict[str, int] = field(default_factory=dict)  # what -> entries compared
    differences: list[RepeatDifference] = field(default_factory=list)
    pins: dict[str, Any] = field(default_factory=dict)
    pins_differ: list[str] = field(default_factory=list)  # pins the two runs did not share
    # How far apart the runs are at the first difference of a value (max abs, ULPs), where both
    # records hold it: a hash says that they differ, this says by how much.
    magnitude: dict[str, Any] = field(default_factory=dict)

    def differ(self) -> dict[str, int]:
        """Differences per category (the same keys as ``compared``)."""
        out = dict.fromkeys(self.compared, 0)
        for d in self.differences:
            out[d.what] = out.get(d.what, 0) + 1
        return out

    def reading(self) -> str:
        """What the categories that differ say about where the nondeterminism is."""
        differ = self.differ()
        if not self.differences:
            return ""
        if differ.get("samples"):
            return "the runs read other samples: the data order is not seeded (a sampler, a shuffle, a worker's generator)"
        if differ.get("collectives"):
            return ("the ranks communicated otherwise (another op, group or order): an order that depends on timing or on "
                    "which rank arrives first")
        if differ.get("loss") and not differ.get("local-state"):
            return "the losses differ while every rank's state is the same: a loss computed from something the runs do not share"
        return ("samples and collectives identical, so the difference is local to a rank: a reduction or accumulation "
                "order that depends on timing (atomics, threads, arrival order), or an unseeded random op")

    @property
    def identical(self) -> bool:
        return not self.differences

    @property
    def first(self) -> RepeatDifference | None:
        return self.differences[0] if self.differences else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "identical": self.identical, "steps": self.steps, "ranks": self.ranks, "compared": self.compared,
            "first_difference": asdict(self.first) if self.first else None,
            "differences": len(self.differences), "pins": self.pins, "pins_differ": self.pins_differ,
            "differ": self.differ(), "magnitude": self.magnitude, "reading": self.reading(),
        }

    def diagnosis(self, runs: int = 2) -> Diagnosis | None:
        """``nondeterministic-run`` with the first difference and the pins, or None."""
        first = self.first
        if first is None:
            return None
        where = f"step {first.step}" if first.step is not None else "the run"
        rank = f" on rank {first.rank}" if first.rank is not None else ""
        tensor = f", {first.kind} {first.name!r}" if first.name else ""
        summary = (f"{runs} runs on fresh ranks differ bitwise first at {where}{rank} ({first.what}{tensor}); "
                   f"{len(self.differences)} differences in all")
        if self.magnitude.get("max_abs") is not None:
            summary += f"; there by max abs {self.magnitude['max_abs']:.3g} ({self.magnitude['ulps']} ULPs)"
        return Diagnosis("nondeterministic-run", summary, {
            "likely_source": self.reading(),
            "first_difference": asdict(first),
            "magnitude": self.magnitude,
            "differ": self.differ(),
            "differences": [d.line() for d in self.differences[:8]],
            "compared": self.compared,
            "pins": self.pins,
            **({"pins_differ": self.pins_differ} if self.pins_differ else {}),
        })


def pin_report(record: Record) -> dict[str, Any]:
    """What a run was pinned to: the case's seed and world size, each rank's layout, and the
    threads and deterministic switches its ranks ran with (the same on every rank: one entry;
    else per rank)."""
    ranks = record.meta.get("ranks") or []
    pins = [r.get("pins", {}) for r in ranks]
    case = record.meta.get("case") or {}
    report: dict[str, Any] = {
        "seed": case.get("seed"),
        "world_size": record.meta.get("world_size"),
        "layout": {r.get("rank"): {k: v for k, v in r.items() if k in ("mesh", "dp_rank", "stage")} for r in ranks},
    }
    if pins and all(p == pins[0] for p in pins):
        report.update(pins[0])
    else:
        report["per_rank"] = {r.get("rank"): r.get("pins", {}) for r in ranks}
    return report


def _trace_ops(trace: Any) -> dict[int, list[tuple[Any, ...]]]:
    """Per rank, (step, op) in issue order; the op is what the program asked for (name, group,
    shapes, dtypes, reduction, peer). The step only says where: which step an op is filed
    under can depend on when Flight Recorder's entry is matched, so it is not compared."""
    if trace is None:
        return {}
    return {
        rank: [(c.step, (c.op, c.group_desc or c.group, tuple(c.group_ranks or ()), str(c.shapes), str(c.dtypes), c.reduce_op, c.peer))
               for c in t.events(include_harness=True)]
        for rank, t in trace.ranks.items()
    }


def compare_repeats(first: Record, second: Record, first_trace: Any = None, second_trace: Any = None) -> RepeatComparison:
    """Compare two records (and traces) of one target, run twice on fresh ranks, bitwise."""
    out = RepeatComparison(steps=min(first.num_steps, second.num_steps), ranks=int(first.meta.get("world_size") or 1))
    out.pins = pin_report(first)
    other = pin_report(second)
    out.pins_differ = sorted(k for k in set(out.pins) | set(other) if out.pins.get(k) != other.get(k))
    counts = dict.fromkeys(("loss", "samples", "local-state", "gathered-state", "collectives"), 0)
    if first.num_steps != second.num_steps:
        out.differences.append(RepeatDifference("steps", None, first=first.num_steps, second=second.num_steps))
    for step in range(out.steps):
        a, b = first.step(step), second.step(step)
        digests_a, digests_b = a.extra.get("rank_digests", {}), b.extra.get("rank_digests", {})
        for rank in sorted(set(digests_a) | set(digests_b), key=int):
            da, db = digests_a.get(rank, {}), digests_b.get(rank, {})
            counts["loss"] += 1
            if da.get("loss") != db.get("loss"):
                out.differences.append(RepeatDifference("loss", step, int(rank), first=da.get("loss"), second=db.get("loss")))
            ids_a, ids_b = a.rank_sample_ids.get(int(rank)), b.rank_sample_ids.get(int(rank))
            counts["samples"] += 1
            if ids_a != ids_b:
                out.differences.append(RepeatDifference("samples", step, int(rank), first=ids_a, second=ids_b))
            for kind in KINDS:  # the order a step happens in: gradients, then the update
                ka, kb = da.get(kind, {}), db.get(kind, {})
                for name in list(ka) + [n for n in kb if n not in ka]:
                    counts["local-state"] += 1
                    if ka.get(name) != kb.get(name):
                        out.differences.append(
                            RepeatDifference("local-state", step, int(rank), kind, name, ka.get(name), kb.get(name)))
        if a.loss != b.loss and not digests_a:  # records without per-rank digests: the step's loss
            out.differences.append(RepeatDifference("loss", step, first=a.loss, second=b.loss))
        for kind in KINDS:
            ta, tb = a.tensors.get(kind, {}), b.tensors.get(kind, {})
            for name in list(ta) + [n for n in tb if n not in ta]:
                counts["gathered-state"] += 1
                ha = ta[name].sha256 if name in ta else None
                hb = tb[name].sha256 if name in tb else None
                if ha != hb:
                    out.differences.append(RepeatDifference("gathered-state", step, None, kind, name, ha, hb))
    ops_a, ops_b = _trace_ops(first_trace), _trace_ops(second_trace)
    for rank in sorted(set(ops_a) | set(ops_b)):
        la, lb = ops_a.get(rank, []), ops_b.get(rank, [])
        counts["collectives"] += max(len(la), len(lb))
        for i in range(max(len(la), len(lb))):
            oa = la[i] if i < len(la) else None
            ob = lb[i] if i < len(lb) else None
            if (oa and oa[1]) != (ob and ob[1]):
                step = (oa or ob)[0]
                out.differences.append(RepeatDifference("collectives", step, rank, name=f"op #{i}",
                                                        first=oa[1] if oa else None, second=ob[1] if ob else None))
                break  # the rest of the rank's order follows from the first change
    out.compared = counts
    out.differences.sort(key=_order)
    value = next((d for d in out.differences if d.what in ("loss", "local-state", "gathered-state")), None)
    if value is not None:
        out.magnitude = _magnitude(first, second, value)
    return out


def _magnitude(first: Record, second: Record, d: RepeatDifference) -> dict[str, Any]:
    """Max abs and ULP difference between the runs at ``d``: the loss's two values, or the
    tensor both records gathered at that step (a rank's local piece is the whole's part)."""
    import torch

    try:
        if d.what == "loss" and d.first is not None and d.second is not None:
            # A rank's micro-batch losses as float.hex (one, or a list of them).
            first_hex = d.first if isinstance(d.first, list) else [d.first]
            second_hex = d.second if isinstance(d.second, list) else [d.second]
            pairs = [(x, y) for x, y in zip(first_hex, second_hex) if isinstance(x, str) and isinstance(y, str)]
            if not pairs:
                return {}
            a = torch.tensor([float.fromhex(x) for x, _ in pairs], dtype=torch.float32)
            b = torch.tensor([float.fromhex(y) for _, y in pairs], dtype=torch.float32)
            where = "the rank's loss"
        elif d.kind and d.name and d.step is not None:
            a, b = first.tensor(d.step, d.kind, d.name), second.tensor(d.step, d.kind, d.name)
            where = f"{d.kind} {d.name!r} gathered"
        else:
            return {}
    except Exception:  # noqa: BLE001 - a value one record does not hold: the hashes stand alone
        return {}
    if a.shape != b.shape or not a.is_floating_point():
        return {}
    return {"of": where, "step": d.step, "max_abs": float((a.double() - b.double()).abs().max()) if a.numel() else 0.0,
            "ulps": _max_ulps(a, b), "dtype": str(a.dtype).removeprefix("torch.")}


def _max_ulps(a: Any, b: Any) -> int:
    """The largest number of representable values between two tensors' elements (their own dtype)."""
    import torch

    ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    kind = ints.get(a.dtype)
    if kind is None or a.numel() == 0:
        return 0

    def ordered(t: Any) -> Any:  # the float's bits as an integer that orders like the float
        i = t.contiguous().view(kind).to(torch.int64)
        return torch.where(i < 0, torch.iinfo(kind).min - i, i)

    return int((ordered(a) - ordered(b)).abs().max())


# Within a step, the order things happen in: the batch, its loss, gradients (and their
# collectives), the update; a rank's own piece before the gathered whole.
_PHASE = {("samples", ""): 0, ("loss", ""): 1, ("local-state", "grad"): 2, ("collectives", ""): 3,
          ("gathered-state", "grad"): 4, ("local-state", "param"): 5, ("gathered-state", "param"): 6,
          ("local-state", "optim"): 7, ("gathered-state", "optim"): 8}


def _order(d: RepeatDifference) -> tuple[int, int, int]:
    step = d.step if d.step is not None else -1
    return (step, _PHASE.get((d.what, d.kind), 9), d.rank if d.rank is not None else -1)
