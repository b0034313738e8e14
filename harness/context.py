"""What a distributed test body gets as ``dist_ctx``."""

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
