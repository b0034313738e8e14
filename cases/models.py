"""Small models for cases. Every size is chosen so data, tensor and pipeline parallelism up to
4 ways divide it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "BatchNormMLP", "Block", "FeedForward", "NormedMLPBlock", "NormedMLPLM", "TinyTransformer", "TwoLayerMLP"]


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


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v projections, so tensor parallelism
    can split heads column-wise (q, k, v) and the output projection row-wise (o). The head
    count is read from the local projection width, so a rank holding ``heads / tp`` heads runs
    the same code."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads={heads}")
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        # No key bias: it adds q.b to every score of a query, which softmax cancels, so its
        # gradient is exactly zero and only rounding noise remains; AdamW would turn that
        # noise into lr-sized steps that no two reduction orders agree on.
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.dropout(self.o(y.transpose(1, 2).reshape(b, t, -1)))


class FeedForward(nn.Module):
    """``down(gelu(up(x)))``: up is column-parallel, down row-parallel under tensor parallelism."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, heads: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim, hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    """A decoder-only language model small enough for CPU ranks.

    Blocks live in an ``nn.ModuleDict`` keyed "0", "1", ... so that a pipeline stage built by
    deleting the blocks (and the embedding / head) it does not own keeps the reference's
    parameter names (``layers.2.attn.q.weight``). Any of ``embed``, ``norm``, ``head`` may be
    set to None on a stage; ``forward`` then passes activations through. The defaults (dim 16,
    4 heads, MLP 32, 4 layers) divide by tensor parallelism and pipeline parallelism up to 4.
    """

    def __init__(
        self,
        vocab: int = 32,
        dim: int = 16,
        heads: int = 4,
        hidden: int = 32,
        layers: int = 4,
        max_seq_len: int = 16,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.config = dict(vocab=vocab, dim=dim, heads=heads, hidden=hidden, layers=layers, max_seq_len=max_seq_len, dropout=dropout)
        self.embed: nn.Module | None = nn.Embedding(vocab, dim)
        self.pos: nn.Parameter | None = nn.Parameter(0.02 * torch.randn(max_seq_len, dim))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, hidden, dropout) for i in range(layers)})
        self.norm: nn.Module | None = nn.LayerNorm(dim)
        self.head: nn.Module | None = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
            if self.pos is not None:
                x = x + self.pos[: x.shape[1]]
            x = self.dropout(x)
        for block in self.layers.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


class NormedMLPBlock(nn.Module):
    """``x + down(gelu(up(norm(x))))``: the block of a sequence-parallel layout, where the norm
    runs on each rank's positions and ``up`` / ``down`` are column- / row-parallel."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class NormedMLPLM(nn.Module):
    """Token embedding, pre-norm MLP blocks with residuals, a final norm and a head: a language
    model without attention, small enough to shard by hand along the sequence (sequence
    parallelism keeps the norms' and the row-parallel biases' parameters replicated while each
    rank computes them on its own positions)."""

    def __init__(self, vocab: int = 32, dim: int = 16, hidden: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(NormedMLPBlock(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class BatchNormMLP(nn.Module):
    """``fc2(relu(bn(fc1(x))))``: a BatchNorm normalises by the statistics of the batch it is
    given, so without SyncBatchNorm each data-parallel replica uses its own."""

    def __init__(self, in_features: int = 8, hidden: int = 16, out_features: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))
