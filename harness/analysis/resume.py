"""The resume check: a checkpoint's load gate, then the continuation, each difference named.

A run saved a checkpoint after step ``at - 1`` and went on to the end (the *saved* record); fresh
ranks, of the same layout or another, loaded it and trained steps ``at`` .. end (the *resumed*
record, whose step ``at - 1`` holds the state right after the load, gathered to full shape by
the resumed layout; see :meth:`harness.record.recorder.RankRecorder.resumed`).

**The load gate is bitwise**: a correct save and load changes no bit, on any layout (DCP
reshards by copying elements, it computes nothing). It compares, at step ``at - 1``, every
parameter and optimizer tensor (the ``step`` counters included) and the optimizer's
hyperparameters with the saved record, and each rank's RNG and lr scheduler state with what
that rank saved (``ranks/rank<N>.pt``), then the first resumed batch's sample ids with those of
the steps before. Three of five planted resume bugs leave the first resumed loss bitwise equal
(issue 22): only a check of the loaded state sees them, before any loss moves.

**The continuation** is then compared with the uninterrupted run: bitwise on the same layout
(the same program from the same bits), and on another layout by the stepwise comparison with
the reference (a layout changes the reduction order, so the bits may differ within one step's
rounding noise; that tolerance is the harness's usual one).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from reference.record import Record, split_optim_state_name

from harness.codes import Diagnosis

__all__ = ["GateDifference", "ResumeCheck", "check_resume", "chunk_duplication", "chunk_permutation"]

# What each gate code says, in the order a summary lists them.
_GATE_CODES = (
    "resume-state-missing", "resume-step-reset", "resume-scheduler-not-restored", "resume-rng-not-restored",
    "resume-data-position-lost", "resume-chunks-permuted", "resume-value-differs",
)


@dataclass
class GateDifference:
    """One difference between what was saved and what was loaded."""

    code: str
    what: str  # param | optim | param_groups | lr_scheduler | rng | samples
    name: str = ""
    rank: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        if "sentence" in self.detail:
            return str(self.detail["sentence"])
        rank = f" on rank {self.rank}" if self.rank is not None else ""
        name = f" {self.name!r}" if self.name else ""
        extra = ", ".join(f"{k} {v}" for k, v in self.detail.items() if not isinstance(v, (list, dict)) or len(str(v)) < 80)
        return f"{self.what}{name}{rank}: {extra}" if extra else f"{self.what}{name}{rank}"


@dataclass
class ResumeCheck:
    """The outcome of :func:`check_resume` (``to_dict`` is the report's ``resume`` section)."""

    at: int
    saved: str
    resumed: str
    same_layout: bool
    saved_world: int
    world: int
    gate: list[GateDifference] = field(default_factory=list)
    compared: dict[str, int] = field(default_factory=dict)  # what the gate compared, by kind
    not_transferable: list[dict[str, Any]] = field(default_factory=list)
    continuation: dict[str, Any] = field(default_factory=dict)
    into: str = ""  # the resumed run's target, for the sentences
    notes: list[str] = field(default_factory=list)  # differences that cannot change the run, said, not named

    @property
    def load_exact(self) -> bool:
        return not self.gate

    @property
    def passed(self) -> bool:
        return self.load_exact and not self.continuation.get("first_difference")

    def diagnoses(self) -> list[Diagnosis]:
        """One diagnosis per gate code found (its differences as evidence); with an exact load,
        ``resume-continuation-departs`` when the continuation left the uninterrupted run."""
        found: list[Diagnosis] = []
        for code in _GATE_CODES:
            mine = [d for d in self.gate if d.code == code]
            if not mine:
                continue
            first = mine[0]
            summary, line = _summaries[code](mine), first.line()
            found.append(Diagnosis(code, f"after loading the checkpoint of step {self.at - 1} ({self._layouts()}): "
                                         + (summary if line == summary else f"{summary}; first: {line}"), {
                "at": self.at, "first": asdict(first), "differences": [d.line() for d in mine[:12]], "count": len(mine),
                "saved_record": self.saved, "resumed_record": self.resumed,
            }))
        first_cont = self.continuation.get("first_difference")
        if not found and first_cont:
            how = self.continuation.get("compared", "")
            found.append(Diagnosis("resume-continuation-departs", (
                f"the load at step {self.at} was exact ({self._layouts()}), but the resumed run departs from the "
                f"uninterrupted one at step {first_cont['step']} ({first_cont['what']}; compared {how})"),
                {"at": self.at, "continuation": self.continuation, "saved_record": self.saved, "resumed_record": self.resumed}))
        return found

    def _layouts(self) -> str:
        same = "the same layout" if self.same_layout else "another layout"
        into = f" into {self.into}" if self.into else ""
        return f"saved on {self.saved_world} ranks, loaded{into} on {self.world}, {same}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at, "saved_record": self.saved, "resumed_record": self.resumed, "same_layout": self.same_layout,
            "saved_world": self.saved_world, "world": self.world, "into": {"target": self.into, "nproc": self.world},
            "load_exact": self.load_exact,
            "gate": [asdict(d) | {"line": d.line()} for d in self.gate], "compared": self.compared,
            "not_transferable": self.not_transferable, "continuation": self.continuation, "passed": self.passed,
            "notes": self.notes,
        }

    def lines(self) -> list[str]:
        """The terminal's account, a few lines."""
        out = [f"resume at step {self.at} ({self._layouts()}): load gate "
               + ("exact" if self.load_exact else f"{len(self.gate)} difference{'s' if len(self.gate) > 1 else ''}")
               + " (" + ", ".join(f"{n} {k}" for k, n in self.compared.items()) + ")"]
        out += [f"  {d.code}: {d.line()}" for d in self.gate[:6]]
        out += [f"  not transferable to {n['world']} ranks: {n['state']} ({n['why']})" for n in self.not_transferable]
        out += [f"  note: {n}" for n in self.notes]
        cont = self.continuation
        if cont.get("first_difference"):
            f = cont["first_difference"]
            out.append(f"  continuation ({cont.get('compared')}): departs at step {f['step']}: {f['what']}")
        elif cont:
            out.append(f"  continuation ({cont.get('compared')}): steps {self.at}..{cont.get('last_step')} "
                       + ("bitwise equal to the uninterrupted run" if cont.get("compared") == "bitwise" else "within the stepwise tolerance"))
        return out


