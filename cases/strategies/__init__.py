"""Correct parallel strategies, each a real PyTorch implementation checked against the reference."""

from .ddp import DDPStrategy
from .pipeline import PipelineStrategy, balanced_stage_layers, pipeline_stage_model

__all__ = ["DDPStrategy", "PipelineStrategy", "balanced_stage_layers", "pipeline_stage_model"]
