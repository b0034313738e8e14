"""Where a failing run departs: the samples of the first failing step, when they are not the
reference's; else the first module whose forward output leaves the reference's (and the op
inside it); else the loss, when the forward matches and step 0's loss does not; else the
optimizer step when the gradients match and the update does not; else the first module output
whose gradient leaves the reference's in the probed backward (and the autograd node there);
else the first failing gradient in backward order when only some of a step's gradients fail.

Only for a run whose comparison failed (a correct run never gets a location). The forward
location comes from the activation probe (:mod:`harness.record.probe`): every rank's module
outputs of the first micro-batch of step 0, against the reference model replayed on that
rank's own input (same weights, same step-0 state). Modules are visited in the order their
forward finished, so the first one that differs is the innermost, earliest place the values
leave the reference; what a module computes inline (a norm over a local shard, a matmul in the
parent's forward) shows at the module that contains it. Each rank's output is compared by
what it holds:

- a plain tensor, or a DTensor whose placements are all ``Replicate``: the reference's whole;
- a DTensor ``Shard(d)`` (or a plain tensor whose one differing dim is the reference's split
  by the tensor-parallel group): the reference's ``torch.chunk`` at the rank's coordinate;
- a DTensor ``Partial``: the sum over the rank's tensor-parallel group. A plain tensor that
  matches the reference only summed over its group is a partial sum some later module may
  reduce: not a departure by itself; when the module that contains it (or the model's output)
  is the next to depart, the partial was used unreduced, and the location is that child, with
  ``consumed_by`` naming where it showed.

The tolerance is the probe's rule - ``|a - e| <= rtol |e| + atol * max|e|`` with rtol 2e-3 and
atol 2e-4 for float32, widened for 16-bit dtypes by their machine epsilon's ratio to float32's over 4096 (bfloat16:
16x, float16: 2x): a
forward reassociated across ranks differs from the reference by a few ulps of each value's
magnitude, and a bug that changes what is computed by far more. A dropout module is compared too:
the reference replays its draw from the case's seed, so a mask that differs is where the values
depart (whether the ranks should have drawn it alike, the random-draw checks say)."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from reference.case import Case

from harness.analysis.compare import CompareResult, TensorComparison
from harness.analysis.probe_checks import PROBE_ATOL, PROBE_RTOL, reference_backward, reference_grads, reference_loss, reference_ops, reference_outputs
from harness.record.probe import GRAD_MARKER, OUTPUT, OpCapture, ProbeData

__all__ = ["first_divergence_location", "location_line", "reference_state", "step_to_probe"]

def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    widen = max(1.0, torch.finfo(dtype).eps / torch.finfo(torch.float32).eps / 4096) if dtype.is_floating_point else 1.0
    return PROBE_RTOL * widen, PROBE_ATOL * widen


def _difference(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float, float]:
    """(within, max_abs, max_rel) of ``actual`` against ``expected`` under the rule above."""
    a, e = actual.double(), expected.double()
    diff = (a - e).abs()
    scale = max(float(e.abs().max()), 1e-6) if e.numel() else 1.0
    within = bool((diff <= rtol * e.abs() + atol * scale).all()) and bool(torch.isfinite(a).all() or not torch.isfinite(e).all())
    max_abs = float(diff.max()) if diff.numel() else 0.0
    return within, max_abs, max_abs / scale


def _placement_kind(placements: str | None) -> tuple[str, int | None]:
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


def _tp(entry: dict[str, Any]) -> tuple[int | None, list[int]]:
    group = list(entry["groups"].get("tp") or [])
    coord = entry["mesh"].get("tp")
    return (int(coord) if coord is not None else None), group


def _summed(held: list[Any], shape: torch.Size, value: str = "output") -> torch.Tensor | None:
    """The sum of the group's held values (captures or ops; their ``output``, or another
    attribute such as a capture's ``grad``), or None where the group is empty or one of them
    has no such value of that shape."""
    values = [getattr(h, value, None) if h is not None else None for h in held]
    if not values or any(v is None or v.shape != shape for v in values):
        return None
    return torch.stack(values).sum(0)


def _group_sum(by_rank: dict[int, dict[str, Any]], group: list[int], name: str, shape: torch.Size,
               value: str = "output") -> torch.Tensor | None:
    """The sum of module ``name``'s outputs (or their ``grad``) over the ranks of ``group`` (:func:`_summed`)."""
    return _summed([by_rank[r]["captures"].get(name) for r in group if r in by_rank], shape, value)


@dataclass
class _Judged:
    """How one held value (a module's or an op's output on one rank) stands against the
    reference's: ``within``, ``partial`` (it matches only summed over the tensor-parallel
    group: a partial sum a later op may reduce) or ``departs``."""

    status: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    compared: str = "whole"


