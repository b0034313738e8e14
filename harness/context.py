"""What a distributed test body gets as ``dist_ctx``, the one helper that sends a value
from one rank to every rank, and the default process group kept for the harness's work
after a loop that destroyed it."""

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


# -- a loop that shuts down its process group --------------------------------------------------
_REGROUPS = [0]  # default groups this process re-created (the same count on every rank: a store prefix)


class DefaultGroupKept:
    """While a user's loop runs (``with DefaultGroupKept():``): the default process group's
    backend, store, rank, size and timeout, taken before the loop; after it, where the loop
    destroyed the group (accelerate's ``end_training()``, Lightning's and torchtitan's
    teardown), a new default group on the same store (under a prefix of its own, so no key of
    the destroyed group is read again) for the harness's own work: gathering the trace and the
    probe, comparing, a second run. ``destroyed`` says whether that happened, for the report.

    A loop that re-creates the group itself leaves it as it made it. Nothing is done while the
    loop is raising: its own exception is what the user must see."""

    def __init__(self) -> None:
        self.destroyed = False
        self._saved: dict[str, Any] | None = None

    def __enter__(self) -> "DefaultGroupKept":
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not (dist.is_available() and dist.is_initialized()):
            return self
        group = c10d._get_default_group()
        self._saved = {
            "backend": dist.get_backend(group),
            "store": c10d._get_default_store(),  # held here: the destroyed group no longer keeps it alive
            "rank": dist.get_rank(group),
            "world_size": dist.get_world_size(group),
            "timeout": _group_timeout(group),
            "device_id": getattr(group, "bound_device_id", None),
        }
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.restore()

    def restore(self) -> None:
        """Collective where the loop destroyed the default group: make a new one."""
        import torch.distributed as dist

        saved = self._saved
        if saved is None or dist.is_initialized():
            return
        _REGROUPS[0] += 1
        kwargs: dict[str, Any] = {"device_id": saved["device_id"]} if saved["device_id"] is not None else {}
        dist.init_process_group(
            saved["backend"], store=dist.PrefixStore(f"harness-regroup-{_REGROUPS[0]}", saved["store"]),
            rank=saved["rank"], world_size=saved["world_size"], timeout=saved["timeout"], **kwargs,
        )
        self.destroyed = True

    @property
    def note(self) -> str:
        """The report's sentence, where the loop destroyed the default group."""
        if not self.destroyed:
            return ""
        return ("the loop destroyed the default process group before it returned (as accelerate's end_training() and "
                "other frameworks' teardown do); the harness made a new one on the same store for its own work after the "
                "loop, so nothing the loop did was changed")


def _group_timeout(group: Any) -> Any:
    """The default group's timeout (its backend's options), else torch's default."""
    from datetime import timedelta

    import torch
    from torch.distributed import distributed_c10d as c10d

    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - a backend without options: torch's default below
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return c10d.default_pg_timeout
