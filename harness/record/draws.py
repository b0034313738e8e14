"""What each rank drew from its random number generators, op by op, step by step: randomness
is an input of the step, and the reference replays it (:mod:`reference.draws`).

Every ATen op tagged ``nondeterministic_seeded`` (``bernoulli_`` behind ``nn.Dropout`` and
``F.dropout``, attention dropout, ``torch.rand*``) runs under :class:`DrawLog`, a dispatch
mode, however it was called. For each it keeps the op, the shapes and strides of its tensor
arguments and of its output (this rank's local piece), and the state of the generator it drew
from just before: with those the reference computes exactly this rank's draw for the part of
its own tensor this rank holds. The recorder gathers the draws of every step to the writing
rank (generator states as content-addressed auxiliary tensors; identical states, as replicas
seeded alike have, are stored once).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness.frames import call_site
from reference.draws import random_output
from reference.record import is_dtensor

__all__ = ["Draw", "DrawLog", "MAX_DRAWS_PER_STEP", "state_key"]

MAX_DRAWS_PER_STEP = 4096  # beyond this a step's draws are not kept (and not replayed)


@dataclass
class Draw:
    """One seeded op of one rank. ``args``: ``[shape, stride]`` of each tensor argument in
    flattened order (None for other arguments); ``state``: the generator's state before it."""

    op: str
    shape: list[int]
    stride: list[int]
    dtype: str
    device: str
    args: list[Any]
    dtensor: bool = False
    explicit_generator: bool = False
    call_site: str = ""
    state: bytes | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("state")
        return data


def state_key(state: bytes) -> str:
    """The auxiliary-tensor key of a generator state (content-addressed)."""
    return "rng:" + hashlib.sha1(state).hexdigest()[:20]


def _generator_state(func: Any, kwargs: dict, device: torch.device) -> tuple[bytes | None, bool]:
    generator = kwargs.get("generator")
    if generator is not None:
        return bytes(generator.get_state().numpy().tobytes()), True
    if device.type == "cpu":
        return bytes(torch.get_rng_state().numpy().tobytes()), False
    if device.type == "cuda":
        return bytes(torch.cuda.get_rng_state(device).numpy().tobytes()), False
    return None, False


def _device_of(leaves: list[Any], kwargs: dict) -> torch.device:
    for t in leaves:
        if isinstance(t, torch.Tensor):
            return t.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


class DrawLog(TorchDispatchMode):
    """``with DrawLog() as log: ...``; :meth:`take` returns the draws so far and starts over."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[Draw] = []
        self.overflowed = False

    def take(self) -> tuple[list[Draw], bool]:
        draws, overflowed = self.draws, self.overflowed
        self.draws, self.overflowed = [], False
        return draws, overflowed

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags or kwargs.get("generator") is not None:
            # A private generator (a sampler's epoch order) is data order, which the sample
            # ids account for, not the model's random stream.
            return func(*args, **kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        device = _device_of(leaves, kwargs)
        state, explicit = _generator_state(func, kwargs, device)
        out = func(*args, **kwargs)
        if random_output(func, args, kwargs, out) is False:
            return out  # drew nothing (attention with dropout_p == 0)
        if len(self.draws) >= MAX_DRAWS_PER_STEP:
            self.overflowed = True
            return out
        first = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(first, torch.Tensor):
            return out
        local = first.to_local() if is_dtensor(first) else first

        def spec(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return None
            t = t.to_local() if is_dtensor(t) else t
            return [list(t.shape), list(t.stride())]

        self.draws.append(Draw(
            op=str(func), shape=list(local.shape), stride=list(local.stride()), dtype=str(local.dtype).removeprefix("torch."),
            device=local.device.type, args=[spec(t) for t in leaves], dtensor=is_dtensor(first),
            explicit_generator=explicit, call_site=call_site(2), state=state,
        ))
        return out
