"""The bundled strategies and optimizers in the search registry: ``cases/strategies`` as
:class:`~harness.search.registry.StrategySpec` s (``build_*`` factories, module-level so they
pickle to the ranks by name), the case catalogue's optimizer names, and :func:`case_for`, the
case a config trains. The one module of ``harness.search`` that names the examples; importing
``harness.search`` registers them. A strategy module that fails to import fails here, loudly."""

from __future__ import annotations

import torch

from cases.catalog import OPTIMIZERS, transformer_case
from cases.strategies.ddp import DDPStrategy
from cases.strategies.fsdp import FSDPStrategy
from cases.strategies.hybrid import DDPTensorParallelStrategy, FSDPTensorParallelStrategy
from cases.strategies.pipeline import PipelineStrategy
from cases.strategies.tp import TensorParallelStrategy
from harness.search.config import ParallelConfig
from harness.search.constraints import Constraint
from harness.search.registry import StrategySpec, register_optimizers, register_strategy
from harness.strategy import Strategy
from reference.case import Case

__all__ = ["build_ddp", "build_ddp_tp", "build_fsdp", "build_fsdp_tp", "build_pipeline", "build_tp", "case_for"]


def case_for(config: ParallelConfig) -> Case:
    """The :class:`reference.case.Case` ``config`` trains (the tiny transformer of the catalogue)."""
    return transformer_case(
        config.optimizer,
        steps=config.steps,
        global_batch_size=config.global_batch_size,
        micro_batches=config.micro_batches,
        dtype=getattr(torch, config.dtype),
        num_samples=config.num_samples,
        seq_len=config.seq_len,
        vocab=config.vocab,
        dim=config.dim,
        heads=config.heads,
        hidden=config.hidden,
        layers=config.layers,
        name=config.case_name,
    )


def build_ddp(config: ParallelConfig) -> Strategy:
    return DDPStrategy()


def build_fsdp(config: ParallelConfig) -> Strategy:
    return FSDPStrategy(reshard_after_forward=config.option_dict.get("reshard_after_forward", True))


def build_pipeline(config: ParallelConfig) -> Strategy:
    opts = config.option_dict
    return PipelineStrategy(opts.get("schedule", "gpipe"), pp=config.pp, tp=config.tp, dp_mode=opts.get("dp_mode", "fsdp"))


def build_tp(config: ParallelConfig) -> Strategy:
    return TensorParallelStrategy()


def build_ddp_tp(config: ParallelConfig) -> Strategy:
    return DDPTensorParallelStrategy(tp=config.tp)


def build_fsdp_tp(config: ParallelConfig) -> Strategy:
    return FSDPTensorParallelStrategy(tp=config.tp)


def _check_pipeline_tp_mode(c: ParallelConfig, spec: StrategySpec, max_world: int | None) -> str | None:
    if c.tp > 1 and c.option_dict.get("dp_mode") == "ddp":
        return f"dp_mode='ddp' cannot be combined with tp={c.tp} (DDP does not handle DTensor parameters); allowed: dp_mode='fsdp'"
    return None


def _violate_pipeline_tp_mode(draw, c, spec, max_world):
    if c.tp < 2:
        return None
    return c.replace(options=tuple((k, "ddp" if k == "dp_mode" else v) for k, v in c.options))


register_optimizers(tuple(OPTIMIZERS))
register_strategy(StrategySpec("ddp", build_ddp, dims=("dp",), description="DistributedDataParallel over every rank"))
register_strategy(StrategySpec(
    "fsdp", build_fsdp, dims=("dp",), options={"reshard_after_forward": (True, False)},
    description="FSDP2 fully_shard per block and the root over every rank"))
register_strategy(StrategySpec(
    "pipeline", build_pipeline, dims=("pp", "dp", "tp"), min_degree={"pp": 2},
    options={"schedule": ("gpipe", "1f1b"), "dp_mode": ("fsdp", "ddp")},
    pp_layers="divisible", micro_batches_cover_stages=lambda opts: opts.get("schedule") == "1f1b",
    extra=(Constraint("pipeline-tp-needs-fsdp", _check_pipeline_tp_mode, _violate_pipeline_tp_mode,
                      doc="tp > 1 composes with dp_mode='fsdp' only", needs={"tp": 2}),),
    description="torch.distributed.pipelining GPipe / 1F1B over pp stages, replicas by FSDP2 or DDP, optional tp"))
# tp >= 2: one rank is no tensor parallelism (and there, with an MLP of width 1, DTensor cannot
# view the size-1 "sharded" dim: the search's first finding on this strategy).
register_strategy(StrategySpec(
    "tp", build_tp, dims=("tp",), min_degree={"tp": 2},
    description="parallelize_module Megatron-style TP over every rank"))
register_strategy(StrategySpec(
    "ddp-tp", build_ddp_tp, dims=("dp", "tp"), min_degree={"dp": 2, "tp": 2},
    description="dp x tp: TP inside each replica, replicate() over the dp ranks"))
register_strategy(StrategySpec(
    "fsdp-tp", build_fsdp_tp, dims=("dp", "tp"), min_degree={"dp": 2, "tp": 2},
    description="FSDP2 x TP on a (dp, tp) mesh"))