def _corresponding(local: torch.Tensor, placements: str | None, expected: torch.Tensor, coord: int | None,
                   group: list[int], group_sum: Callable[[], torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor, str, str] | None:
    """(what the rank's value stands for, the reference's piece it must equal, how they
    correspond, the placement kind) by the value's placement (module docstring); None where
    the layout does not say how they correspond."""
    kind, dim = _placement_kind(placements)
    compared = "whole"
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


def _judge(local: torch.Tensor, placements: str | None, expected: torch.Tensor, coord: int | None, group: list[int],
           group_sum: Callable[[], torch.Tensor | None], rtol: float, atol: float) -> _Judged | None:
    """Compare what a rank holds with the reference's value by its placement (module
    docstring); None where the layout does not say how they correspond (not compared)."""
    pieces = _corresponding(local, placements, expected, coord, group, group_sum)
    if pieces is None:
        return None
    local, expected, compared, kind = pieces
    within, max_abs, max_rel = _difference(local, expected, rtol, atol)
    if within:
        return _Judged("partial" if kind == "partial" else "within", max_abs, max_rel, compared)
    if kind == "plain" and compared == "whole" and len(group) > 1:
        summed = group_sum()
        if summed is not None and _difference(summed, expected, rtol, atol)[0]:
            return _Judged("partial", max_abs, max_rel, f"sum over the tensor-parallel group {group}")
    return _Judged("departs", max_abs, max_rel, compared)


def _forward_location(data: ProbeData, case: Case, matched: list[str] | None = None) -> dict[str, Any] | None:
    """The first module whose output departs (module docstring), with its op; None when none
    does. ``matched`` (when given) receives, in order, the modules whose output was compared
    and matched on every probed rank."""
    rtol, atol = _tolerance(case.dtype)
    by_rank = {r["rank"]: r for r in data.ranks}
    first: dict[str, Any] | None = None
    compared_on: dict[str, int] = {}
    probed = 0
    for rank, entry in sorted(by_rank.items()):
        if entry["input"] is None or entry["stages"] not in (None, [0]):
            continue  # later pipeline stages do not see the model input
        ref = reference_outputs(data, rank, case)
        probed += 1
        coord, group = _tp(entry)
        pending: list[str] = []  # modules whose output matched only as a partial sum, not reduced since
        for position, name in enumerate(entry["order"]):
            cap = entry["captures"][name]
            if name not in ref:
                continue
            if cap.p and not cap.training:
                # The reference trains every module: a dropout left in eval mode (model.eval()
                # for a validation pass, never undone) computes the identity where it masks.
                found = {"phase": "forward", "module": name, "module_type": cap.module_type, "op": None, "rank": rank,
                         "step": data.step, "max_abs": float((cap.output - ref[name]).abs().max()), "max_rel": 0.0,
                         "tolerance": {"rtol": rtol, "atol": atol, "of": "max |reference|"}, "position": position,
                         "compared": "its mode: it ran in eval mode (no mask drawn); the reference trains it",
                         "eval_mode": True, "placements": cap.placements, "_name": name}
                if first is None or position < first["position"]:
                    first = found
                break
            if cap.p and data.step > 0:
                # A later step's masks come from a generator state the replay does not have:
                # nothing from this dropout on is compared (values, not draws, are sought here).
                break
            judged = _judge(cap.output, cap.placements, ref[name], coord, group,
                            lambda: _group_sum(by_rank, group, name, cap.output.shape), rtol, atol)
            if judged is None:
                continue
            if judged.status == "partial":
                pending.append(name)  # a partial sum a later module may reduce (see the module docstring)
                continue
            if judged.status == "within":
                compared_on[name] = compared_on.get(name, 0) + 1
                if name != OUTPUT:  # reduced at or inside ``name``: those partials were not the departure
                    pending = [q for q in pending if not q.startswith(name + ".")]
                continue
            note = {"note": "a dropout whose mask differs from the reference's draw: whether the ranks should have "
                            "drawn it alike is the random-draw checks' to say"} if cap.p else {}
            culprit = next((q for q in pending if name == OUTPUT or q.startswith(name + ".")), None)
            if culprit is not None:
                # The departure shows in the module that used a partial sum of its own child unreduced.
                note["consumed_by"] = "<model output>" if name == OUTPUT else name
                note["partial_over"] = group
                cap = entry["captures"][culprit]
                name = culprit
            found = {**note, "phase": "forward", "module": "<model output>" if name == OUTPUT else name,
                     "module_type": cap.module_type, "op": None, "rank": rank, "step": data.step, "max_abs": judged.max_abs,
                     "max_rel": judged.max_rel, "tolerance": {"rtol": rtol, "atol": atol, "of": "max |reference|"},
                     "compared": judged.compared, "placements": cap.placements, "position": position,
                     "_name": name}
            if first is None or position < first["position"]:
                first = found
            break
    if matched is not None and first is None:
        matched += [n for n, count in compared_on.items() if count == probed]
    if first is not None and first.get("eval_mode"):
        first.pop("position"), first.pop("_name")
        return first
    if first is not None:
        first.pop("position")
        name = first.pop("_name")
        try:
            op = _op_location(data, case, first["rank"], "" if name == OUTPUT else name,
                              partial=bool(first.get("consumed_by")), rtol=rtol, atol=atol)
        except Exception as exc:  # noqa: BLE001 - the module is evidence enough without its op
            op = {"op_note": f"the op inside {first['module']!r} was not located: {type(exc).__name__}: {exc}"}
        if "max_abs" in op:
            first["module_max_abs"] = first["max_abs"]
        if op.get("inline_before"):  # the parent's own code departed first: the location is the parent
            parent = "" if op["op_module"] == "<model output>" else op["op_module"]
            held = by_rank[first["rank"]]["captures"].get(parent or OUTPUT)
            first["module"], first["module_type"] = op["op_module"], held.module_type if held is not None else None
        first.update(op)
    return first


# -- the op inside the module ---------------------------------------------------------------
def _keyed(ops: list[OpCapture]) -> dict[tuple[str, str, int], OpCapture]:
    """Ops by (module, op, occurrence): the same program on every rank of a group logs the
    same keys, so a peer's value of an op is found by its key."""
    seen: dict[tuple[str, str], int] = {}
    out = {}
    for o in ops:
        n = seen.get((o.module, o.op), 0)
        seen[(o.module, o.op)] = n + 1
        out[(o.module, o.op, n)] = o
    return out


def _aligned(held: list[OpCapture], ref: list[OpCapture]) -> list[tuple[OpCapture, OpCapture, str]]:
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


def _op_location(data: ProbeData, case: Case, rank: int, module: str, *, partial: bool, rtol: float,
                 atol: float) -> dict[str, Any]:
    """The first op of ``module`` on ``rank`` whose output departs from the reference's (for a
    partial sum used unreduced: the first whose output is that partial sum), from the ranks'
    op logs against the reference's on the same input. Ops run directly in the module are
    searched first, then those of its submodules. Where every computing op matches, a
    collective or layout op after them changed the values: the first collective after the
    last matching op is named when there is one."""
    by_rank = {r["rank"]: r for r in data.ranks}
    entry = by_rank[rank]
    held_ops: list[OpCapture] = entry.get("ops") or []
    if not held_ops:
        return {"op_note": "no op log of this forward (pipeline stages, or a model called before the harness watched it)"}
    ref_ops = reference_ops(data, rank, case)
    coord, group = _tp(entry)
    peers = {r: _keyed(by_rank[r].get("ops") or []) for r in group if r in by_rank}
    keys = {id(o): k for k, o in _keyed(held_ops).items()}

    def peer_sum(op: OpCapture) -> torch.Tensor | None:
        return _summed([peers[r].get(keys[id(op)]) for r in group if r in peers], op.output.shape)

    def scan(pairs: list[tuple[OpCapture, OpCapture, str]], held: list[OpCapture], scope: str,
             only: Callable[[OpCapture], bool] = lambda o: True) -> tuple[dict[str, Any] | None, OpCapture | None]:
        """The first held op of ``pairs`` (those ``only`` admits) that departs (or, with
        ``partial``, is the partial sum), as the location's op fields; else (None, the last
        op that matched)."""
        last_within: OpCapture | None = None
        partial_before: OpCapture | None = None  # the last op whose output matched only summed over the group
        rows: list[dict[str, Any]] = []  # each compared op up to the departing one, for the report's numerics table
        for mine, theirs, how in pairs:
            if not only(mine):
                continue
            judged = _judge(mine.output, mine.placements, theirs.output, coord, group, lambda: peer_sum(mine), rtol, atol)
            if judged is None:
                continue
            hit = judged.status == "partial" if partial else judged.status == "departs"
            rows.append({"op": mine.op, "module": mine.module or "<model output>", "reference_op": theirs.op,
                         "status": judged.status, "max_abs": judged.max_abs, "compared": judged.compared, "aligned": how})
            if not hit:
                last_within = mine
                if judged.status == "partial":
                    partial_before = mine
                elif judged.status == "within" and mine.placements is None:
                    partial_before = None
                continue
            index = next(i for i, o in enumerate(o for o in held if o.output is not None) if o is mine)
            where = {"op": mine.op, "op_module": mine.module or "<model output>", "op_placements": mine.placements,
                     "op_index": index, "ops_compared": len(rows), "op_rows": rows[-12:]}
            since = held[held.index(last_within) + 1:held.index(mine)] if last_within is not None else held[:held.index(mine)]
            collective = next((o for o in reversed(since) if o.output is None), None)
            if collective is not None:
                where["after_collective"] = {"op": collective.op, "module": collective.module or "<model output>"}
            if partial_before is not None and not partial:
                where["after_partial"] = {"op": partial_before.op, "module": partial_before.module or "<model output>",
                                          "over": group}
            if partial:  # the module's figures (where the partial showed) stay; the op made the partial
                return {**where, "op_compared": f"{judged.compared}; op aligned {how}, {scope}"}, last_within
            return {**where, "max_abs": judged.max_abs, "max_rel": judged.max_rel,
                    "compared": f"{judged.compared}; op aligned {how}, {scope}"}, last_within
        return None, last_within

    if module and not partial:
        # What the module's parents compute inline before it (a norm written as plain calls in
        # a block's forward) reaches the module as its input: the first op of a parent that
        # departs before the module's own ops is where the values left the reference.
        ancestors = {".".join(module.split(".")[:i]) for i in range(len(module.split(".")))}
        first_own = next((i for i, o in enumerate(held_ops) if o.module == module or o.module.startswith(module + ".")), None)
        before = {id(o) for o in held_ops[:first_own]} if first_own is not None else set()
        found, _ = scan(_aligned(held_ops, ref_ops), held_ops, f"inline in the forward of a module containing {module!r}, before it",
                        lambda o: o.module in ancestors and id(o) in before)
        if found is not None:
            return {**found, "inline_before": module}
    scopes = [("in the module itself", lambda m: m == module)]
    if module:
        scopes.append(("in its submodules", lambda m: m.startswith(module + ".")))
    else:  # the model's own forward: what it computes inline runs in the reference's submodules
        scopes.append(("in the whole forward, aligned regardless of modules", lambda m: True))
    for scope, inside in scopes:
        held = [o for o in held_ops if inside(o.module)]
        ref = [o for o in ref_ops if inside(o.module)]
        pairs = _aligned(held, ref)
        found, last_within = scan(pairs, held, scope)
        if found is not None:
            return found
        after = held[held.index(last_within) + 1:] if last_within is not None else held
        collective = next((o for o in after if o.output is None), None)
        if collective is not None and pairs:
            return {"op": collective.op, "op_module": collective.module or "<model output>",
                    "op_note": f"every computing op {scope} matches the reference ({len(pairs)} compared); the values "
                               f"change at this collective after {last_within.op if last_within else 'the start'}"}
    return {"op_note": f"no single op of {module or 'the model forward'!r} departs by itself "
                       "(the module's output does; ops compared by placement and aligned by name)"}


def _first_failing_step(comparison: CompareResult) -> tuple[int, list[TensorComparison]] | None:
    """The first step with a tensor beyond tolerance and every comparison of that step."""
    failures = comparison.failures()
    if not failures:
        return None
    step = min(t.step for t in failures)
    return step, [t for t in comparison.tensors if t.step == step]


def _samples_location(comparison: CompareResult, actual: Any, reference: Any) -> dict[str, Any] | None:
    """The first failing step's global batch - the samples its data-parallel replicas consumed,
    one replica's ranks counted once - is another multiset of sample ids than the reference's
    step of that number: the step departs before the model, in what it read (a sampler never
    told the epoch, one that repeats or drops samples). The ids the replicas reported (run.loss,
    the strategies' batches) against the reference's; where they are exactly another step's
    batch of the reference, that step is named. Ranks of one replica that read different
    samples are the forward's evidence (each rank's own batch is replayed), not this one."""
    from collections import Counter

    first = _first_failing_step(comparison)
    if first is None or actual is None or reference is None:
        return None
    step = first[0]
    wanted = {s.step: list(s.sample_ids) for s in getattr(reference, "steps", [])}
    if not wanted.get(step):
        return None
    try:
        held = actual.step(step)
    except Exception:  # noqa: BLE001 - a record without that step: nothing to compare
        return None
    replica = {int(r["rank"]): int(r.get("dp_rank", r["rank"])) for r in actual.meta.get("ranks", []) or []}
    by_replica: dict[int, list[int]] = {}
    for rank, micro in sorted(held.rank_sample_ids.items()):
        ids = [int(i) for m in micro for i in m]
        if not ids:
            continue  # a rank that consumed nothing itself (a pipeline stage without the data)
        rep = replica.get(int(rank), int(rank))
        if rep in by_replica and sorted(by_replica[rep]) != sorted(ids):
            return None
        by_replica.setdefault(rep, ids)
    if not by_replica:
        return None
    got = Counter(i for ids in by_replica.values() for i in ids)
    want = Counter(wanted[step])
    if got == want:
        return None
    missing, extra = sorted((want - got).elements()), sorted((got - want).elements())
    same_as = next((s for s, ids in sorted(wanted.items()) if s != step and Counter(ids) == got), None)
    show = lambda ids: f"{ids[:6]}{'...' if len(ids) > 6 else ''}"  # noqa: E731
    compared = (f"step {step}'s {sum(got.values())} samples over {len(by_replica)} replicas against the reference's "
                f"{sum(want.values())}: {len(missing)} of the reference's missing {show(missing)}, {len(extra)} not in "
                f"its step {show(extra)}")
    found = {"phase": "input", "module": "<data>", "module_type": None, "op": None, "rank": None, "step": step,
             "max_abs": float(len(missing) + len(extra)), "max_rel": (len(missing) + len(extra)) / max(1, 2 * sum(want.values())),
             "tolerance": {"rtol": 0.0, "atol": 0.0, "of": "sample ids, exactly"}, "compared": compared,
             "samples": {"missing": missing[:32], "extra": extra[:32]}}
    if same_as is not None:
        found["same_as_reference_step"] = same_as
    return found


def _input_location(probe: ProbeData, case: Case) -> dict[str, Any] | None:
    """A loop that reads its own batches fed the model something other than the samples it
    reported (run.loss's ids) in its first forward: an augmentation, noise, a wrong cast. The
    values depart before the model; the first such rank."""
    from reference.case import tensors_in

    rtol, atol = _tolerance(case.dtype)
    for entry in sorted(probe.ranks, key=lambda r: r["rank"]):
        held, expected = entry.get("input"), entry.get("expected_input")
        if held is None or expected is None:
            continue
        pairs = list(zip(tensors_in(held), tensors_in(expected)))
        if len(tensors_in(held)) != len(tensors_in(expected)) or any(a.shape != b.shape for a, b in pairs):
            continue  # another structure than the case's batches: not comparable
        for a, b in pairs:
            if a.is_floating_point() or b.is_floating_point():
                within, max_abs, max_rel = _difference(a.float(), b.float(), rtol, atol)
            else:
                within, max_abs, max_rel = torch.equal(a, b), float((a != b).sum()), 0.0
            if not within:
                return {"phase": "input", "module": "<model input>", "module_type": None, "op": None, "rank": entry["rank"],
                        "step": probe.step, "max_abs": max_abs, "max_rel": max_rel,
                        "tolerance": {"rtol": rtol, "atol": atol, "of": "max |samples|"},
                        "compared": f"the input of rank {entry['rank']}'s first forward against the collated samples it "
                                    f"reported ({len(entry['ids'])} ids: {entry['ids'][:4]}{'...' if len(entry['ids']) > 4 else ''})"}
    return None


def _loss_location(comparison: CompareResult, probe: ProbeData | None, case: Case, matched: list[str]) -> dict[str, Any] | None:
    """Step 0's loss departs, every module output of the probed forward that could be compared
    matched on every rank, and a rank's own loss on its probed micro-batch departs from the
    reference's loss on the same inputs and targets: the values leave the reference after
    the model's forward (or after the last module compared), in the loss computation. A rank
    whose own loss matches the reference's on its own batch is no evidence of that: the step
    differs by what the ranks read (their samples, their per-replica statistics)."""
    first = _first_failing_step(comparison)
    if probe is None or first is None or first[0] != probe.step or not matched:
        return None
    if not any(t.kind == "loss" and not t.passed for t in first[1]):
        return None
    rtol, atol = _tolerance(case.dtype)
    worst: tuple[int, float, float, float, float] | None = None
    for entry in sorted(probe.ranks, key=lambda r: r["rank"]):
        held = entry.get("loss")
        if held is None or entry["stages"] not in (None, [0]):
            continue
        expected = reference_loss(probe, entry["rank"], case)
        if expected is None or expected.numel() != 1:
            continue
        within, max_abs, max_rel = _difference(held.reshape(()), expected.reshape(()), rtol, atol)
        if not within and (worst is None or max_abs > worst[1]):
            worst = (entry["rank"], max_abs, max_rel, float(held), float(expected))
    if worst is None:
        return None
    rank, max_abs, max_rel, held, expected = worst
    whole = OUTPUT in matched
    last = next((n for n in reversed(matched) if n != OUTPUT), None)
    after = "the model's output" if whole else f"module {last!r}, the last module output compared"
    return {"phase": "loss", "module": "<loss>" if whole else f"after {last}", "module_type": None, "op": None,
            "rank": rank, "step": probe.step, "max_abs": max_abs, "max_rel": max_rel,
            "tolerance": {"rtol": rtol, "atol": atol, "of": "|reference loss|"},
            "compared": f"rank {rank}'s loss on its first micro-batch is {held:.6g}, the reference's on the same inputs and "
                        f"targets {expected:.6g}; the forward matches in every module output compared on every rank "
                        f"({len(matched)}, up to {after})",
            "matched_modules": len(matched), "model_output_compared": whole}


def _optimizer_location(comparison: CompareResult, case: Case) -> dict[str, Any] | None:
    """The gradients of the first failing step match and a parameter does not: the update."""
    first = _first_failing_step(comparison)
    if first is None:
        return None
    step, compared = first
    at_step = [t for t in compared if not t.passed]
    if any(t.kind not in ("param", "optim") for t in at_step):
        return None
    grads = [t for t in compared if t.kind == "grad"]
    if not grads or not all(t.passed for t in grads):
        return None
    worst = max((t for t in at_step if t.kind == "param"), key=lambda t: t.max_rel, default=at_step[0])
    factory = case.optimizer_factory
    optimizer = getattr(getattr(factory, "func", factory), "__name__", type(factory).__name__)
    return {"phase": "optimizer", "module": worst.name, "module_type": None, "op": f"{optimizer}.step",
            "rank": None, "step": step, "max_abs": worst.max_abs, "max_rel": worst.max_rel,
            "tolerance": {"rtol": worst.tolerance.rtol, "atol": worst.tolerance.atol, "of": "each element"},
            "compared": f"every gradient of step {step} matches; {len([t for t in at_step if t.kind == 'param'])} "
                        "parameters after the update do not"}


def _activation_backward_location(comparison: CompareResult, probe: ProbeData | None, case: Case) -> dict[str, Any] | None:
    """Step 0's loss matches and some of its gradients do not: the probed micro-batch's
    backward on each rank against the reference's on the same inputs and targets, by the
    gradients of the module outputs in the order they arrived (the model's output first). A
    rank's loss weight (1/N, 1/micro-batches, a token share) scales all of them alike, so the
    scale is fitted where the backward starts (the first gradient compared, the model's
    output's) and every later one is compared with the reference's times that scale, by its
    placement as the forward's outputs are. The first that departs is where the backward left
    the reference: in the backward of what consumed that output, between the last gradient
    that matched and it. A gradient of a whole (replicated) activation that matches only summed
    over the tensor-parallel group is a partial sum no all-reduce completed: every backward is
    linear in its incoming gradient, so it stays partial upstream and never "departs" by
    itself; the first such gradient is the location. A scale or sync bug after the backward
    leaves every activation gradient right: no location from here."""
    first_step = _first_failing_step(comparison)
    if probe is None or first_step is None or first_step[0] != probe.step:
        return None
    step, at_step = first_step
    if any(t.kind == "loss" and not t.passed for t in at_step) or not any(t.kind == "grad" and not t.passed for t in at_step):
        return None
    rtol, atol = _tolerance(case.dtype)
    by_rank = {r["rank"]: r for r in probe.ranks}
    if probe.step > 0 and any(c.p for r in probe.ranks for c in r["captures"].values()):
        return None  # a later step's backward goes through masks the replay cannot draw alike
    first: dict[str, Any] | None = None
    for rank, entry in sorted(by_rank.items()):
        order = entry.get("grad_order") or []
        if not order or entry["input"] is None or entry["stages"] not in (None, [0]):
            continue
        ref = reference_grads(probe, rank, case)
        if not ref:
            continue
        coord, group = _tp(entry)
        scale: float | None = None
        last_within: str | None = None
        for position, name in enumerate(order):
            cap = entry["captures"].get(name)
            if name not in ref or cap is None or cap.grad is None:
                continue

            def group_sum(name: str = name, cap: Any = cap) -> torch.Tensor | None:
                return _group_sum(by_rank, group, name, cap.grad.shape, "grad")

            if scale is None:
                pieces = _corresponding(cap.grad, cap.grad_placements, ref[name], coord, group, group_sum)
                if pieces is None:
                    continue
                held, expected = pieces[0].double(), pieces[1].double()
                norm = float((expected * expected).sum())
                if norm == 0.0:
                    break  # no gradient reaches this rank's output (it computes no loss)
                scale = float((held * expected).sum()) / norm
            judged = _judge(cap.grad, cap.grad_placements, ref[name] * scale, coord, group, group_sum, rtol, atol)
            if judged is None:
                continue
            declared_partial = _placement_kind(cap.grad_placements)[0] == "partial"
            if judged.status == "partial" and not declared_partial and _same_on_every_rank(cap.grad, group_sum(), group, rtol, atol):
                # Every rank holds the same 1/N of the reference's: not a split awaiting its
                # all-reduce but a value scaled where it should not be (averaged, not summed).
                judged = _Judged("departs", judged.max_abs, judged.max_rel, f"whole (every rank of {group} holds 1/{len(group)} of it)")
            if judged.status == "within" or (judged.status == "partial" and declared_partial):
                # The model's output is often its last module's output too (one tensor, two
                # names): the module names where the backward is.
                last_within = name if name != OUTPUT or last_within is None else last_within
                continue
            if first is not None and position >= first["position"]:
                break
            # None: the very first gradient compared is not the reference's up to a scale - the
            # loss's own backward departs.
            after = "<loss>" if last_within is None else "<model output>" if last_within == OUTPUT else last_within
            found = {"phase": "backward", "module": after, "module_type": None, "op": None, "rank": rank, "step": probe.step,
                     "grad_of": "<model output>" if name == OUTPUT else name, "max_abs": judged.max_abs,
                     "max_rel": judged.max_rel, "tolerance": {"rtol": rtol, "atol": atol, "of": "max |reference gradient|"},
                     "compared": f"{judged.compared}, against the reference's times {scale:.6g} (this rank's loss weight, "
                                 "fitted where its backward starts)",
                     "loss_scale": scale, "position": position, "activation": True}
            held_module = entry["captures"].get(after)
            if held_module is not None:
                found["module_type"] = held_module.module_type
            if judged.status == "partial":
                found["partial_over"] = group
            try:
                node = _backward_op(probe, case, rank, last_within, name, partial=judged.status == "partial",
                                    scale=scale, rtol=rtol, atol=atol)
                if "max_abs" in node:
                    found["module_max_abs"] = found["max_abs"]
                found.update(node)
            except Exception as exc:  # noqa: BLE001 - the stretch of modules is evidence enough without its node
                found["op_note"] = f"the node of the backward was not located: {type(exc).__name__}: {exc}"
            first = found
            break
    if first is None:
        return None
    first.pop("position")
    return first


def _same_on_every_rank(local: torch.Tensor, summed: torch.Tensor | None, group: list[int], rtol: float, atol: float) -> bool:
    """This rank's value equals the group's mean: with the group's sum right, each rank holds
    the same share (a whole scaled by 1/N), not a piece of a sum."""
    return summed is not None and len(group) > 1 and _difference(local, summed / len(group), rtol, atol)[0]


def _stretch(events: list[OpCapture], after: str | None, until: str) -> list[OpCapture] | None:
    """The nodes of a backward log between the arrival of ``after``'s output gradient (None:
    the start) and ``until``'s; None where a marker is missing."""
    marks = {e.module: i for i, e in reversed(list(enumerate(events))) if e.op == GRAD_MARKER}
    if until not in marks or (after is not None and after not in marks):
        return None
    start = marks[after] + 1 if after is not None else 0
    return [e for e in events[start:marks[until]] if e.op != GRAD_MARKER]


def _backward_op(probe: ProbeData, case: Case, rank: int, after: str | None, until: str, *, partial: bool, scale: float,
                 rtol: float, atol: float) -> dict[str, Any]:
    """The autograd node where the backward departs, between the gradients of ``after``'s and
    ``until``'s outputs: the rank's nodes there (:class:`harness.record.probe.BackwardLog`)
    aligned with the reference's by name as the forward's ops are, each node's gradient along
    the activation path compared with the reference's times ``scale``, by its placement. For a
    departure, the first node beyond the rule; for a partial sum, the node where the gradient
    first matches only summed over the group, and the last node of the stretch, which passed
    it on unreduced."""
    by_rank = {r["rank"]: r for r in probe.ranks}
    entry = by_rank[rank]
    held = _stretch(entry.get("backward_ops") or [], after, until)
    ref = _stretch(reference_backward(probe, rank, case), after, until)
    if not held or ref is None:
        return {"op_note": "no backward node log of this stretch"}
    coord, group = _tp(entry)
    peers = {r: _keyed(by_rank[r].get("backward_ops") or []) for r in group if r in by_rank}
    keys = {id(o): k for k, o in _keyed(entry.get("backward_ops") or []).items()}

    def peer_sum(op: OpCapture) -> torch.Tensor | None:
        return _summed([peers[r].get(keys[id(op)]) for r in group if r in peers], op.output.shape)

    rows: list[dict[str, Any]] = []
    partial_at: OpCapture | None = None
    for mine, theirs, how in _aligned(held, ref):
        judged = _judge(mine.output, mine.placements, theirs.output * scale, coord, group, lambda: peer_sum(mine), rtol, atol)
        if judged is None:
            continue
        if judged.status == "partial" and _placement_kind(mine.placements)[0] != "partial" and \
                _same_on_every_rank(mine.output, peer_sum(mine), group, rtol, atol):
            judged = _Judged("departs", judged.max_abs, judged.max_rel, f"whole (every rank of {group} holds 1/{len(group)} of it)")
        rows.append({"op": mine.op, "module": f"backward after {after or 'the loss'}", "reference_op": theirs.op,
                     "status": judged.status, "max_abs": judged.max_abs, "compared": judged.compared, "aligned": how})
        if judged.status == "departs" and not partial:
            return {"op": mine.op, "op_module": until, "op_placements": mine.placements, "ops_compared": len(rows),
                    "op_rows": rows[-12:], "max_abs": judged.max_abs, "max_rel": judged.max_rel,
                    "compared": f"{judged.compared}, against the reference's {theirs.op} times {scale:.6g}; node aligned {how}"}
        if judged.status == "partial" and partial and partial_at is None and _placement_kind(mine.placements)[0] != "partial":
            partial_at = mine
    if partial and partial_at is not None:
        last = held[-1]
        return {"op": last.op, "op_module": until, "op_placements": last.placements, "ops_compared": len(rows),
                "op_rows": rows[-12:], "partial_from": partial_at.op,
                "passed_unreduced": [o.op for o in held[held.index(partial_at) + 1:]]}
    paired = {id(mine) for mine, _, _ in _aligned(held, ref)}
    if not partial and id(held[-1]) not in paired:
        # Every node aligned with the reference's matches (or is a partial sum on its way), and
        # the stretch's gradient departs: the node that produced it, one the reference has no
        # counterpart of (a hand-written Function's backward), is where.
        return {"op": held[-1].op, "op_module": until, "op_placements": held[-1].placements, "ops_compared": len(rows),
                "op_rows": rows[-12:], "unpaired": True}
    return {"op_note": f"no single node of the backward between {after or 'the loss'!r} and {until!r} departs by itself "
                       f"({len(rows)} compared)"}


def _backward_location(comparison: CompareResult) -> dict[str, Any] | None:
    """The first failing step's loss matches and only some of its gradients do not: the first
    failing one in backward order (the record's parameter order reversed: the last module's
    gradients are computed first, and a wrong backward in one module spoils its own gradients
    and those of every module before it). Every gradient off (a scale or sync bug after the
    backward) is no local departure: no location."""
    first_step = _first_failing_step(comparison)
    if first_step is None:
        return None
    step, at_step = first_step
    if any(t.kind == "loss" and not t.passed for t in at_step):
        return None
    grads = [t for t in at_step if t.kind == "grad"]
    failing = [t for t in grads if not t.passed]
    if not failing or len(failing) == len(grads):
        return None
    first = failing[-1]
    return {"phase": "backward", "module": first.name.rsplit(".", 1)[0] if "." in first.name else first.name,
            "module_type": None, "op": None, "rank": None, "step": step, "max_abs": first.max_abs, "max_rel": first.max_rel,
            "tolerance": {"rtol": first.tolerance.rtol, "atol": first.tolerance.atol, "of": "each element"},
            "compared": f"the gathered gradient of {first.name!r}, the first of {len(failing)} of {len(grads)} failing "
                        "gradients in backward order"}


def step_to_probe(comparison: CompareResult | None, probe: ProbeData | None, actual: Any = None,
                  reference: Any = None) -> int | None:
    """The first failing step, where it is after step 0 and a probe of it could say where the
    run departs: its loss fails (the forward or the loss computes something else from weights
    that matched after the step before), its samples are the reference's (else they are the
    location) and step 0's probe holds the run's forward (a pipeline's later stages, or a run
    the probe never saw, would hold nothing at that step either). None otherwise."""
    if comparison is None or comparison.passed or probe is None:
        return None
    first = _first_failing_step(comparison)
    if first is None or first[0] == 0:
        return None
    step, at_step = first
    if not any(t.kind == "loss" and not t.passed for t in at_step):
        return None
    if not any(r.get("captures") for r in probe.ranks) or _samples_location(comparison, actual, reference) is not None:
        return None
    return step


def reference_state(reference: Any, step: int) -> dict[str, torch.Tensor] | None:
    """The reference's parameters at the start of ``step`` (its record's after the step
    before); None where the record holds none."""
    try:
        return {name: tensor for name, tensor in reference.iter_tensors(step - 1, "param")} or None
    except Exception:  # noqa: BLE001 - a record without that step: the later probe is not replayed
        return None


def first_divergence_location(comparison: CompareResult | None, probe: ProbeData | None, case: Case | None,
                              actual: Any = None, reference: Any = None) -> dict[str, Any] | None:
    """Where a failed run departs (module docstring), or None: a passed run, or no evidence.
    ``actual`` and ``reference`` (the run's and the reference's records) give each step's
    sample ids."""
    if comparison is None or comparison.passed or case is None:
        return None
    matched: list[str] = []
    found = _samples_location(comparison, actual, reference)
    if found is not None:
        found["line"] = location_line(found)
        return found
    if probe is not None and probe.later is not None:
        # The first failing step came after step 0 and was probed on its own: its replay starts
        # from the reference's parameters after the step before.
        if probe.later.state is None and reference is not None:
            probe.later.state = reference_state(reference, probe.later.step)
        if probe.later.state is not None:
            probe = probe.later
    if probe is not None:
        found = _input_location(probe, case)
        if found is not None:
            found["line"] = location_line(found)
            return found
        found = _forward_location(probe, case, matched)
        if found is not None:
            found["line"] = location_line(found)
            return found
    found = (_loss_location(comparison, probe, case, matched) or _optimizer_location(comparison, case)
             or _activation_backward_location(comparison, probe, case) or _backward_location(comparison))
    if found is not None:
        found["line"] = location_line(found)
    return found


def location_line(loc: dict[str, Any]) -> str:
    """One sentence for the terminal."""
    if loc["phase"] == "optimizer":
        return (f"departs in the optimizer step of step {loc['step']} ({loc['op']}): {loc['compared']}; first "
                f"{loc['module']!r} (max abs {loc['max_abs']:.3g})")
    if loc["phase"] == "input" and loc["module"] == "<data>":
        again = ""
        if loc.get("same_as_reference_step") is not None:
            again = (f"; they are exactly the reference's step {loc['same_as_reference_step']} batch (an epoch order "
                     "repeated: is the sampler's set_epoch called?)" if loc["same_as_reference_step"] < loc["step"] else
                     f"; they are exactly the reference's step {loc['same_as_reference_step']} batch")
        return f"departs before the model, in the samples it read, at step {loc['step']}: {loc['compared']}{again}"
    if loc["phase"] == "input":
        return (f"departs before the model, in its input, at step {loc['step']} on rank {loc['rank']}: {loc['compared']} differ by "
                f"max abs {loc['max_abs']:.3g} (an augmentation, noise or cast applied to the batch)")
    if loc["phase"] == "loss":
        where = "in the loss computation after the model's forward" if loc.get("model_output_compared") else \
            f"between {loc['module'].removeprefix('after ')!r} and the loss (the model's output itself could not be compared)"
        return f"departs {where} at step {loc['step']} on rank {loc['rank']}: {loc['compared']}"
    if loc["phase"] == "backward" and loc.get("activation"):
        if loc["module"] == "<loss>":
            return (f"departs in the backward of step {loc['step']} on rank {loc['rank']}, in the loss's own backward: the gradient "
                    f"of {loc['grad_of']!r}'s output is not the reference's up to a scale (max abs {loc['max_abs']:.3g}), "
                    f"compared with the reference's {loc['compared']}")
        after = "the model's output" if loc["module"] == "<model output>" else repr(loc["module"])
        what = (f"is a partial sum over the tensor-parallel group {loc['partial_over']} (the reference's only summed): "
                "an all-reduce of the backward is missing there" if loc.get("partial_over") else
                f"departs by max abs {loc['max_abs']:.3g} ({loc['max_rel']:.3g} of its largest value; allowed rtol "
                f"{loc['tolerance']['rtol']:.3g}, atol {loc['tolerance']['atol']:.3g} of it)")
        node = ""
        if loc.get("op") and loc.get("partial_from"):
            through = f", then through {', '.join(loc['passed_unreduced'])}" if loc.get("passed_unreduced") else ""
            node = f"; the gradient is a partial sum from node {loc['partial_from']} on{through}: {loc['op']} passes it on unreduced"
        elif loc.get("op") and loc.get("unpaired"):
            node = (f"; every node aligned with the reference's matches, and {loc['op']} (the reference has no such node) "
                    "produced the departing gradient")
        elif loc.get("op"):
            node = f"; the first node beyond the rule: {loc['op']}"
        elif loc.get("op_note"):
            node = f" ({loc['op_note']})"
        return (f"departs in the backward of step {loc['step']} on rank {loc['rank']}, after the gradient of {after}'s output (it "
                f"matches): the gradient of {loc['grad_of']!r}'s output {what}, compared with the reference's "
                f"{loc['compared']}{node}")
    if loc["phase"] == "backward":
        return (f"departs in the gradients of step {loc['step']} at module {loc['module']!r}: {loc['compared']} "
                f"(max abs {loc['max_abs']:.3g}); the loss and the gradients of the modules after it match")
    if loc.get("eval_mode"):
        return (f"departs in the forward of step {loc['step']} at module {loc['module']!r} ({loc['module_type']}) on rank "
                f"{loc['rank']}: it ran in eval mode (no mask drawn) where the reference trains it - a model.eval() "
                "not undone by model.train()?")
    tol = loc["tolerance"]
    at = f"module {loc['module']!r} ({loc['module_type']})"
    if loc.get("op"):
        inner = "" if loc.get("op_module") in (None, loc["module"]) else f" (in {loc['op_module']!r})"
        at = f"op {loc['op']}{inner} of {at}"
        if loc.get("inline_before"):
            at += f", inline in its forward before its submodule {loc['inline_before']!r}"
    if loc.get("consumed_by"):
        return (f"departs in the forward of step {loc['step']} at {at} on rank {loc['rank']}: "
                f"its output is a partial sum over the tensor-parallel group {loc['partial_over']} (the reference's only "
                f"summed), used unreduced - {loc['consumed_by']!r} departs next, by max abs {loc['max_abs']:.3g} "
                f"({loc['max_rel']:.3g} of its largest value; allowed rtol {tol['rtol']:.3g}, atol {tol['atol']:.3g} of it)")
    line = (f"departs in the forward of step {loc['step']} at {at} on rank {loc['rank']}: "
            f"max abs {loc['max_abs']:.3g} ({loc['max_rel']:.3g} of the output's largest value; allowed rtol {tol['rtol']:.3g}, "
            f"atol {tol['atol']:.3g} of it), compared with the reference's {loc['compared']}")
    if loc.get("after_partial"):
        p = loc["after_partial"]
        line += (f"; its input, {p['op']} in {p['module']!r}, is a partial sum over the tensor-parallel group {p['over']} "
                 "that was never reduced before it")
    if loc.get("after_collective"):
        c = loc["after_collective"]
        line += f"; the collective before it: {c['op']} in {c['module']!r}"
    return line + (f" ({loc['op_note']})" if loc.get("op_note") else "")
