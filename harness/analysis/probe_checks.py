"""The activation probe's analysis, on the collecting rank: replay the reference model (same
weights, same step-0 state) on each rank's own captured input and compare module by module
with what the ranks captured (:mod:`harness.record.probe` records them):

- a module whose output on every rank of a tensor-parallel group differs from the reference,
  while the *sum* over the group equals it, is a row-parallel output used without its
  all-reduce: ``tp-partial-sum``;
- a dropout module whose inputs agree across a tensor-parallel group but whose outputs
  (masks) differ: ``rng-desync``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from reference.case import Case, map_tensors, tensors_in

from harness.codes import Diagnosis
from harness.record.probe import OUTPUT, BackwardLog, OpCapture, ProbeData, loss_op_log, module_outputs, op_log

__all__ = ["PROBE_ATOL", "PROBE_RTOL", "analyze_probe", "reference_backward", "reference_grads", "reference_loss", "reference_loss_ops", "reference_masked", "reference_ops", "reference_outputs"]

# The probe's rule, |a - e| <= rtol |e| + atol max|e| in float32: a forward reassociated across
# ranks moves values by ulps of their magnitude, a bug by orders more.
PROBE_RTOL, PROBE_ATOL = 2e-3, 2e-4


class Replay(NamedTuple):
    """The reference's forward (and backward) on one rank's probed micro-batch."""

    outputs: dict[str, torch.Tensor]  # module outputs by name
    ops: list[OpCapture]  # the forward's op log
    output: Any  # what the forward returned, detached
    grads: dict[str, torch.Tensor]  # module outputs' gradients, in arrival order (empty without targets)
    backward: list[OpCapture]  # the backward's node log with the gradients' arrival markers (BackwardLog)
    # The case's loss on the forward's output, logged two ways (how, ops): its composite ops as
    # they dispatch, and decomposed into the ops a hand-written loss is made of (module LOSS).
    loss_ops: list[tuple[str, list[OpCapture]]] = []
    # Dropout modules whose mask was the rank's own (a later step's draw, taken as an input),
    # and the modules where the replay drew numbers of its own all the same (a functional
    # dropout inside an attention): at a later step nothing from those on is the rank's.
    masked: frozenset[str] = frozenset()
    own_draws: frozenset[str] = frozenset()


def _replay_reference(case: Case, x: Any, targets: Any = None, state: dict[str, torch.Tensor] | None = None,
                      masks: dict[str, torch.Tensor] | None = None) -> Replay:
    """The reference model's module outputs, op log (:func:`harness.record.probe.op_log`),
    output of one forward on ``x`` (same weights, same step-0 state, the case's seed for
    dropout) and - with ``targets`` - each module output's gradient in the backward of the
    case's loss on them (unweighted: a rank's loss weight scales every one of its activation
    gradients alike), in the order they arrived, with that backward's node log. ``state``: the
    reference's parameters by name at a later step's start, loaded over the initial ones."""
    model = case.build_model("cpu")
    if state:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in state and state[name].shape == param.shape:
                    param.copy_(state[name])
    grads: dict[str, torch.Tensor] = {}
    backward = BackwardLog()
    masked: set[str] = set()
    handles = []
    for name, module in model.named_modules():
        mask = (masks or {}).get(name)
        if mask is None or not isinstance(module, torch.nn.modules.dropout._DropoutNd):
            continue

        def with_mask(module: torch.nn.Module, args: tuple, output: Any, name: str = name, mask: torch.Tensor = mask) -> Any:
            # A later step's mask came from a generator state this replay does not have: the
            # rank's own mask is an input of the step (the reference's values, its dropped
            # positions, the same scale).
            inp = args[0] if args else None
            if not isinstance(inp, torch.Tensor) or inp.shape != mask.shape or not module.training or module.p >= 1:
                return None
            masked.add(name)
            return inp * mask.to(inp.dtype) / (1 - module.p)

        handles.append(module.register_forward_hook(with_mask))

    def forward() -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(case.seed)
            return case.call_model(model, x)

    with torch.set_grad_enabled(targets is not None):
        ops, (outs, output) = op_log(model, lambda: module_outputs(model, forward, dtype=torch.float32, whole=OUTPUT,
                                                                     grads=grads if targets is not None else None,
                                                                     backward=backward if targets is not None else None))
        if targets is not None:
            try:
                case.compute_loss(output, targets).backward()
            except Exception:  # noqa: BLE001 - an output the loss cannot take: no backward to compare
                grads.clear()
                backward.events.clear()
    for h in handles:
        h.remove()
    detached = map_tensors(lambda t: t.detach(), output)
    loss_ops = []
    if targets is not None:  # where a loss computed outside the model departs
        for how, decompose in (("decomposed into its ops", True), ("as its composite ops", False)):
            try:
                loss_ops.append((how, loss_op_log(lambda: case.compute_loss(detached, targets), decompose=decompose)))
            except Exception:  # noqa: BLE001 - an output the loss cannot take: no loss ops to compare
                pass
    own_draws = frozenset(o.module for o in ops if o.draws and o.module not in masked)
    return Replay(outs, ops, detached, grads, backward.events, loss_ops, frozenset(masked), own_draws)


def _replayed(data: ProbeData, rank: int, case: Case) -> None:
    if rank not in data.replays:
        entry = next(r for r in data.ranks if r["rank"] == rank)
        data.replays[rank] = _replay_reference(case, entry["input"], entry.get("targets"), data.state,
                                               _rank_masks(entry) if data.step > 0 else None)


def _rank_masks(entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The kept positions of each dropout module the rank ran in training mode on the probed
    micro-batch, from its input and output (a position whose input was 0 is 0 either way)."""
    masks = {}
    for name, cap in entry["captures"].items():
        if cap.p and cap.training and cap.input is not None and cap.input.shape == cap.output.shape and cap.placements is None:
            masks[name] = (cap.output != 0) | (cap.input == 0)
    return masks


