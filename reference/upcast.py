"""Run a model in a wider dtype (the float64 calibration rerun), falling back op by op.

Some ops have no float64 kernel: ``torch._grouped_mm`` (the experts of current Hugging Face
MoE models) accepts float32 / bfloat16 / float16 only. :class:`UpcastFallback` is a dispatch
mode that runs every op as called and, when an op given ``upcast`` tensors fails, runs it again
with those tensors cast to ``fallback`` (the case dtype) and casts its floating outputs back, so
the rest of the run stays in ``upcast``. The ops that fell back are listed
(:attr:`UpcastFallback.fell_back`): a calibration that used them says so, since their rounding
is then the case dtype's, not float64's. It sits below autograd, so the backward ops of a
fallen-back forward fall back the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["UpcastFallback"]


class UpcastFallback(TorchDispatchMode):
    """``with UpcastFallback(torch.float64, torch.float32) as mode: ...``; then ``mode.fell_back``."""

    def __init__(self, upcast: torch.dtype, fallback: torch.dtype) -> None:
        super().__init__()
        self.upcast = upcast
        self.fallback = fallback
        self.fell_back: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as exc:
            leaves, _ = tree_flatten((args, kwargs))
            if not any(isinstance(t, torch.Tensor) and t.dtype == self.upcast for t in leaves):
                raise
            down = tree_map(self._down, (args, kwargs))
            try:
                out = func(*down[0], **down[1])
            except Exception:  # noqa: BLE001 - not a dtype problem: the original error stands
                raise exc from None
            self._write_back(func, args, kwargs, down)
            self.fell_back.add(str(func.overloadpacket.__name__))
            return tree_map(self._up, out)

    def _down(self, value: Any) -> Any:
        return value.to(self.fallback) if isinstance(value, torch.Tensor) and value.dtype == self.upcast else value

    def _up(self, value: Any) -> Any:
        return value.to(self.upcast) if isinstance(value, torch.Tensor) and value.dtype == self.fallback else value

    @staticmethod
    def _write_back(func: Any, args: tuple, kwargs: dict, down: tuple) -> None:
        """An op that writes into its arguments (in place, ``out=``) wrote into the cast copies:
        copy them back into the originals."""
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            original = args[i] if i < len(args) else kwargs.get(arg.name)
            copy = down[0][i] if i < len(args) else down[1].get(arg.name)
            if isinstance(original, torch.Tensor) and isinstance(copy, torch.Tensor) and copy is not original:
                with torch.no_grad():
                    original.copy_(copy)
