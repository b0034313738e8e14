"""What a distributed test body gets as ``dist_ctx``, and the one helper that sends a value
from one rank to every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DistContext:
    """This rank's place in the job. The default process group is already initialised."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # "gloo" | "nccl"
    device_type: str  # "cpu" | "cuda"

    @property
    def device(self) -> Any:
        """The ``torch.device`` this rank computes on (``cuda:<local_rank>`` under NCCL)."""
        import torch

        if self.device_type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device(self.device_type)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def broadcast_object(obj: object, src: int) -> object:
    """Collective: ``src``'s ``obj`` on every rank (returned as is without a process group or
    with one rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
