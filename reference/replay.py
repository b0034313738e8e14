"""The reference, one step at a time from another run's state ("same start" replay).

A parallel run is right when every one of its steps is what one device computes *from the same
state*. Comparing whole trajectories instead compounds noise: one rounding difference at step 0
(an adaptive optimizer turns a near-zero gradient's sign noise into a +-lr step) moves every
later forward, and a correct run fails at step 1. :func:`replay_reference` therefore trains the
case step by step, and before step ``s`` (``s >= 1``) loads the parameters that ``source``
recorded after step ``s - 1``. Each step is split at the optimizer so every recorded quantity is
computed from the source's own inputs to that computation:

- **loss and gradients** of step ``s``: forward and backward on step ``s``'s batch from the
  source's parameters after step ``s - 1`` (step 0: the case's initial weights);
- **parameters and optimizer state** after step ``s`` (``apply_source_grads``): the case's
  optimizer applied to the source's parameters *and optimizer state* after step ``s - 1`` with
  the source's *own gradients* of step ``s``. The update is then checked on its own: a gradient
  within rounding noise of the reference's can no longer be amplified by the optimizer into a
  false parameter mismatch, and the gradient check covers the gradient.

The RNG follows the trajectory reference's: the run is seeded once and every step draws the
same random numbers in the same order (loading state draws none), so dropout masks match.

The same replay with ``source`` = the reference itself and an equivalent
:class:`~reference.trainer.ReferenceVariant` (float64, another reduction order) measures the
reference's own one-step noise (:func:`harness.analysis.tolerance.calibrate`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from .case import Case, check_dataset
from .record import Record, optim_state_name
from .schedule import global_batch_indices
from .trainer import ReferenceVariant, _Training

__all__ = ["replay_reference"]


def _load_params(training: _Training, source: Record, step: int) -> list[str]:
    """Copy the parameters ``source`` recorded after ``step`` into the model; returns the names
    it lacks (those keep the replay's own values)."""
    names = set(source.step(step).names("param"))
    lacking = []
    with torch.no_grad():
        for name, param in training.named:
            if name not in names or tuple(source.info(step, "param", name).shape) != tuple(param.shape):
                lacking.append(name)
                continue
            param.copy_(source.tensor(step, "param", name).to(param.dtype))
    return lacking


def _load_grads(training: _Training, source: Record, step: int) -> None:
    """Replace the replay's gradients by those ``source`` recorded at ``step`` (where it has them)."""
    names = set(source.step(step).names("grad"))
    for name, param in training.named:
        if name in names and tuple(source.info(step, "grad", name).shape) == tuple(param.shape):
            param.grad = source.tensor(step, "grad", name).to(dtype=param.dtype, device=param.device)


def _load_optimizer_state(training: _Training, source: Record, step: int) -> None:
    """Load the optimizer state ``source`` recorded after ``step`` into the replay's optimizer
    (hyperparameters stay the case's: a parallel run's differing ones are a structure issue)."""
    optimizer = training.optimizer
    state_dict = optimizer.state_dict()
    available = set(source.step(step).names("optim"))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(params):
        name = training.param_names.get(id(param))
        if name is None:
            continue
        keys = sorted(n.removeprefix(name + ".") for n in available if n.startswith(name + ".") and "." not in n[len(name) + 1:])
        entries = {key: source.tensor(step, "optim", optim_state_name(name, key)) for key in keys}
        if entries and all(t.dim() == 0 or tuple(t.shape) == tuple(param.shape) for t in entries.values()):
            state[index] = entries
        elif index in state_dict["state"]:  # a shape the reference cannot hold: keep the replay's own
            state[index] = state_dict["state"][index]
    state_dict["state"] = state
    optimizer.load_state_dict(state_dict)


def _draw_replay(source: Record, step: int) -> Any:
    """A :class:`~reference.draws.DrawReplay` of the draws ``source`` recorded at ``step``, or
    None when it recorded none (a run without random ops, a reference)."""
    from .draws import DrawReplay, RankDraws

    s = source.step(step)
    recorded = s.extra.get("draws")
    if not recorded:
        return None
    layouts = {int(r.get("rank", i)): r for i, r in enumerate(source.meta.get("ranks", []))}
    ranks = []
    for rank_text, draws in sorted(recorded.items(), key=lambda kv: int(kv[0])):
        rank = int(rank_text)
        layout = layouts.get(rank, {})
        # Within one replica the data-parallel coordinates agree: the mesh coordinates in mesh
        # order give the peers' (tensor-parallel) order.
        position = tuple((layout.get("mesh") or {}).values())
        states = {d["state"]: source.aux(step, d["state"]) for d in draws if d.get("state") in s.aux}
        ranks.append(RankDraws(rank, int(layout.get("dp_rank", 0)), position, s.rank_sample_ids.get(rank, []), list(draws), states))
    replay = DrawReplay(ranks, step=step)
    if any(layouts.get(r.rank, {}).get("stages") is not None for r in ranks):
        replay.failed = "pipeline stages draw parts of the model's random numbers in their own order: not replayed"
    elif s.extra.get("draws_overflowed"):
        replay.failed = "a rank made more random draws in this step than the recorder keeps: not replayed"
    return replay


def replay_reference(
    case: Case,
    source: Record,
    path: str | os.PathLike[str],
    *,
    device: torch.device | str = "cpu",
    variant: ReferenceVariant | None = None,
    apply_source_grads: bool = True,
    overwrite: bool = True,
    meta: Mapping[str, Any] | None = None,
) -> Record:
    """Train ``case`` step by step from ``source``'s recorded state (module docstring) and write
    the record at ``path``. Steps stop where ``source`` stops.

    ``apply_source_grads=False`` records loss and gradients only (the noise measurement needs
    no update)."""
    variant = variant or ReferenceVariant()
    case.validate()
    check_dataset(case.dataset, sorted({i for s in range(case.steps) for i in global_batch_indices(case, s)}))
    training = _Training.open(
        case, path, device=device, variant=variant, source="replay:" + source.source,
        meta={"replayed_from": str(source.path), **(meta or {})}, overwrite=overwrite,
    )

    def step_from_source(step: int) -> None:
        rec = training.writer.step(step)
        if step > 0 and (lacking := _load_params(training, source, step - 1)):
            rec.extra["params_not_in_source"] = lacking
        replay = _draw_replay(source, step) if variant.upcast is None else None
        if replay is None:
            training.forward_backward(step, rec)
        else:
            training.draw_replay = replay
            try:
                with replay:
                    training.forward_backward(step, rec)
            finally:
                training.draw_replay = None
            rec.extra["draw_replay"] = replay.report()
        case.clip_gradients(training.model.parameters())  # the recorded gradients are the clipped ones
        training.record_grads(step)
        if not apply_source_grads:
            training.optimizer.zero_grad(set_to_none=True)
            return
        _load_grads(training, source, step)
        if step > 0:
            _load_optimizer_state(training, source, step - 1)
        training.optimizer_step()  # the replay's own schedule: the lr of this step is the case's
        training.record_update(step, rec)

    return training.train(step_from_source, min(case.steps, source.num_steps))