def _names(diffs: list[GateDifference]) -> str:
    names = [d.name for d in diffs if d.name]
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


_summaries: dict[str, Any] = {
    "resume-state-missing": lambda ds: f"{len(ds)} saved entries are absent ({_names(ds)})",
    "resume-step-reset": lambda ds: (f"{len(ds)} optimizer step counters went back from {ds[0].detail.get('saved')} "
                                     f"to {ds[0].detail.get('loaded')}"),
    "resume-scheduler-not-restored": lambda ds: f"the lr scheduler's state differs on {len(ds)} rank(s)",
    "resume-rng-not-restored": lambda ds: (f"the RNG state differs on rank(s) {sorted({d.rank for d in ds})}"
                                           f" (first draw {ds[0].detail.get('saved_first_draw')} saved, "
                                           f"{ds[0].detail.get('loaded_first_draw')} loaded)"),
    "resume-data-position-lost": lambda ds: ds[0].detail.get("sentence", "the first resumed batch re-uses consumed samples"),
    "resume-chunks-permuted": lambda ds: f"{len(ds)} tensors hold the saved chunks in another order ({_names(ds)})",
    "resume-value-differs": lambda ds: (f"{len(ds)} loaded {'value differs' if len(ds) == 1 else 'values differ'} from the "
                                        f"saved {'one' if len(ds) == 1 else 'ones'} ({_names(ds) or _whats(ds)})"),
}


def _whats(diffs: list[GateDifference]) -> str:
    """What differed, where the differences have no names (the optimizer's param groups)."""
    return ", ".join(dict.fromkeys(d.what.replace("_", " ") for d in diffs))


def _chunkings(saved: torch.Tensor, loaded: torch.Tensor, most: int) -> Iterator[tuple[int, int, tuple, tuple]]:
    """(dim, count, loaded's chunks, saved's chunks) for every ``torch.chunk`` of both into
    ``count`` equal pieces along ``dim`` (the chunking FSDP2 and TP shard by), the fewest first."""
    if saved.shape != loaded.shape or saved.dim() == 0:
        return
    for dim in range(saved.dim()):
        size = saved.shape[dim]
        for count in range(2, min(size, most) + 1):
            if not size % count:
                yield dim, count, loaded.chunk(count, dim), saved.chunk(count, dim)


def chunk_permutation(saved: torch.Tensor, loaded: torch.Tensor, *, most: int = 16) -> dict[str, Any] | None:
    """Where ``loaded`` is ``saved`` with its ``torch.chunk`` pieces along one dim in another
    order: ``{"dim", "chunks", "order"}`` (``order[i]``: which saved chunk sits at position i),
    the fewest chunks first; else None."""
    for dim, count, have, want in _chunkings(saved, loaded, most):
        order: list[int] = []
        for piece in have:
            j = next((j for j, w in enumerate(want) if j not in order and torch.equal(piece, w)), None)
            if j is None:
                break
            order.append(j)
        if len(order) == count and order != list(range(count)):
            return {"dim": dim, "chunks": count, "order": order}
    return None


