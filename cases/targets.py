"""Correct strategies as bundled diagnosis targets: ``python -m harness diagnose ddp`` must
PASS. Each entry builds a :class:`harness.targets.target.Target`; ``DEMO_CORRECT`` are the ones the
bundled demo runs next to the bug catalogue (to show there is no false alarm)."""

from __future__ import annotations

from collections.abc import Callable

from harness.targets.target import Target

from .catalog import mlp_case, transformer_case
from .layouts import LAYOUT_TARGETS
from .mesh_targets import MESH_TARGETS
from .strategies.ddp import DDPStrategy
from .strategies.fsdp import FSDPStrategy
from .strategies.hybrid import DDPTensorParallelStrategy, FSDPTensorParallelStrategy
from .strategies.manual_tp import ManualTensorParallel
from .strategies.pipeline import PipelineStrategy
from .strategies.plain import PlainStrategy
from .strategies.tp import TensorParallelStrategy

__all__ = ["DEMO_CORRECT", "TARGETS"]


def _ddp() -> Target:
    return Target("ddp", mlp_case("adamw"), DDPStrategy(), nproc=2, description="DistributedDataParallel on the MLP")


def _ddp_accumulation() -> Target:
    return Target("ddp-accumulation", mlp_case("adamw", micro_batches=2), DDPStrategy(), nproc=2,
                  description="DDP with no_sync() gradient accumulation over 2 micro-batches")


def _manual_tp() -> Target:
    return Target("manual-tp", mlp_case("adamw"), ManualTensorParallel(), nproc=2,
                  description="hand-written Megatron tensor parallelism on the MLP (annotate_shard)")


def _fsdp() -> Target:
    return Target("fsdp", transformer_case(), FSDPStrategy(), nproc=2, description="FSDP2 fully_shard per block + root on the tiny transformer")


def _tp() -> Target:
    return Target("tp", transformer_case(), TensorParallelStrategy(), nproc=2,
                  description="parallelize_module: q/k/v/up colwise, o/down rowwise, heads split over 2 ranks")


def _tp_dropout() -> Target:
    return Target("tp-dropout", transformer_case(dropout=0.1), TensorParallelStrategy(), nproc=2,
                  description="tensor parallelism with dropout on: TP peers draw the same masks as the reference")


def _gpipe() -> Target:
    return Target("gpipe", transformer_case(micro_batches=4), PipelineStrategy("gpipe"), nproc=2,
                  description="torch.distributed.pipelining GPipe, 2 stages, 4 micro-batches")


def _one_f_one_b() -> Target:
    return Target("1f1b", transformer_case(micro_batches=4), PipelineStrategy("1f1b"), nproc=2,
                  description="torch.distributed.pipelining 1F1B, 2 stages, 4 micro-batches")


def _dp_tp() -> Target:
    return Target("dp-tp", transformer_case(), DDPTensorParallelStrategy(tp=2), nproc=4,
                  description="2-D mesh dp=2 x tp=2 (replicate over dp, parallelize_module over tp)")


def _fsdp_tp() -> Target:
    return Target("fsdp-tp", transformer_case(), FSDPTensorParallelStrategy(tp=2), nproc=4,
                  description="2-D mesh: FSDP2 over dp=2, tensor parallelism over tp=2")


def _dp_pp() -> Target:
    return Target("dp-pp", transformer_case(micro_batches=2), PipelineStrategy("gpipe", pp=2), nproc=4,
                  description="2-D mesh dp=2 x pp=2: GPipe stages, FSDP2 over each stage's replicas")


def _plain() -> Target:
    return Target("plain", transformer_case(), PlainStrategy(), nproc=1,
                  description="the plain model on one process (what a sharded checkpoint is loaded back into)")


def _fsdp_resume_tp() -> Target:
    return Target("fsdp-resume-tp", transformer_case(), FSDPStrategy(), nproc=2, resume_at=2, resume_into="tp",
                  description="FSDP2 on 2 ranks checkpointed before step 2 (DCP), resumed as tensor parallelism on 2 fresh ranks")


def _custom_example() -> Target:
    from harness.targets.target import target_from_module

    from . import custom_example

    return target_from_module(custom_example, label="custom-example")


TARGETS: dict[str, Callable[[], Target]] = {
    "ddp": _ddp,
    "ddp-accumulation": _ddp_accumulation,
    "manual-tp": _manual_tp,
    "custom-example": _custom_example,
    "fsdp": _fsdp,
    "tp": _tp,
    "tp-dropout": _tp_dropout,
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "dp-tp": _dp_tp,
    "fsdp-tp": _fsdp_tp,
    "dp-pp": _dp_pp,
    "plain": _plain,
    "fsdp-resume-tp": _fsdp_resume_tp,
    **MESH_TARGETS,
    **LAYOUT_TARGETS,
}

DEMO_CORRECT: list[str] = ["ddp", "ddp-accumulation", "fsdp", "tp", "tp-dropout", "gpipe", "1f1b", "manual-tp", "custom-example", "fsdp-tp", "fsdp-resume-tp"]