def reference_masked(data: ProbeData, rank: int, case: Case) -> tuple[frozenset[str], frozenset[str]]:
    """(the dropout modules whose mask the replay on ``rank`` took from the rank, the modules
    where it drew numbers of its own) - at a later step."""
    _replayed(data, rank, case)
    return data.replays[rank].masked, data.replays[rank].own_draws


def reference_outputs(data: ProbeData, rank: int, case: Case) -> dict[str, torch.Tensor]:
    """The reference's module outputs on ``rank``'s captured input, replayed once per probe."""
    _replayed(data, rank, case)
    return data.replays[rank].outputs


def reference_ops(data: ProbeData, rank: int, case: Case) -> list[OpCapture]:
    """The reference's op log on ``rank``'s captured input (the same replay)."""
    _replayed(data, rank, case)
    return data.replays[rank].ops


def reference_loss_ops(data: ProbeData, rank: int, case: Case) -> list[tuple[str, list[OpCapture]]]:
    """The reference's loss ops on ``rank``'s probed micro-batch (the same replay), as
    (how it was logged, ops): composite, and decomposed; empty without targets."""
    _replayed(data, rank, case)
    return data.replays[rank].loss_ops


def reference_grads(data: ProbeData, rank: int, case: Case) -> dict[str, torch.Tensor]:
    """The reference's module-output gradients on ``rank``'s probed micro-batch, in arrival
    order (the same replay); empty without targets."""
    _replayed(data, rank, case)
    return data.replays[rank].grads


def reference_backward(data: ProbeData, rank: int, case: Case) -> list[OpCapture]:
    """The reference's backward node log on ``rank``'s probed micro-batch (the same replay)."""
    _replayed(data, rank, case)
    return data.replays[rank].backward


def reference_loss(data: ProbeData, rank: int, case: Case) -> torch.Tensor | None:
    """The reference's loss on ``rank``'s probed micro-batch (its inputs and targets), as the
    case's loss_fn returns it; None without targets."""
    entry = next(r for r in data.ranks if r["rank"] == rank)
    if entry.get("targets") is None or entry.get("input") is None:
        return None
    _replayed(data, rank, case)  # the same replay's output: one forward per rank for every check
    with torch.no_grad():
        return case.compute_loss(data.replays[rank].output, entry["targets"]).detach().float()


