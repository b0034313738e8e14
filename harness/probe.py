"""Activation probe: module outputs of the first forward, on every rank, against the reference.

Gradients tell *that* a forward was wrong; module outputs tell *where*. The probe wraps a
strategy (:class:`ProbedStrategy`), hooks every submodule during the first micro-batch of step
0, and keeps each module's local output (plus the inputs of dropout modules). After the run the
ranks send their captures to one rank (:func:`collect_probe`), which replays the reference
model - same weights, same step-0 state - on each rank's own input and compares module by
module (:func:`analyze_probe`):

- a module whose output on every rank of a tensor-parallel group differs from the reference,
  while the *sum* over the group equals it, is a row-parallel output used without its
  all-reduce: ``tp-partial-sum``;
- a dropout module whose inputs agree across a tensor-parallel group but whose outputs
  (masks) differ: ``rng-desync``.

Only tensors up to ``max_numel`` elements are kept; the probe is for the small models of
correctness tests, not for production-size activations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from reference.case import Batch, Case, map_tensors, tensors_in

from .codes import Diagnosis
from .gather import reference_name

__all__ = ["OUTPUT", "ActivationProbe", "ProbeData", "ProbedStrategy", "analyze_probe", "collect_probe"]

OUTPUT = "<output>"  # capture name of the whole model's output


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _first_tensor(value: Any, depth: int = 0) -> Any:
    """The first tensor in a module's output: the tensor itself, or depth first through
    tuples, lists and mappings (a Hugging Face ``ModelOutput`` is an ordered mapping whose
    first tensor is ``loss`` when labels were given, else ``logits``); None when there is none."""
    if isinstance(value, torch.Tensor):
        return value
    if depth > 4:
        return None
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        found = _first_tensor(item, depth + 1)
        if found is not None:
            return found
    return None


@dataclass
class Capture:
    module_type: str
    output: torch.Tensor
    placements: str | None = None  # DTensor placements of the output, None for plain tensors
    replicated: bool = True  # a DTensor output whose placements are all Replicate, or a plain tensor
    input: torch.Tensor | None = None  # kept for dropout modules only
    p: float | None = None  # dropout probability


class ActivationProbe:
    """Forward hooks that keep the first output of every submodule (call :meth:`attach`
    before the forward, :meth:`detach` after)."""

    def __init__(self, max_numel: int = 1 << 20):
        self.max_numel = max_numel
        self.captures: dict[str, Capture] = {}
        self.order: list[str] = []
        self.input: torch.Tensor | None = None
        self._handles: list[Any] = []

    def attach(self, models: list[nn.Module]) -> None:
        for i, model in enumerate(models):
            for raw, module in model.named_modules():
                if module is model or not raw:
                    continue
                name = reference_name(model, raw)
                self._handles.append(module.register_forward_hook(self._hook(name)))
            if len(models) == 1:  # the model's own output (pipeline chunks have none of their own)
                self._handles.append(model.register_forward_hook(self._hook(OUTPUT)))

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if name in self.captures:
                return
            out = _first_tensor(output)
            if out is None or out.numel() > self.max_numel:
                return
            placements = None
            replicated = True
            if _is_dtensor(out):
                placements = str(tuple(out.placements))
                replicated = all(type(p).__name__ == "Replicate" for p in out.placements)
                out = out.to_local()
            cap = Capture(type(module).__name__, out.detach().float().cpu().clone(), placements, replicated)
            if isinstance(module, nn.modules.dropout._DropoutNd):
                inp = _first_tensor(args)
                if inp is not None:
                    inp = inp.to_local() if _is_dtensor(inp) else inp
                    cap.input = inp.detach().float().cpu().clone()
                cap.p = float(module.p)
            self.captures[name] = cap
            self.order.append(name)

        return hook

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class ProbedStrategy:
    """Wraps a strategy; probes the first micro-batch of its first forward/backward. Behaves
    exactly like the wrapped strategy otherwise (same name, same steps)."""

    def __init__(self, inner: Any, probe: ActivationProbe | None = None):
        self.inner = inner
        self.name = inner.name
        self.probe = probe or ActivationProbe()
        self.layout: Any = None
        self._done = False

    def setup(self, case: Case, ctx: Any) -> Any:
        setup = self.inner.setup(case, ctx)
        self.layout = setup.layout
        return setup

    def local_batches(self, case: Case, setup: Any, step: int) -> list[Batch]:
        return self.inner.local_batches(case, setup, step)

    def forward_backward(self, case: Case, setup: Any, micro_batches: list[Batch]) -> list[Any]:
        if self._done or not micro_batches:
            return self.inner.forward_backward(case, setup, micro_batches)
        self._done = True
        models = [setup.model] if isinstance(setup.model, nn.Module) else list(setup.model)
        self.probe.input = map_tensors(lambda t: t.detach().cpu().clone(), micro_batches[0].inputs)
        self.probe.attach(models)
        try:
            return self.inner.forward_backward(case, setup, micro_batches)
        finally:
            self.probe.detach()

    def optimizer_step(self, case: Case, setup: Any) -> None:
        self.inner.optimizer_step(case, setup)

    def __getattr__(self, name: str) -> Any:  # anything else the wrapped strategy offers
        return getattr(self.inner, name)


@dataclass
class ProbeData:
    """Every rank's captures, on the rank that collected them."""

    ranks: list[dict[str, Any]] = field(default_factory=list)


