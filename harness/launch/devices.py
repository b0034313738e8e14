"""The one resolver of ``"auto"`` backends and devices (the plugin's options, ``RankRunner``'s
arguments): the device is CUDA when the backend is NCCL or CUDA has a GPU for every rank,
else the CPU; the backend is NCCL on CUDA, gloo otherwise."""

from __future__ import annotations

__all__ = ["cuda_count", "resolve"]


def cuda_count() -> int:
    """CUDA devices torch can use here (torch is imported only when a device is resolved)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(backend: str, device: str, nproc: int) -> tuple[str, str]:
    """(backend, device) with every "auto" made concrete for ``nproc`` ranks."""
    if device == "auto":
        device = "cuda" if backend == "nccl" or cuda_count() >= nproc else "cpu"
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return backend, device
