"""N simulated ranks in this process: PyTorch's ``fake`` process group (rank 0 of N) and
``torch.distributed._local_tensor.LocalTensorMode`` over every rank.

Under the mode a tensor is a ``LocalTensor`` holding one value per rank; an op runs once per
rank and a collective (a DTensor redistribution, a ``dist.all_reduce``) is computed from the
ranks' values. What the mode cannot vary is Python itself: one program runs for all ranks. So
the world offers two ways to run code:

- inside the world, the SPMD parts (the model, forward, backward, optimizer step):
  ``dist.get_rank()`` is a symbolic int holding every rank's value, so
  ``torch.manual_seed(seed + dist.get_rank())`` seeds each rank differently, as on real ranks;
- :meth:`SimulatedWorld.as_rank` for per-rank Python (which samples a rank reads):
  ``dist.get_rank()`` is that rank and the mode is off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from harness.context import DistContext

__all__ = ["SimulatedWorld", "SimulationError", "rank_values"]


class SimulationError(RuntimeError):
    """A target cannot run on simulated ranks (the message says why and what to run instead)."""


def rank_values(value: Any, ranks: range | list[int]) -> dict[int, Any]:
    """``value`` per rank: a LocalTensor's per-rank tensors, a symbolic int's per-rank ints,
    otherwise the same value on every rank."""
    from torch.distributed._local_tensor import LocalIntNode, LocalTensor

    if isinstance(value, LocalTensor):
        return {r: value._local_tensors[r] for r in ranks}
    if isinstance(value, torch.SymInt) and isinstance(value.node, LocalIntNode):
        return {r: value.node._local_ints[r] for r in ranks}
    return {r: value for r in ranks}


class SimulatedWorld:
    """Context manager: the fake process group of ``world_size`` ranks and the LocalTensorMode
    over them; both are torn down on exit (no process group is left behind)."""

    def __init__(self, world_size: int):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise SimulationError(f"simulated world size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.ranks = range(world_size)
        # What a strategy's setup sees: this process is rank 0 of the fake group; per-rank
        # facts come from the strategy's layout, rank by rank.
        self.ctx = DistContext(rank=0, world_size=world_size, local_rank=0, backend="fake", device_type="cpu")
        self.mode: Any = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> SimulatedWorld:
        from torch.distributed._local_tensor import LocalTensorMode
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        if dist.is_initialized():
            raise SimulationError(
                "a process group is already initialised in this process; simulated ranks need their own "
                "(run the simulation outside a multi-rank test)"
            )
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size)
        self._stack.callback(dist.destroy_process_group)
        try:
            self._stack.enter_context(_skip_fsdp_storage_resize())
            self.mode = self._stack.enter_context(LocalTensorMode(frozenset(self.ranks)))
            self._stack.enter_context(_patched_rank(lambda: _symbolic_rank(self.world_size)))
        except BaseException:
            self._stack.close()  # no process group or patch outlives a failed start
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @contextlib.contextmanager
    def as_rank(self, rank: int) -> Iterator[None]:
        """Run one rank's Python: the mode off and ``dist.get_rank()`` is ``rank``."""
        with self.mode.disable(), _patched_rank(lambda: rank):
            yield

    def per_rank(self, fn: Callable[[int], Any]) -> dict[int, Any]:
        """``fn(rank)`` for every rank, each under :meth:`as_rank`."""
        out = {}
        for r in self.ranks:
            with self.as_rank(r):
                out[r] = fn(r)
        return out

    def local(self, values: Mapping[int, torch.Tensor]) -> Any:
        """One LocalTensor from a tensor per rank (a rank's data, e.g. its batch)."""
        from torch.distributed._local_tensor import LocalTensor

        with self.mode.disable():
            return LocalTensor({r: values[r] for r in self.ranks})


def _symbolic_rank(world_size: int) -> torch.SymInt:
    from torch.distributed._local_tensor import LocalIntNode

    return torch.SymInt(LocalIntNode({r: r for r in range(world_size)}))


@contextlib.contextmanager
def _patched_rank(rank: Callable[[], Any]) -> Iterator[None]:
    """``dist.get_rank()`` (default group) answers ``rank()``: the user's code asks that way.
    PyTorch's own modules call ``distributed_c10d.get_rank`` and keep the real answer (0)."""
    import torch.distributed.distributed_c10d as c10d

    original = dist.get_rank

    def get_rank(group: Any = None) -> Any:
        if group is None or group is c10d.GroupMember.WORLD:
            return rank()
        return original(group)

    dist.get_rank = get_rank
    try:
        yield
    finally:
        dist.get_rank = original


def _skip_fsdp_storage_resize() -> Any:
    """Context: FSDP2's storage resize skipped for LocalTensors, which have no storage of
    their own (``replicate`` keeps whole parameters, so its values are unaffected; sharding
    ``fully_shard`` is refused by :mod:`harness.simulate.support`); plain tensors as before."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group
    from torch.distributed._local_tensor import LocalTensor

    def skipping(fn: Any) -> Any:
        def resize(tensor: Any) -> None:
            if not isinstance(tensor, LocalTensor):
                fn(tensor)
        return resize

    stack = contextlib.ExitStack()
    for module, names in ((fsdp_param, ("free_storage", "alloc_storage")), (fsdp_group, ("alloc_storage",))):
        for attr in names:
            original = getattr(module, attr)
            setattr(module, attr, skipping(original))
            stack.callback(setattr, module, attr, original)
    return stack
