"""Per-rank memory of a parallel strategy: what each parallelism actually cuts.

``measure_memory(case, strategy, ctx)`` (collective) sets the strategy up, runs one real
training step (step 0's micro-batches and the optimizer step) and reports, for every rank:

- ``param_bytes``: this rank's parameters, local shards only (``DTensor.to_local()``: an FSDP2
  dim-0 shard, a tensor-parallel column/row block, or the whole tensor when replicated);
- ``grad_bytes``: the local ``.grad`` tensors after backward (FSDP2: reduce-scattered shards);
- ``optim_bytes``: the local optimizer state after the step (Adam's moments follow their
  parameter's sharding; its scalar ``step`` tensors are per parameter and never divided);
- ``activation_bytes``: the peak of bytes *saved for backward* that are alive at once during
  the step, measured with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd
  saves is counted once per storage (views share it) while its saved reference is alive, and
  parameters (leaf tensors that require grad, and views of them, such as FSDP2's unsharded
  weights) are left out. With several micro-batches (or a pipeline schedule) this is the
  largest number of activations alive together.

Bytes are logical sizes (``numel * element_size``) of the local tensors, so FSDP2's padding of
uneven shards shows as the padded shard's real rows only; communication buffers (DDP buckets,
FSDP2's all-gather / reduce-scatter buffers), allocator caching and temporaries freed within
an op are not counted. ``MemoryReport.reference`` is the same measurement for the whole model
on one device (global micro-batch), the baseline each rank is compared with.

    report = measure_memory(transformer_case(), FSDPStrategy(), dist_ctx)
    print(format_memory_report(report))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import Self

from reference.case import Case, collate
from reference.schedule import micro_batch_indices

from harness.context import broadcast_object
from harness.strategy import DistContextLike, Strategy

__all__ = ["MemoryReport", "RankMemory", "SavedTensorMeter", "format_bytes", "format_memory_report", "measure_memory", "reference_memory", "state_bytes", "state_bytes_per_rank"]


@dataclass(frozen=True)
class RankMemory:
    """One rank's measured memory (bytes; ``activation_bytes`` None where not measured)."""

    rank: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    activation_bytes: int | None = None
    mesh: dict[str, int] = field(default_factory=dict)

    @property
    def total_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state: what sharding divides."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes


@dataclass(frozen=True)
class MemoryReport:
    """Every rank's :class:`RankMemory` (index = rank) and the one-device ``reference``."""

    strategy: str
    case: str
    world_size: int
    ranks: list[RankMemory]
    reference: RankMemory | None = None

    def __getitem__(self, rank: int) -> RankMemory:
        return self.ranks[rank]

    @property
    def max_state_bytes(self) -> int:
        """The largest per-rank state: what must fit on the busiest device."""
        return max(r.total_state_bytes for r in self.ranks)

    @property
    def total_state_bytes(self) -> int:
        """State summed over all ranks (DDP: world size x the model's; FSDP: about 1x)."""
        return sum(r.total_state_bytes for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "case": self.case, "world_size": self.world_size,
            "ranks": [asdict(r) for r in self.ranks],
            "reference": asdict(self.reference) if self.reference is not None else None,
        }


