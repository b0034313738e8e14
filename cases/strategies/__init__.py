"""Correct parallel strategies, each a real PyTorch implementation checked against the reference."""

from .ddp import DDPStrategy

__all__ = ["DDPStrategy"]
