"""Correct parallel strategies, each a real PyTorch implementation checked against the reference."""

from .ddp import DDPStrategy
from .fsdp import FSDPStrategy, apply_fsdp
from .hybrid import (
    DDPTensorParallelStrategy,
    FSDPTensorParallelStrategy,
    apply_replicate,
)
from .pipeline import PipelineStrategy, balanced_stage_layers, pipeline_stage_model
from .tp import TensorParallelStrategy, apply_tensor_parallel, tensor_parallel_plan

__all__ = [
    "DDPStrategy",
    "DDPTensorParallelStrategy",
    "FSDPStrategy",
    "FSDPTensorParallelStrategy",
    "PipelineStrategy",
    "TensorParallelStrategy",
    "apply_fsdp",
    "apply_replicate",
    "apply_tensor_parallel",
    "balanced_stage_layers",
    "pipeline_stage_model",
    "tensor_parallel_plan",
]