def collect_probe(strategy: Any, dst: int = 0) -> ProbeData | None:
    """Collective: send every rank's captures to ``dst`` (returns them there, None elsewhere).
    ``strategy``: a :class:`ProbedStrategy`, or anything with its ``layout`` and ``probe`` (a
    custom loop's ``CustomRun``)."""
    layout = strategy.layout
    mine = {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "mesh": dict(layout.mesh) if layout is not None else {},
        "groups": {k: list(v) for k, v in layout.groups.items()} if layout is not None else {},
        "stages": list(layout.stages) if layout is not None and layout.stages is not None else None,
        "input": strategy.probe.input,
        "order": strategy.probe.order,
        "captures": strategy.probe.captures,
    }
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ProbeData([mine])
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(mine, out, dst=dst)
    return ProbeData(list(out)) if out is not None else None


# -- analysis (on the collecting rank) ------------------------------------------------------


def _reference_outputs(case: Case, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model = case.build_model("cpu")
    outs: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(module: nn.Module, args: tuple, output: Any, name: str = name) -> None:
            t = _first_tensor(output)
            if t is not None and name not in outs:
                outs[name] = t.detach().float().clone()

        handles.append(module.register_forward_hook(hook))
    def whole(module: nn.Module, args: tuple, output: Any) -> None:
        t = _first_tensor(output)
        if t is not None:
            outs.setdefault(OUTPUT, t.detach().float().clone())

    handles.append(model.register_forward_hook(whole))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(case.seed)
            case.call_model(model, x)
    finally:
        for h in handles:
            h.remove()
    return outs


def _same_values(a: Any, b: Any) -> bool:
    """Two inputs (tensors, or dicts / tuples of them) hold equal tensors."""
    ta, tb = tensors_in(a), tensors_in(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    scale = max(float(b.abs().max()), 1e-6) if b.numel() else 1.0
    return bool(torch.allclose(a, b, rtol=2e-3, atol=2e-4 * scale))


def _partial_sum(locals_: list[torch.Tensor], expected: torch.Tensor) -> bool:
    """The ranks' outputs differ from each other and add up to the reference, up to a
    per-feature constant (a bias added on every rank before the missing reduction)."""
    if all(_close(t, locals_[0]) for t in locals_[1:]):
        return False
    diff = torch.stack(locals_).sum(0) - expected
    # Judged against the output's own magnitude: without a bias the difference is rounding
    # only, and a tolerance scaled by that difference would call rounding a mismatch.
    atol = 2e-4 * max(float(expected.abs().max()) if expected.numel() else 0.0, 1e-6)
    if expected.dim() == 0:
        return bool(diff.abs().max() <= atol)
    flat = diff.reshape(-1, diff.shape[-1])
    return bool(torch.allclose(flat, flat.mean(0, keepdim=True).expand_as(flat), rtol=2e-3, atol=atol))


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
    ref_cache: dict[int, dict[str, torch.Tensor]] = {}

    def reference_for(rank: int) -> dict[str, torch.Tensor] | None:
        entry = by_rank[rank]
        if entry["input"] is None or (entry["stages"] not in (None, [0])):
            return None  # later pipeline stages do not see the model input
        if rank not in ref_cache:
            ref_cache[rank] = _reference_outputs(case, entry["input"])
        return ref_cache[rank]

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
            if name == OUTPUT or name not in ref or any(c is None for c in caps) or caps[0].p:
                continue
            expected = ref[name]
            locals_ = [c.output for c in caps]
            if any(t.shape != expected.shape for t in locals_):
                continue  # a shard, not a full output
            if all(_close(t, expected) for t in locals_):
                continue
            if _partial_sum(locals_, expected):
                out.append(
                    Diagnosis(
                        "tp-partial-sum",
                        f"module {name!r}: each tensor-parallel rank's output is a partial sum; summed over ranks {group} it gives the reference's",
                        {"module": name, "ranks": group, "module_type": caps[0].module_type,
                         "max_abs_error_per_rank": [float((t - expected).abs().max()) for t in locals_],
                         "likely_source": "a row-parallel layer's output used without its all-reduce over the tensor-parallel group"},
                    )
                )
            break  # only the first module that differs from the reference is evidence
    return out
