"""Correct strategies as bundled diagnosis targets: ``python -m harness diagnose ddp`` must
PASS. Each entry builds a :class:`harness.target.Target`; ``DEMO_CORRECT`` are the ones the
bundled demo runs next to the bug catalogue (to show there is no false alarm)."""

from __future__ import annotations

from collections.abc import Callable

from harness.target import Target

from .catalog import mlp_case
from .strategies.ddp import DDPStrategy
from .strategies.manual_tp import ManualTensorParallel

__all__ = ["DEMO_CORRECT", "TARGETS"]


def _ddp() -> Target:
    return Target("ddp", mlp_case("adamw"), DDPStrategy(), nproc=2, description="DistributedDataParallel on the MLP")


def _ddp_accumulation() -> Target:
    return Target("ddp-accumulation", mlp_case("adamw", micro_batches=2), DDPStrategy(), nproc=2,
                  description="DDP with no_sync() gradient accumulation over 2 micro-batches")


def _manual_tp() -> Target:
    return Target("manual-tp", mlp_case("adamw"), ManualTensorParallel(), nproc=2,
                  description="hand-written Megatron tensor parallelism on the MLP (annotate_shard)")


def _custom_example() -> Target:
    from harness.target import target_from_module

    from . import custom_example

    return target_from_module(custom_example, label="custom-example")


TARGETS: dict[str, Callable[[], Target]] = {
    "ddp": _ddp,
    "ddp-accumulation": _ddp_accumulation,
    "manual-tp": _manual_tp,
    "custom-example": _custom_example,
}

DEMO_CORRECT: list[str] = ["ddp", "ddp-accumulation", "manual-tp", "custom-example"]
