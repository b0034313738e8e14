"""Per-replica statistics: what in a model or its loss depends on which samples share a batch.

A data-parallel run equals one device only for a program whose every sample's contribution is
independent of the others in its batch. Some programs compute statistics of the batch on purpose
or by accident - a BatchNorm without sync, a router's load-balancing loss, a loss normalised by
the batch's own token count - and then each replica computes them over its own samples. The
harness replays such a run against the *per-replica reference* (each replica's micro-batches
forward on their own, combined as the layout combines them: ``ReferenceVariant(replicas=...)``)
and, where the run matches that instead of the one-device reference, names the dependence
(``per-replica-statistic``) with :func:`batch_dependence`'s evidence: the first module whose
per-sample output changes with the batch composition, or the loss (and output fields such as an
``aux_loss``) when every module's output is per sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from reference.case import Case, cast_floating, collate
from reference.schedule import micro_batch_indices, replica_micro_batch_indices

from harness.record.probe import module_outputs

__all__ = ["batch_dependence", "dependence_terms", "describe", "names_declared"]

# Relative to the output's magnitude: the same rows computed inside a bigger or a smaller batch
# differ by float64 rounding (~1e-16; ~1e-7 where an op runs in float32 for want of a float64
# kernel). Batch statistics move them by orders of magnitude more.
_PER_SAMPLE_RTOL = 1e-5


def _outputs(case: Case, model: nn.Module, batch: Any) -> tuple[dict[str, torch.Tensor], Any]:
    return module_outputs(model, lambda: case.call_model(model, batch.inputs), dtype=torch.float64)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """``t`` viewed as ``[n, ...]`` per sample (a leading dim of n samples, or n x tokens)."""
    if t.dim() == 0 or t.shape[0] % n:
        return None
    return t.reshape(n, -1)


def _scalars(output: Any) -> dict[str, float]:
    """Scalar tensor fields of a model output (``loss``, ``aux_loss``) by name."""
    items = output.items() if isinstance(output, Mapping) else []
    return {str(k): float(v.detach()) for k, v in items if isinstance(v, torch.Tensor) and v.numel() == 1}


def batch_dependence(case: Case, step: int, replicas: int, state: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """What depends on the batch composition when ``step``'s first micro-batch is split over
    ``replicas`` data-parallel replicas: the model (``state``'s weights, default the case's
    initial ones) runs in float64 on the whole micro-batch and on each replica's piece, and each
    module's per-sample outputs, the loss and the output's scalar fields are compared.

    Returns ``{"modules": [...], "first_module": name | None, "loss": {...} | None,
    "output_fields": {...}}``: modules in forward order whose per-sample output differs (with the
    largest relative difference), the loss of the whole micro-batch against its pieces'
    combination when they differ, and scalar output fields (``aux_loss``) that do."""
    from reference.upcast import UpcastFallback

    with torch.random.fork_rng(devices=[]):
        model = cast_floating(case.build_model("cpu"), torch.float64)
        if state:
            model.load_state_dict({k: v.to(torch.float64) if v.is_floating_point() else v for k, v in state.items()}, strict=False)
        whole_idx = micro_batch_indices(case, step)[0]
        pieces_idx = [replica_micro_batch_indices(case, step, r, replicas)[0] for r in range(replicas)]
        batch = collate(case.dataset, whole_idx, dtype=torch.float64, step=step)
        reversed_batch = collate(case.dataset, whole_idx[::-1], dtype=torch.float64, step=step)
        pieces = [collate(case.dataset, idx, dtype=torch.float64, step=step) for idx in pieces_idx]
        position = {sid: i for i, sid in enumerate(batch.ids)}
        with torch.no_grad(), UpcastFallback(torch.float64, case.dtype):
            torch.manual_seed(case.seed)
            whole, whole_out = _outputs(case, model, batch)
            whole_loss = float(case.compute_loss(whole_out, batch.targets))
            torch.manual_seed(case.seed)
            flipped, _ = _outputs(case, model, reversed_batch)
            parts = []
            for piece in pieces:
                torch.manual_seed(case.seed)
                outs, out = _outputs(case, model, piece)
                parts.append((piece, outs, out, float(case.compute_loss(out, piece.targets))))
    modules: list[dict[str, Any]] = []
    n = len(batch)
    for name, full in whole.items():
        full_rows = _rows(full, n)
        flipped_rows = _rows(flipped[name], n) if name in flipped else None
        if full_rows is None or flipped_rows is None or flipped_rows.shape != full_rows.shape:
            continue
        scale = max(float(full_rows.abs().max()), 1e-30)
        # Rows that follow their samples when the batch is reversed are per sample; others (an
        # MoE's tokens grouped by expert) are laid out by something else and say nothing here.
        if float((flipped_rows.flip(0) - full_rows).abs().max()) / scale > _PER_SAMPLE_RTOL:
            continue
        worst = 0.0
        for piece, outs, _, _ in parts:
            mine = outs.get(name)
            rows = _rows(mine, len(piece)) if mine is not None else None
            if rows is None or rows.shape[1] != full_rows.shape[1]:
                worst = -1.0  # not a per-sample output: nothing to say
                break
            picked = full_rows[[position[i] for i in piece.ids]]
            worst = max(worst, float((picked - rows).abs().max()) / scale)
        if worst > _PER_SAMPLE_RTOL:
            modules.append({"module": name, "type": type(model.get_submodule(name)).__name__, "relative_difference": worst})
    # Combined as averaging the replicas' gradients combines them: by their samples.
    combined = case.combine_losses([(loss, float(len(piece))) for piece, _, _, loss in parts])
    loss = None
    if abs(combined - whole_loss) > _PER_SAMPLE_RTOL * max(abs(whole_loss), 1e-30):
        loss = {"whole_micro_batch": whole_loss, "replicas_combined": combined,
                "per_replica": [l for *_, l in parts], "relative_difference": abs(combined - whole_loss) / max(abs(whole_loss), 1e-30)}
    fields: dict[str, Any] = {}
    whole_fields = _scalars(whole_out)
    for key, value in whole_fields.items():
        values = [_scalars(out).get(key) for _, _, out, _ in parts]
        if key == "loss" or any(v is None for v in values):
            continue
        mean = sum(v * len(p) for v, (p, *_) in zip(values, parts)) / sum(len(p) for p, *_ in parts)
        if abs(mean - value) > _PER_SAMPLE_RTOL * max(abs(value), 1e-30):
            fields[key] = {"whole_micro_batch": value, "replicas_mean": mean, "per_replica": values}
    return {"modules": modules, "first_module": modules[0]["module"] if modules else None, "loss": loss,
            "output_fields": fields, "step": step, "replicas": replicas}


def dependence_terms(found: Mapping[str, Any]) -> list[str]:
    """The names a case's ``per_replica`` would declare for ``found``: the first dependent
    module, or "loss" when only the loss (or an output field of the model's) depends."""
    if found.get("first_module"):
        return [found["first_module"]]
    return ["loss"] if found.get("loss") or found.get("output_fields") else []


def describe(found: Mapping[str, Any]) -> str:
    """One clause saying what depends on the batch composition."""
    if found.get("first_module"):
        m = found["modules"][0]
        return (f"module {m['module']!r} ({m['type']}) computes a statistic of its batch: its per-sample output moves by "
                f"{m['relative_difference']:.3g} of its magnitude when the micro-batch is split over {found['replicas']} replicas")
    if found.get("output_fields"):
        key, value = next(iter(found["output_fields"].items()))
        return (f"the model's output field {key!r} (part of its loss) is a statistic of the batch: "
                f"{value['whole_micro_batch']:.6g} over the whole micro-batch, {value['replicas_mean']:.6g} as the replicas' mean")
    if found.get("loss"):
        loss = found["loss"]
        return (f"the loss is normalised per batch: {loss['whole_micro_batch']:.6g} over the whole micro-batch, "
                f"{loss['replicas_combined']:.6g} from the {found['replicas']} replicas' own losses combined by their sample "
                "counts, while every module's output is per sample")
    return "no module output or loss term of the first micro-batch changes with the split (the dependence shows later)"


def names_declared(declared: Sequence[str], found: Mapping[str, Any]) -> list[str]:
    """The terms ``found`` depends on that ``declared`` (a case's ``per_replica``) does not
    cover; a declared module covers its submodules."""
    out = []
    for term in dependence_terms(found):
        covered = any(term == d or term.startswith(d + ".") for d in declared)
        if not covered:
            out.append(term)
    return out