def chunk_duplication(saved: torch.Tensor, loaded: torch.Tensor, *, most: int = 16) -> dict[str, Any] | None:
    """Where ``loaded`` is ``saved`` with some of its ``torch.chunk`` pieces along one dim
    replaced by copies of another saved piece (every rank loading rank 0's shard):
    ``{"dim", "chunks", "sources"}`` (``sources[i]``: which saved chunk sits at position i, a
    repeat among them), the fewest chunks first; else None."""
    for dim, count, have, want in _chunkings(saved, loaded, most):
        sources: list[int] = []
        for position, piece in enumerate(have):
            j = position if torch.equal(piece, want[position]) else next(
                (j for j, w in enumerate(want) if torch.equal(piece, w)), None)
            if j is None:
                break
            sources.append(j)
        if len(sources) == count and len(set(sources)) < count:
            return {"dim": dim, "chunks": count, "sources": sources}
    return None


def _duplicated_sentence(kind: str, name: str, found: dict[str, Any]) -> str:
    moved = [(p, j) for p, j in enumerate(found["sources"]) if p != j]
    said = ", ".join(f"position {p} holds saved chunk {j}" for p, j in moved[:4])
    p, j = moved[0]
    return (f"{kind} {name!r}: of its {found['chunks']} chunks along dim {found['dim']}, {said}: a duplicated chunk - the "
            f"rank holding chunk {p} loaded chunk {j}'s shard (sharded over {found['chunks']} ranks as FSDP2 shards, rank {p} "
            f"holds rank {j}'s chunk; chunk {p} itself was never loaded)")


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float((a.double() - b.double()).abs().max().item()) if a.numel() else 0.0


def _gate_tensors(saved: Record, resumed: Record, step: int, check: ResumeCheck) -> None:
    for kind in ("param", "optim"):
        have, want = set(resumed.step(step).names(kind)), saved.step(step).names(kind)
        check.compared[kind] = len(want)
        for name in want:
            if name not in have:
                check.gate.append(GateDifference("resume-state-missing", kind, name, detail={"saved_shape": list(saved.info(step, kind, name).shape)}))
                continue
            a, b = saved.tensor(step, kind, name), resumed.tensor(step, kind, name)
            if a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b):
                continue
            key = split_optim_state_name(name)[1] if kind == "optim" else ""
            if key == "step" and a.numel() == 1 and b.numel() == 1 and float(b) < float(a):
                check.gate.append(GateDifference("resume-step-reset", kind, name, detail={"saved": float(a), "loaded": float(b)}))
            elif (perm := chunk_permutation(a, b)) is not None:
                check.gate.append(GateDifference("resume-chunks-permuted", kind, name, detail=perm))
            elif (dup := chunk_duplication(a, b)) is not None:
                check.gate.append(GateDifference("resume-value-differs", kind, name, detail={
                    **dup, "duplicated": True, "sentence": _duplicated_sentence(kind, name, dup)}))
            else:
                check.gate.append(GateDifference("resume-value-differs", kind, name, detail={
                    "max_abs": float(f"{_max_abs(a, b):.3g}"), "saved": f"{tuple(a.shape)} {a.dtype}", "loaded": f"{tuple(b.shape)} {b.dtype}"}))
        for name in sorted(have - set(want)):
            check.gate.append(GateDifference("resume-value-differs", kind, name, detail={"saved": "absent", "loaded": "present"}))


def _groups(record: Record, step: int) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in record.step(step).param_groups]


def _gate_groups(saved: Record, resumed: Record, step: int, check: ResumeCheck) -> None:
    from deepdiff import DeepDiff

    want, have = _groups(saved, step), _groups(resumed, step)
    check.compared["param_groups"] = len(want)
    diff = DeepDiff(want, have, significant_digits=None)
    if diff:
        check.gate.append(GateDifference("resume-value-differs", "param_groups", detail={"diff": diff.pretty()[:400]}))


