"""Small models for cases. Every size is chosen so data, tensor and pipeline parallelism up to
4 ways divide it."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TwoLayerMLP"]


class TwoLayerMLP(nn.Module):
    """The minimal model of the debugging method: ``fc2(dropout(relu(fc1(x))))``."""

    def __init__(
        self, in_features: int = 8, hidden: int = 16, out_features: int = 4, dropout: float = 0.0
    ):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = nn.ReLU()
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout(self.act(self.fc1(x))))