def _same_values(a: Any, b: Any) -> bool:
    """Two inputs (tensors, or dicts / tuples of them) hold equal tensors."""
    ta, tb = tensors_in(a), tensors_in(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    scale = max(float(b.abs().max()), 1e-6) if b.numel() else 1.0
    return bool(torch.allclose(a, b, rtol=PROBE_RTOL, atol=PROBE_ATOL * scale))


def _partial_sum(locals_: list[torch.Tensor], expected: torch.Tensor) -> bool:
    """The ranks' outputs differ from each other and add up to the reference, up to a
    per-feature constant (a bias added on every rank before the missing reduction)."""
    if all(_close(t, locals_[0]) for t in locals_[1:]):
        return False
    diff = torch.stack(locals_).sum(0) - expected
    # Judged against the output's own magnitude: without a bias the difference is rounding
    # only, and a tolerance scaled by that difference would call rounding a mismatch.
    atol = PROBE_ATOL * max(float(expected.abs().max()) if expected.numel() else 0.0, 1e-6)
    if expected.dim() == 0:
        return bool(diff.abs().max() <= atol)
    flat = diff.reshape(-1, diff.shape[-1])
    return bool(torch.allclose(flat, flat.mean(0, keepdim=True).expand_as(flat), rtol=PROBE_RTOL, atol=atol))


def _tp_groups(data: ProbeData) -> list[list[int]]:
    groups = []
    for r in data.ranks:
        g = r["groups"].get("tp")
        if g and len(g) > 1 and sorted(g) not in groups:
            groups.append(sorted(g))
    return groups


def analyze_probe(data: ProbeData | None, case: Case) -> list[Diagnosis]:
    """``tp-partial-sum`` and ``rng-desync`` from the captures (see the module docstring)."""
    if data is None:
        return []
    by_rank = {r["rank"]: r for r in data.ranks}
    out: list[Diagnosis] = []

    def reference_for(rank: int) -> dict[str, torch.Tensor] | None:
        entry = by_rank[rank]
        if entry["input"] is None or (entry["stages"] not in (None, [0])):
            return None  # later pipeline stages do not see the model input
        return reference_outputs(data, rank, case)

    for group in _tp_groups(data):
        members = [by_rank[r] for r in group if r in by_rank]
        order = members[0]["order"]
        # rng-desync: a dropout whose inputs agree across the group but whose outputs differ.
        for name in order:
            caps = [m["captures"].get(name) for m in members]
            if any(c is None for c in caps) or caps[0].p is None or not caps[0].p:
                continue
            if any(c.input is None or c.input.shape != caps[0].input.shape for c in caps):
                continue
            same_in = all(_close(c.input, caps[0].input) for c in caps[1:])
            masks = [(c.output == 0) for c in caps]
            same_mask = all(torch.equal(m, masks[0]) for m in masks[1:])
            if same_in and not same_mask:
                differing = float((masks[0] != masks[1]).float().mean()) if len(masks) > 1 else 0.0
                out.append(
                    Diagnosis(
                        "rng-desync",
                        f"dropout {name!r} drew different masks on tensor-parallel ranks {group} for the same input",
                        {"module": name, "ranks": group, "p": caps[0].p, "fraction_of_mask_differing": differing,
                         "likely_source": "the ranks of a tensor-parallel group seed or advance their RNG differently (e.g. seeding with the rank)"},
                    )
                )
                break
        # tp-partial-sum: outputs differ from the reference, their sum over the group matches.
        refs = [reference_for(r) for r in group]
        if any(ref is None for ref in refs):
            continue
        inputs_agree = all(_same_values(m["input"], members[0]["input"]) for m in members[1:])
        if not inputs_agree:
            continue
        ref = refs[0]
        final = [m["captures"].get(OUTPUT) for m in members]
        if OUTPUT in ref and all(c is not None for c in final) and all(_close(c.output, ref[OUTPUT]) for c in final):
            continue  # the model's output is right on every rank: whatever is partial inside gets reduced later
        for name in order:
            caps = [m["captures"].get(name) for m in members]
            # The model's own output comes last: a row-parallel matmul written inline in the
            # model's forward (no submodule of its own) shows there and nowhere before.
            if name not in ref or any(c is None for c in caps) or caps[0].p:
                continue
            expected = ref[name]
            locals_ = [c.output for c in caps]
            if any(t.shape != expected.shape for t in locals_):
                continue  # a shard, not a full output
            if all(_close(t, expected) for t in locals_):
                continue
            if _partial_sum(locals_, expected):
                where = "the model's own forward (its output)" if name == OUTPUT else f"module {name!r}"
                out.append(
                    Diagnosis(
                        "tp-partial-sum",
                        f"{where}: each tensor-parallel rank's output is a partial sum; summed over ranks {group} it gives the reference's",
                        {"module": name, "ranks": group, "module_type": caps[0].module_type,
                         "max_abs_error_per_rank": [float((t - expected).abs().max()) for t in locals_],
                         "likely_source": "a row-parallel layer's output used without its all-reduce over the tensor-parallel group"},
                    )
                )
            break  # only the first module that differs from the reference is evidence
    return out
