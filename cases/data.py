"""Deterministic synthetic datasets whose samples carry ids.

Ids are offset from the indices on purpose (``id = id_offset + index``) so that code mixing up
"position in the dataset" and "sample id" is caught. Sharding across data-parallel replicas is
``torch.utils.data.DistributedSampler``'s, via :func:`reference.schedule.replica_micro_batch_indices`.
"""

from __future__ import annotations

import torch

from reference.case import Sample

__all__ = ["MaskedTokens", "SyntheticRegression", "SyntheticTokens"]


class SyntheticRegression:
    """``target = tanh(x @ W) + noise`` for ``x ~ N(0, 1)``; all values drawn once from a
    private generator seeded with ``seed`` (the global RNG is left untouched)."""

    def __init__(
        self,
        num_samples: int = 64,
        in_features: int = 8,
        out_features: int = 4,
        *,
        seed: int = 1234,
        id_offset: int = 1000,
    ):
        g = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(num_samples, in_features, generator=g)
        weight = torch.randn(in_features, out_features, generator=g) / in_features**0.5
        noise = 0.1 * torch.randn(num_samples, out_features, generator=g)
        self.targets = torch.tanh(self.inputs @ weight) + noise
        self.id_offset = id_offset

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, index: int) -> Sample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        index = index % len(self)
        return Sample(id=self.id_offset + index, input=self.inputs[index], target=self.targets[index])


class SyntheticTokens:
    """Token sequences for next-token prediction: ``input = seq[:-1]``, ``target = seq[1:]``.

    Each sequence follows a noisy affine recurrence ``t[i+1] = (a * t[i] + b) % vocab`` with a
    per-sample (a, b), so the model has something to learn and losses move over a few steps.
    Drawn once from a private generator; ids are ``id_offset + index``."""

    def __init__(
        self,
        num_samples: int = 64,
        seq_len: int = 8,
        vocab: int = 32,
        *,
        seed: int = 4321,
        id_offset: int = 5000,
    ):
        g = torch.Generator().manual_seed(seed)
        a = torch.randint(1, vocab, (num_samples, 1), generator=g)
        b = torch.randint(0, vocab, (num_samples, 1), generator=g)
        seq = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab, (num_samples,), generator=g)
        for i in range(seq_len):
            seq[:, i + 1] = (a[:, 0] * seq[:, i] + b[:, 0]) % vocab
        flip = torch.rand(num_samples, seq_len + 1, generator=g) < 0.1
        seq = torch.where(flip, torch.randint(0, vocab, seq.shape, generator=g), seq)
        self.tokens = seq
        self.vocab = vocab
        self.id_offset = id_offset

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> Sample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        index = index % len(self)
        row = self.tokens[index]
        return Sample(id=self.id_offset + index, input=row[:-1], target=row[1:])


class MaskedTokens:
    """:class:`SyntheticTokens` with a loss mask: each sequence is valid up to a length of its
    own (2 to seq_len positions, drawn once), the rest is padding the loss ignores. Targets are
    ``{"labels", "mask"}``; samples hold different numbers of valid tokens, so a loss normalised
    by the valid count depends on which samples share a batch."""

    def __init__(self, num_samples: int = 64, seq_len: int = 8, vocab: int = 32, *, seed: int = 99, id_offset: int = 7000):
        self.tokens = SyntheticTokens(num_samples, seq_len, vocab, id_offset=id_offset)
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, seq_len + 1, (num_samples, 1), generator=g)
        self.mask = torch.arange(seq_len).unsqueeze(0) < lengths

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> Sample:
        sample = self.tokens[index]
        return Sample(id=sample.id, input=sample.input, target={"labels": sample.target, "mask": self.mask[index % len(self)]})