def _gate_ranks(resumed: Record, checkpoint: str, check: ResumeCheck) -> None:
    from deepdiff import DeepDiff

    from harness.record.checkpoint import saved_rank_state, saved_view

    info = resumed.meta.get("resume") or {}
    ranks = info.get("ranks") or []
    check.compared["ranks"] = len(ranks)
    lost_seen: set[str] = set()
    for entry in ranks:
        rank = int(entry["rank"])
        for lost in entry.get("not_transferable") or []:
            if lost["state"] not in lost_seen:
                lost_seen.add(lost["state"])
                check.not_transferable.append(lost)
        state, _ = saved_rank_state(checkpoint, rank, check.world)
        want, have = saved_view(state), entry.get("view") or {}
        if "rng" in want and want["rng"] != have.get("rng") and not _draws_after(resumed, rank, check.at):
            # A generator nobody draws from after the resume cannot change the run: said, not named.
            check.notes.append(f"rank {rank}'s RNG was not restored, but the resumed run draws no random numbers "
                               f"there (none logged from step {check.at} on): it cannot change the run")
        elif "rng" in want and want["rng"] != have.get("rng"):
            check.gate.append(GateDifference("resume-rng-not-restored", "rng", rank=rank, detail={
                "saved_first_draw": float.fromhex(want["rng"]["first_draw"]),
                "loaded_first_draw": float.fromhex(have["rng"]["first_draw"]) if have.get("rng") else None}))
        _gate_buffers(want.get("buffers") or {}, have.get("buffers") or {}, rank, check)
        if "lr_scheduler" in want or "lr_scheduler" in have:
            diff = DeepDiff(want.get("lr_scheduler"), have.get("lr_scheduler"))
            if diff:
                w, h = want.get("lr_scheduler") or {}, have.get("lr_scheduler") or {}
                check.gate.append(GateDifference("resume-scheduler-not-restored", "lr_scheduler", rank=rank, detail={
                    "saved_last_epoch": w.get("last_epoch"), "loaded_last_epoch": h.get("last_epoch"),
                    "saved_last_lr": w.get("_last_lr"), "loaded_last_lr": h.get("_last_lr")}))


def _gate_buffers(want: dict[str, str], have: dict[str, str], rank: int, check: ResumeCheck) -> None:
    """The model's persistent buffers (a running statistic the forward reads) on ``rank``,
    right after the load, against their digests when saved; named once each, on the first rank
    where they differ. Names only one side has (another layout's wrapper prefixes) are not
    compared."""
    if want:
        check.compared["buffers"] = max(check.compared.get("buffers", 0), len(want))
    for name in want:
        if name in have and have[name] != want[name] and not any(d.what == "buffer" and d.name == name for d in check.gate):
            check.gate.append(GateDifference("resume-value-differs", "buffer", name, rank=rank, detail={
                "sentence": f"model buffer {name!r} on rank {rank} is not the one saved: the forward reads it, and the "
                            "checkpoint did not bring it back (a state of named_parameters() leaves buffers out; save and "
                            "load model.state_dict())"}))


def _draws_after(resumed: Record, rank: int, at: int) -> bool:
    """Whether ``rank`` drew random numbers in the resumed run's steps ``at..``: the draw log
    (kept when the case's forward draws, reference.draws.forward_draws_random_numbers), or a
    log that overflowed. No log: the forward draws none, and a draw elsewhere in the loop shows
    in the continuation, which names a departure."""
    for step in range(at, resumed.num_steps):
        extra = resumed.step(step).extra
        if extra.get("draws_overflowed") or (extra.get("draws") or {}).get(str(rank)):
            return True
    return False


def _gate_samples(saved: Record, resumed: Record, at: int, check: ResumeCheck) -> None:
    """The data position, from the sample ids: the first resumed step's batch against the
    uninterrupted run's, and against every batch consumed before the checkpoint."""
    if resumed.num_steps <= at or saved.num_steps <= at:
        return
    want, have = saved.step(at).sample_ids, resumed.step(at).sample_ids
    check.compared["samples"] = len(want)
    if sorted(want) == sorted(have):
        return
    earlier = [s for s in range(at) if sorted(saved.step(s).sample_ids) == sorted(have)]
    consumed = {i for s in range(at) for i in saved.step(s).sample_ids}
    reused = sorted(set(have) & consumed - set(want))
    if earlier or reused:
        where = f"the batch of step {earlier[0]}" if earlier else f"{len(reused)} samples consumed before the checkpoint"
        check.gate.append(GateDifference("resume-data-position-lost", "samples", detail={
            "step": at, "sentence": f"the first resumed step {at} consumed {where} (ids {reused[:6] or have[:6]}), "
                                    f"not step {at}'s batch (ids {want[:6]})",
            "resumed_ids": have[:16], "expected_ids": want[:16], "same_as_step": earlier[0] if earlier else None,
            "reused": reused[:16]}))


