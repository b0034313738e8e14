"""Where a failing run departs before or in the forward: the probed forward's input, its module
outputs and the ops inside the first that departs, and the loss computed from a forward that
matched (see :mod:`harness.analysis.divergence`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from reference.case import Case

from harness.analysis.compare import CompareResult
from harness.analysis.divergence.steps import first_failing_step
from harness.analysis.divergence.values import Judged, aligned, corresponding, difference, group_sum, judge, peer_sum, tolerance, tp_of
from harness.analysis.probe_checks import reference_loss, reference_loss_ops, reference_masked, reference_ops, reference_outputs
from harness.record.probe import LOSS, OUTPUT, OpCapture, ProbeData

__all__ = ["forward_location", "input_location", "loss_location"]


def input_location(probe: ProbeData, case: Case) -> dict[str, Any] | None:
    """A loop that reads its own batches fed the model something other than the samples it
    reported (run.loss's ids) in its first forward: an augmentation, noise, a wrong cast. The
    values depart before the model; the first such rank."""
    from reference.case import tensors_in

    rtol, atol = tolerance(case.dtype)
    for entry in sorted(probe.ranks, key=lambda r: r["rank"]):
        held, expected = entry.get("input"), entry.get("expected_input")
        if held is None or expected is None:
            continue
        pairs = list(zip(tensors_in(held), tensors_in(expected)))
        if len(tensors_in(held)) != len(tensors_in(expected)) or any(a.shape != b.shape for a, b in pairs):
            continue  # another structure than the case's batches: not comparable
        for a, b in pairs:
            if a.is_floating_point() or b.is_floating_point():
                within, max_abs, max_rel = difference(a.float(), b.float(), rtol, atol)
            else:
                within, max_abs, max_rel = torch.equal(a, b), float((a != b).sum()), 0.0
            if not within:
                return {"phase": "input", "module": "<model input>", "module_type": None, "op": None, "rank": entry["rank"],
                        "step": probe.step, "max_abs": max_abs, "max_rel": max_rel,
                        "tolerance": {"rtol": rtol, "atol": atol, "of": "max |samples|"},
                        "compared": f"the input of rank {entry['rank']}'s first forward against the collated samples it "
                                    f"reported ({len(entry['ids'])} ids: {entry['ids'][:4]}{'...' if len(entry['ids']) > 4 else ''})"}
    return None


def forward_location(data: ProbeData, case: Case, matched: list[str] | None = None) -> dict[str, Any] | None:
    """The first module whose output departs (module docstring), with its op; None when none
    does. ``matched`` (when given) receives, in order, the modules whose output was compared
    and matched on every probed rank."""
    rtol, atol = tolerance(case.dtype)
    by_rank = {r["rank"]: r for r in data.ranks}
    first: dict[str, Any] | None = None
    compared_on: dict[str, int] = {}
    held_on: dict[str, int] = {}  # how many probed ranks hold each module compared (a pipeline: one stage's)
    for rank, entry in sorted(by_rank.items()):
        stage = _stage_of(entry)
        if entry["input"] is None or (stage > 0 and entry.get("expected_input") is not None):
            continue  # a later stage whose kept input is its own forward's (an activation), not the micro-batch
        ref = reference_outputs(data, rank, case)  # the whole model on the micro-batch: every stage's modules
        coord, group = tp_of(entry)
        if stage > 0:
            found = _stage_input_location(by_rank, entry, stage, data.step, rtol, atol)
            if found is not None and (first is None or (stage, -1) < first["position"]):
                first = found
        last_stage = stage == max(_stage_of(e) for e in by_rank.values() if _same_pipeline(e, entry))
        # A later step: the dropouts whose mask the replay took from this rank, and the modules
        # where it drew numbers of its own (see below).
        masked, own_draws = reference_masked(data, rank, case) if data.step > 0 else (frozenset(), frozenset())
        pending: list[str] = []  # modules whose output matched only as a partial sum, not reduced since
        for position, name in enumerate(entry["order"]):
            cap = entry["captures"][name]
            if name not in ref or (name == OUTPUT and not last_stage):
                continue  # a stage's own output is no model output (before the last stage)
            position = (stage, position)
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
            if data.step > 0 and ((cap.p and name not in masked)
                                  or any(name in (OUTPUT, d) or d.startswith(name + ".") for d in own_draws)):
                # A later step's masks come from a generator state the replay does not have, and
                # this one's could not be taken from the rank (a sharded or functional dropout):
                # nothing from it on is compared (values, not draws, are sought here).
                break
            judged = judge(cap.output, cap.placements, ref[name], coord, group,
                            lambda: group_sum(by_rank, group, name, cap.output.shape), rtol, atol)
            if judged is None:
                continue
            held_on[name] = held_on.get(name, 0) + 1
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
        matched += [n for n, count in compared_on.items() if count == held_on.get(n)]
    if first is not None and first.get("stage_input"):
        first.pop("position")
        return first
    if first is not None and first.get("eval_mode"):
        first.pop("position")
        name = first.pop("_name")
        try:  # the op the reference runs there and the rank did not: its mask's draw
            skipped = [o.op for o in reference_ops(data, first["rank"], case) if o.module == name]
        except Exception:  # noqa: BLE001 - the module is evidence enough without its op
            skipped = []
        mine = {o.op for o in by_rank[first["rank"]].get("ops") or [] if o.module == name}
        missing = [op for op in skipped if op not in mine]
        if missing:
            first["op"], first["op_module"] = missing[0], name
            first["op_note"] = (f"the reference's first op in {name!r}; the rank ran none of its "
                                f"{', '.join(dict.fromkeys(missing))} there")
        return first
    if first is not None:
        first.pop("position")
        name = first.pop("_name")
        try:
            # A value a parent changed inline before the module, on any rank of its group (a
            # residual added twice on the last TP rank reaches every rank through the norm's
            # all-reduced statistics): that rank's extra op is where the values left.
            extra = None if name == OUTPUT or first.get("consumed_by") else next(
                (found for peer in _group_of(by_rank, first["rank"])
                 if (found := _extra_inline_departure(data, case, peer, name, rtol, atol)) is not None), None)
            op = extra if extra is not None else _op_location(data, case, first["rank"], "" if name == OUTPUT else name,
                                                              partial=bool(first.get("consumed_by")), rtol=rtol, atol=atol)
        except Exception as exc:  # noqa: BLE001 - the module is evidence enough without its op
            op = {"op_note": f"the op inside {first['module']!r} was not located: {type(exc).__name__}: {exc}"}
        if op.get("unpaired") and "rank" in op:
            first["rank"] = op.pop("rank")
        if "max_abs" in op:
            first["module_max_abs"] = first["max_abs"]
        if op.get("inline_before"):  # the parent's own code departed first: the location is the parent
            parent = "" if op["op_module"] == "<model output>" else op["op_module"]
            held = by_rank[first["rank"]]["captures"].get(parent or OUTPUT)
            first["module"], first["module_type"] = op["op_module"], held.module_type if held is not None else None
        first.update(op)
    return first


def _group_of(by_rank: dict[int, dict[str, Any]], rank: int) -> list[int]:
    """``rank`` and its tensor-parallel peers that were probed, ``rank`` first."""
    _, group = tp_of(by_rank[rank])
    return [rank, *sorted(r for r in group if r != rank and r in by_rank)]


def _extra_inline_departure(data: ProbeData, case: Case, rank: int, module: str, rtol: float,
                            atol: float) -> dict[str, Any] | None:
    """On ``rank``: an op a parent of ``module`` computed inline before it with no counterpart
    in the reference (name alignment left it unpaired) whose output is no longer the value the
    last matching parent op before it left - the reference's value there. Such an op changed a
    value that was right (a residual added twice); an unpaired op that leaves the value as it
    was (a copy, a cast back) is no departure. None where there is none."""
    by_rank = {r["rank"]: r for r in data.ranks}
    held_ops: list[OpCapture] = by_rank[rank].get("ops") or []
    first_own = next((i for i, o in enumerate(held_ops) if o.module == module or o.module.startswith(module + ".")), None)
    if not held_ops or first_own is None:
        return None
    ancestors = {".".join(module.split(".")[:i]) for i in range(len(module.split(".")))}
    whole = aligned(held_ops, reference_ops(data, rank, case))
    theirs_of = {id(m): t for m, t, _ in whole}
    ctx = _OpJudge.of(by_rank, rank, rtol, atol)
    last: tuple[OpCapture, OpCapture] | None = None
    for op in held_ops[:first_own]:
        if op.output is None or op.module not in ancestors:
            continue
        if id(op) in theirs_of:
            judged = ctx.judge(op, theirs_of[id(op)])
            last = (op, theirs_of[id(op)]) if judged is not None and judged.status == "within" else last
            continue
        if last is None or op.output.shape != last[0].output.shape:
            continue
        judged = ctx.judge(op, last[1])
        if judged is None or judged.status != "departs":
            continue
        after = [o.op for o in held_ops[held_ops.index(op):first_own] if o.output is not None and id(o) not in theirs_of
                 and o.module in ancestors]
        return {"op": op.op, "op_module": op.module or "<model output>", "rank": rank, "unpaired": True, "site": op.site,
                "inline_before": module, "last_matched": {"op": last[0].op, "module": last[0].module or "<model output>"},
                "unpaired_after": after[:8], "max_abs": judged.max_abs, "max_rel": judged.max_rel, "compared": judged.compared}
    return None


@dataclass
class _OpJudge:
    """How one rank's ops are judged against the reference's: by placement at the rank's
    tensor-parallel coordinate, a plain value also as a partial (sum, max) over its group."""

    coord: int | None
    group: list[int]
    peers_sum: Callable[[OpCapture], torch.Tensor | None]
    peers_max: Callable[[OpCapture], torch.Tensor | None]
    rtol: float
    atol: float

    @classmethod
    def of(cls, by_rank: dict[int, dict[str, Any]], rank: int, rtol: float, atol: float) -> "_OpJudge":
        held = by_rank[rank].get("ops") or []
        coord, group = tp_of(by_rank[rank])
        return cls(coord, group, peer_sum(by_rank, group, "ops", held), peer_sum(by_rank, group, "ops", held, reduce="max"),
                   rtol, atol)

    def judge(self, mine: OpCapture, theirs: OpCapture) -> Judged | None:
        return judge(mine.output, mine.placements, theirs.output, self.coord, self.group, lambda: self.peers_sum(mine),
                     self.rtol, self.atol, group_max=lambda: self.peers_max(mine))

    def comparable(self, mine: OpCapture, theirs: OpCapture) -> bool:
        return corresponding(mine.output, mine.placements, theirs.output, self.coord, self.group,
                             lambda: self.peers_sum(mine)) is not None


def _scan(ctx: _OpJudge, pairs: list[tuple[OpCapture, OpCapture, str]], held: list[OpCapture], scope: str, *,
          partial: bool = False,
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
        judged = ctx.judge(mine, theirs)
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
                 "op_index": index, "ops_compared": len(rows), "op_rows": rows[-12:], "site": mine.site}
        since = held[held.index(last_within) + 1:held.index(mine)] if last_within is not None else held[:held.index(mine)]
        if last_within is not None:
            where["last_matched"] = {"op": last_within.op, "module": last_within.module or "<model output>"}
        paired = {id(p[0]) for p in pairs}
        unpaired = [o.op for o in since if o.output is not None and id(o) not in paired]
        if unpaired:  # computed between the last op that matched and this one, with no reference counterpart
            where["unpaired_before"] = unpaired[:8]
        collective = next((o for o in reversed(since) if o.output is None), None)
        if collective is not None:
            where["after_collective"] = {"op": collective.op, "module": collective.module or "<model output>"}
        if partial_before is not None and not partial:
            where["after_partial"] = {"op": partial_before.op, "module": partial_before.module or "<model output>",
                                      "over": ctx.group}
        if partial:  # the module's figures (where the partial showed) stay; the op made the partial
            return {**where, "op_compared": f"{judged.compared}; op aligned {how}, {scope}"}, last_within
        return {**where, "max_abs": judged.max_abs, "max_rel": judged.max_rel,
                "compared": f"{judged.compared}; op aligned {how}, {scope}"}, last_within
    return None, last_within


def _stage_of(entry: dict[str, Any]) -> int:
    """The rank's first pipeline stage (0 without a pipeline)."""
    return min(entry["stages"]) if entry.get("stages") else 0


def _same_pipeline(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Both ranks are stages of one pipeline (or neither is in one)."""
    group = b["groups"].get("pp") or []
    return a["rank"] == b["rank"] or (a["rank"] in group and len(group) > 1)


def _stage_input_location(by_rank: dict[int, dict[str, Any]], entry: dict[str, Any], stage: int, step: int, rtol: float,
                          atol: float) -> dict[str, Any] | None:
    """A later pipeline stage whose first forward received another activation than the stage
    before it produced on the same micro-batch: the values depart between the stages (the send,
    the receive, a cast or a buffer between them), before any module of this stage."""
    sender = next((e for e in by_rank.values() if _same_pipeline(e, entry) and stage - 1 in (e.get("stages") or [])
                   and e.get("ids") == entry.get("ids")), None)
    sent = sender["captures"].get(OUTPUT) if sender is not None else None
    received = entry.get("forward_input")
    if sent is None or not isinstance(received, torch.Tensor) or received.shape != sent.output.shape:
        return None
    within, max_abs, max_rel = difference(received.float(), sent.output, rtol, atol)
    if within:
        return None
    return {"phase": "forward", "module": f"<input of pipeline stage {stage}>", "module_type": None, "op": None,
            "rank": entry["rank"], "step": step, "max_abs": max_abs, "max_rel": max_rel,
            "tolerance": {"rtol": rtol, "atol": atol, "of": "max |sent|"}, "position": (stage, -1), "stage_input": True,
            "sent_by": sender["rank"],
            "compared": f"the activation stage {stage} (rank {entry['rank']}) received for its first micro-batch against "
                        f"what stage {stage - 1} (rank {sender['rank']}) produced on the same samples"}


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
    ref_ops = reference_ops(data, rank, case)  # the forward's (the reference's loss ops are logged apart)
    ctx = _OpJudge.of(by_rank, rank, rtol, atol)
    if module and not partial:
        # What the module's parents compute inline before it (a norm written as plain calls in
        # a block's forward) reaches the module as its input: the first op of a parent that
        # departs before the module's own ops is where the values left the reference.
        ancestors = {".".join(module.split(".")[:i]) for i in range(len(module.split(".")))}
        first_own = next((i for i, o in enumerate(held_ops) if o.module == module or o.module.startswith(module + ".")), None)
        before = {id(o) for o in held_ops[:first_own]} if first_own is not None else set()
        whole = aligned(held_ops, ref_ops)
        found, _ = _scan(ctx, whole, held_ops, f"inline in the forward of a module containing {module!r}, before it",
                         only=lambda o: o.module in ancestors and id(o) in before)
        if found is not None:
            return {**found, "inline_before": module}
        paired = {id(p[0]) for p in whole}
        # What a parent computed inline before the module with no counterpart in the reference
        # (an activation a pipeline stage's forward adds): evidence beside the module's op.
        extra = [o.op for o in held_ops[:first_own or 0] if o.output is not None and o.module in ancestors
                 and id(o) not in paired]
    else:
        extra = []
    scopes = [("in the module itself", lambda m: m == module)]
    if module:
        scopes.append(("in its submodules", lambda m: m.startswith(module + ".")))
    else:  # the model's own forward: what it computes inline runs in the reference's submodules
        scopes.append(("in the whole forward, aligned regardless of modules", lambda m: m != LOSS))
    for scope, inside in scopes:
        held = [o for o in held_ops if inside(o.module)]
        ref = [o for o in ref_ops if inside(o.module)]
        pairs = aligned(held, ref)
        found, last_within = _scan(ctx, pairs, held, scope, partial=partial)
        if found is not None:
            return {**found, "inline_unpaired": extra[-8:]} if extra else found
        after = held[held.index(last_within) + 1:] if last_within is not None else held
        collective = next((o for o in after if o.output is None), None)
        if collective is not None and pairs:
            return {"op": collective.op, "op_module": collective.module or "<model output>",
                    "op_note": f"every computing op {scope} matches the reference ({len(pairs)} compared); the values "
                               f"change at this collective after {last_within.op if last_within else 'the start'}"}
    return {"op_note": f"no single op of {module or 'the model forward'!r} departs by itself "
                       "(the module's output does; ops compared by placement and aligned by name)"}


def _loss_op_location(data: ProbeData, case: Case, rank: int, rtol: float, atol: float) -> dict[str, Any]:
    """The first op of ``rank``'s loss (its ops after the model's forward, up to the loss it
    reported) that departs from the reference's loss on the same inputs and targets. The
    reference's loss is logged two ways - its composite ops (``_log_softmax``,
    ``nll_loss_forward``: a parallel loss that calls the same functions) and decomposed into
    the ops a hand-written loss is made of - and the rank's ops are read against the one under
    which more of them match. Where every compared op matches and the rank computes more
    after the last match (a label smoothing the reference has not), the first of those is the
    location, unpaired."""
    by_rank = {r["rank"]: r for r in data.ranks}
    entry = by_rank[rank]
    held = _up_to_the_loss([o for o in entry.get("ops") or [] if o.module == LOSS], entry.get("loss"))
    if not held:
        return {"op_note": "no op log of the loss (the model's forward was not logged, or the loss is computed inside it)"}
    ctx = _OpJudge.of(by_rank, rank, rtol, atol)
    best: tuple[int, str, list[tuple[OpCapture, OpCapture, str]]] | None = None
    for how, ref in reference_loss_ops(data, rank, case):
        pairs = _confirmed_by_value(ctx, aligned(held, ref), held, ref)
        matching = sum(1 for mine, theirs, _ in pairs if (j := ctx.judge(mine, theirs)) is not None and j.status != "departs")
        if best is None or matching > best[0]:
            best = (matching, how, pairs)
    if best is None:
        return {"op_note": "the reference's loss could not be logged on this rank's batch"}
    _, how, pairs = best
    scope = f"in the loss computed from the model's output, against the reference's loss {how}"
    found, last_within = _scan(ctx, pairs, held, scope)
    if found is not None:
        return found
    computing = [o for o in held if o.output is not None]
    after = computing[computing.index(last_within) + 1:] if last_within is not None else computing
    paired = {id(p[0]) for p in pairs}
    extra = [o for o in after if id(o) not in paired]
    if last_within is not None and extra:
        return {"op": extra[0].op, "op_module": LOSS, "unpaired": True, "site": extra[0].site,
                "last_matched": {"op": last_within.op, "module": LOSS}, "unpaired_after": [o.op for o in extra[:8]],
                "op_note": f"every op of the loss compared matches the reference's ({len(pairs)} compared, {scope}); after "
                           f"{last_within.op} the rank computes what the reference's loss has not: "
                           f"{', '.join(o.op for o in extra[:8])}"}
    return {"op_note": f"no single op of the loss departs by itself ({len(pairs)} compared, {scope})"}


def _up_to_the_loss(held: list[OpCapture], loss: torch.Tensor | None) -> list[OpCapture]:
    """A rank's loss ops up to the first one whose output is the loss it reported: what follows
    (``loss * run.loss_weight(batch)``, a copy for logging) is no part of the loss."""
    if loss is None:
        return held
    first = next((i for i, o in enumerate(held) if o.output is not None and o.output.numel() == 1
                  and torch.equal(o.output.reshape(()), loss.reshape(()).to(o.output.dtype))), None)
    return held if first is None else held[:first + 1]


def _confirmed_by_value(ctx: _OpJudge, pairs: list[tuple[OpCapture, OpCapture, str]], held: list[OpCapture],
                        ref: list[OpCapture]) -> list[tuple[OpCapture, OpCapture, str]]:
    """``pairs`` with the held ops that name alignment left unpaired paired "by value" where an
    unpaired reference op of the loss matches them by placement (a per-token loss written as
    ``lse - target_logit`` is the reference's ``neg`` of its gathered log-probability). Only a
    match pairs: an op no reference value confirms stays unpaired, never a departure."""
    pairs = [p for p in pairs if ctx.comparable(p[0], p[1])]  # a name paired with a value of another shape is no counterpart
    used = {id(p[0]) for p in pairs} | {id(p[1]) for p in pairs}
    candidates = [o for o in ref if o.output is not None and id(o) not in used]
    confirmed: dict[int, tuple[OpCapture, OpCapture, str]] = {}
    for mine in held:
        if mine.output is None or id(mine) in used:
            continue
        for theirs in candidates:
            if id(theirs) in used:
                continue
            judged = ctx.judge(mine, theirs)
            if judged is not None and judged.status in ("within", "partial"):
                confirmed[id(mine)] = (mine, theirs, f"by value (with the reference's {theirs.op})")
                used.add(id(theirs))
                break
    by_held = {id(p[0]): p for p in pairs} | confirmed
    return [by_held[id(o)] for o in held if id(o) in by_held]


def loss_location(comparison: CompareResult, probe: ProbeData | None, case: Case, matched: list[str]) -> dict[str, Any] | None:
    """Step 0's loss departs, every module output of the probed forward that could be compared
    matched on every rank, and a rank's own loss on its probed micro-batch departs from the
    reference's loss on the same inputs and targets: the values leave the reference after
    the model's forward (or after the last module compared), in the loss computation. A rank
    whose own loss matches the reference's on its own batch is no evidence of that: the step
    differs by what the ranks read (their samples, their per-replica statistics)."""
    first = first_failing_step(comparison)
    if probe is None or first is None or first[0] != probe.step or not matched:
        return None
    if not any(t.kind == "loss" and not t.passed for t in first[1]):
        return None
    rtol, atol = tolerance(case.dtype)
    worst: tuple[int, float, float, float, float] | None = None
    for entry in sorted(probe.ranks, key=lambda r: r["rank"]):
        held = entry.get("loss")
        if held is None or (_stage_of(entry) > 0 and entry.get("expected_input") is not None):
            continue
        expected = reference_loss(probe, entry["rank"], case)
        if expected is None or expected.numel() != 1:
            continue
        within, max_abs, max_rel = difference(held.reshape(()), expected.reshape(()), rtol, atol)
        if not within and (worst is None or max_abs > worst[1]):
            worst = (entry["rank"], max_abs, max_rel, float(held), float(expected))
    if worst is None:
        return None
    rank, max_abs, max_rel, held, expected = worst
    whole = OUTPUT in matched
    last = next((n for n in reversed(matched) if n != OUTPUT), None)
    after = "the model's output" if whole else f"module {last!r}, the last module output compared"
    found = {"phase": "loss", "module": LOSS if whole else f"after {last}", "module_type": None, "op": None,
             "rank": rank, "step": probe.step, "max_abs": max_abs, "max_rel": max_rel,
             "tolerance": {"rtol": rtol, "atol": atol, "of": "|reference loss|"},
             "compared": f"rank {rank}'s loss on its first micro-batch is {held:.6g}, the reference's on the same inputs and "
                         f"targets {expected:.6g}; the forward matches in every module output compared on every rank "
                         f"({len(matched)}, up to {after})",
             "matched_modules": len(matched), "model_output_compared": whole}
    if whole:
        # The op inside the loss: the rank's ops after its forward (before its backward) aligned
        # with the reference's loss decomposed into its ops (log_softmax as amax, sub, exp, sum,
        # log, sub), compared by placement - a local max or sum over a vocabulary shard is a
        # partial that an all-reduce completes, a padded shard is compared on its real rows.
        try:
            op = _loss_op_location(probe, case, rank, rtol, atol)
        except Exception as exc:  # noqa: BLE001 - the loss is evidence enough without its op
            op = {"op_note": f"the op inside the loss was not located: {type(exc).__name__}: {exc}"}
        if "max_abs" in op:
            op["op_max_abs"], op["op_max_rel"], op["op_compared"] = op.pop("max_abs"), op.pop("max_rel"), op.pop("compared")
        found.update(op)
    return found