# -- measuring -----------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t``: a DTensor's local shard; under simulated ranks (a
    LocalTensor holding every rank's piece) the lowest rank's."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    if isinstance(local, LocalTensor):
        return local._local_tensors[min(local._local_tensors)]
    return local


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _state_tensors(
    modules: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer | None
) -> list[tuple[int, torch.Tensor]]:
    """``(kind, tensor)`` of every piece of training state: 0 parameters (shared ones once),
    1 their gradients, 2 the optimizer's state tensors."""
    mods = [modules] if isinstance(modules, nn.Module) else list(modules)
    params = _unique(p for m in mods for p in m.parameters())
    out: list[tuple[int, torch.Tensor]] = [(0, p) for p in params] + [(1, p.grad) for p in params if p.grad is not None]
    if optimizer is not None:
        out += [(2, v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def state_bytes(modules: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer | None) -> tuple[int, int, int]:
    """Local ``(param, grad, optimizer-state)`` bytes of ``modules`` (a model, or the local
    pipeline chunks) and ``optimizer``; shared parameters are counted once."""
    totals = [0, 0, 0]
    for kind, t in _state_tensors(modules, optimizer):
        totals[kind] += _nbytes(t)
    return totals[0], totals[1], totals[2]


def expected_state_bytes(model: nn.Module | Sequence[nn.Module], element_bytes: int) -> dict[str, int]:
    """The arithmetic: each parameter's elements over the mesh sizes it is sharded along (its
    DTensor ``Shard`` placements), times bytes per element, for weights, gradients and Adam's
    two moments."""
    elements = 0
    for module in [model] if isinstance(model, nn.Module) else list(model):
        for p in module.parameters():
            n = p.numel()
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                for i, placement in enumerate(p.placements):
                    if placement.is_shard():
                        n //= mesh.size(i)
            elements += n
    return {"params": elements * element_bytes, "grads": elements * element_bytes, "optim": 2 * elements * element_bytes}


def state_bytes_per_rank(
    modules: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer | None, ranks: Sequence[int]
) -> dict[int, tuple[int, int, int]]:
    """:func:`state_bytes` of every simulated rank in ``ranks`` at once: each tensor is
    unwrapped once (``to_local`` under simulation costs an op per rank) and its ranks' pieces
    are read from the LocalTensor."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor

    totals = {r: [0, 0, 0] for r in ranks}
    for kind, t in _state_tensors(modules, optimizer):
        local = t.to_local() if isinstance(t, DTensor) else t
        for r in ranks:
            piece = local._local_tensors[r] if isinstance(local, LocalTensor) else local
            totals[r][kind] += piece.numel() * piece.element_size()
    return {r: (p, g, o) for r, (p, g, o) in totals.items()}


class _Saved:
    """What autograd keeps instead of a saved tensor; releases its storage's count when the
    graph drops it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: int | None, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward, live and peak, per distinct storage.

    Use as a context manager around forward (and backward): it installs
    ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook registers each saved
    tensor's storage (parameters excluded) and whose packed handle releases it when autograd
    frees the saved tensor (after backward, or when the graph is dropped)."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._storages: dict[int, list[int]] = {}  # storage ptr -> [references, nbytes]
        self._hooks: Any = None

    @staticmethod
    def _is_parameter(t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return base.is_leaf and base.requires_grad

    def _pack(self, t: torch.Tensor) -> _Saved:
        if self._is_parameter(t):
            return _Saved(self, None, t)
        storage = _local(t).untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return _Saved(self, None, t)
        entry = self._storages.get(key)
        if entry is None:
            self._storages[key] = [1, nbytes]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1
        return _Saved(self, key, t)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[key]
            self.live_bytes -= entry[1]

    def __enter__(self) -> Self:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


def reference_memory(case: Case, device: torch.device) -> RankMemory:
    """The whole model on one device, one step of the global batch (the baseline)."""
    model = case.build_model(device)
    optimizer = case.build_optimizer(model.parameters())
    with SavedTensorMeter() as meter:
        for indices in micro_batch_indices(case, 0):
            batch = collate(case.dataset, indices, device=device, dtype=case.dtype)
            loss = case.forward_loss(model, batch)
            (loss * case.loss_weight(len(batch))).backward()
            del loss
    grad_b = state_bytes(model, None)[1]
    optimizer.step()
    param_b, _, optim_b = state_bytes(model, optimizer)
    return RankMemory(-1, param_b, grad_b, optim_b, meter.peak_bytes)


def measure_memory(
    case: Case, strategy: Strategy, ctx: DistContextLike, *, reference: bool = True
) -> MemoryReport:
    """Collective: set ``strategy`` up on every rank, run one training step of ``case`` and
    return every rank's :class:`RankMemory` (the same report on all ranks). ``reference``:
    also measure the whole model on one device (on rank 0, one step of the global batch)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("measure_memory is collective: initialise the default process group first (e.g. the dist_ctx fixture)")
    setup = strategy.setup(case, ctx)
    batches = strategy.local_batches(case, setup, 0)
    with SavedTensorMeter() as meter:
        losses = strategy.forward_backward(case, setup, batches)
        del losses
    grad_b = state_bytes(setup.model, None)[1]
    strategy.optimizer_step(case, setup)
    param_b, _, optim_b = state_bytes(setup.model, setup.optimizer)
    setup.optimizer.zero_grad(set_to_none=True)
    mine = RankMemory(ctx.rank, param_b, grad_b, optim_b, meter.peak_bytes, dict(setup.layout.mesh))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    baseline = None
    if reference:  # measured once, on rank 0, so every rank reports the same numbers
        baseline = broadcast_object(reference_memory(case, ctx.device) if ctx.rank == 0 else None, 0)
    return MemoryReport(getattr(strategy, "name", type(strategy).__name__), case.name, dist.get_world_size(), everyone, baseline)


# -- reporting -----------------------------------------------------------------------------


def format_bytes(n: int | None) -> str:
    """``12.3 KiB``-style; ``-`` for None."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_memory_report(report: MemoryReport) -> str:
    """A readable table: one row per rank (and the one-device baseline), with each rank's
    state as a fraction of the baseline's."""
    headers = ["rank", "mesh", "params", "grads", "optim", "state", "vs 1 device", "activations*"]
    rows: list[list[str]] = []
    base = report.reference

    def row(label: str, mesh: str, m: RankMemory) -> list[str]:
        ratio = f"{m.total_state_bytes / base.total_state_bytes:.2f}x" if base and base.total_state_bytes else "-"
        return [label, mesh, format_bytes(m.param_bytes), format_bytes(m.grad_bytes), format_bytes(m.optim_bytes),
                format_bytes(m.total_state_bytes), ratio, format_bytes(m.activation_bytes)]

    for m in report.ranks:
        rows.append(row(str(m.rank), " ".join(f"{k}={v}" for k, v in m.mesh.items()) or "-", m))
    if base is not None:
        rows.append(row("1 device", "whole model", base))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [
        f"memory per rank: {report.strategy} on {report.world_size} ranks, case {report.case!r} (local shards)",
        "  ".join(h.rjust(w) if i >= 2 else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths))),
    ]
    for r in rows:
        lines.append("  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines.append(
        f"state summed over ranks: {format_bytes(report.total_state_bytes)}"
        + (f" ({report.total_state_bytes / base.total_state_bytes:.2f}x one device)" if base and base.total_state_bytes else "")
    )
    lines.append("* peak bytes saved for backward alive at once during one step (parameters excluded)")
    return "\n".join(lines)