def _bitwise_continuation(saved: Record, resumed: Record, at: int) -> dict[str, Any]:
    last = min(saved.num_steps, resumed.num_steps) - 1
    out: dict[str, Any] = {"compared": "bitwise", "last_step": last}
    for step in range(at, last + 1):
        a, b = saved.step(step), resumed.step(step)
        if (drew := _first_draw_difference(a.extra.get("draws") or {}, b.extra.get("draws") or {})) is not None:
            # The same program from the same bits draws the same numbers: a draw from another
            # generator state comes first, whatever the losses say after it.
            out["first_difference"] = {"step": step, "what": drew.pop("sentence"), "draw": drew}
            return out
        if [float(x).hex() for x in a.micro_losses] != [float(x).hex() for x in b.micro_losses]:
            out["first_difference"] = {"step": step, "what": f"micro-batch losses {a.micro_losses} vs {b.micro_losses}"}
            return out
        for kind in ("grad", "param", "optim"):
            for name in a.names(kind):
                if name not in b.names(kind):
                    out["first_difference"] = {"step": step, "what": f"{kind} {name!r} missing"}
                    return out
                x, y = saved.tensor(step, kind, name), resumed.tensor(step, kind, name)
                if not (x.shape == y.shape and torch.equal(x, y)):
                    out["first_difference"] = {"step": step, "what": f"{kind} {name!r} (max abs {_max_abs(x, y):.3g})",
                                               "kind": kind, "name": name}
                    return out
    return out


def _first_draw_difference(saved: dict[str, list[dict[str, Any]]], resumed: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The first random op, rank by rank, that the resumed run drew otherwise than the
    uninterrupted one (another op, or the same op from another generator state), from the
    draw logs both runs kept (a forward that draws); None where they agree or one has none."""
    if not saved or not resumed:
        return None
    from harness.tracing.random_ops import hooks_short

    for rank in sorted(set(saved) & set(resumed), key=int):
        for i, (want, have) in enumerate(zip(saved[rank], resumed[rank])):
            if (want.get("op"), want.get("state")) == (have.get("op"), have.get("state")):
                continue
            how = "from another generator state" if want.get("op") == have.get("op") else f"{have.get('op')} where it drew {want.get('op')}"
            return {"rank": int(rank), "index": i, "op": want.get("op"), "call_site": have.get("call_site", ""),
                    "sentence": f"rank {rank}'s random op #{i} ({want.get('op')} at {hooks_short(have.get('call_site', ''))}) "
                                f"drew {how} than in the uninterrupted run: the generator was re-seeded or advanced "
                                "after the load"}
    return None


def _stepwise_continuation(comparison: Any, at: int, last: int) -> dict[str, Any]:
    out: dict[str, Any] = {"compared": "stepwise tolerance", "last_step": last}
    failing = sorted((f for f in comparison.failures() if f.step >= at), key=lambda f: (f.step, f.kind, f.name))
    issues = [s for s in comparison.structure if s.step is not None and s.step >= at]
    if failing:
        f = failing[0]
        out["first_difference"] = {"step": f.step, "what": f"{f.kind} {f.name!r} beyond tolerance (max abs {f.max_abs:.3g})",
                                   "kind": f.kind, "name": f.name, "failing": len(failing)}
    elif issues:
        s = issues[0]
        out["first_difference"] = {"step": s.step, "what": f"{s.category} {s.kind} {s.name!r}"}
    return out


def check_resume(saved: Record, resumed: Record, checkpoint: str, *, comparison: Any = None) -> ResumeCheck:
    """The load gate at step ``at - 1`` and the continuation from ``at`` (module docstring).
    ``comparison``: the resumed record's stepwise comparison with the reference
    (:class:`~harness.analysis.compare.CompareResult`), which judges the continuation on
    another layout."""
    info = resumed.meta.get("resume") or {}
    at = int(info["at"])
    same = bool(info.get("same_ranks")) and saved.source == resumed.source
    check = ResumeCheck(at=at, saved=str(saved.path), resumed=str(resumed.path), same_layout=same,
                        saved_world=int(info.get("saved_world", saved.meta.get("world_size", 0))),
                        world=int(resumed.meta.get("world_size", 0)))
    _gate_tensors(saved, resumed, at - 1, check)
    _gate_groups(saved, resumed, at - 1, check)
    _gate_ranks(resumed, checkpoint, check)
    _gate_samples(saved, resumed, at, check)
    if same:
        check.continuation = _bitwise_continuation(saved, resumed, at)
    elif comparison is not None:
        check.continuation = _stepwise_continuation(comparison, at, resumed.num_steps - 1)
    return check
