"""Test helper: rewrite a reference record as if a parallel run had produced it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from reference import KINDS, Record, RecordWriter

Mutation = Callable[[int, str, str, torch.Tensor], "torch.Tensor | None"]


def rewrite(record: Record, path: Path, mutate: Mutation | None = None, *, rename: dict[str, str] | None = None,
            steps: int | None = None, sample_ids: Callable[[int, list[int]], list[int]] | None = None,
            source: str = "strategy:test", meta: Mapping[str, Any] | None = None) -> Record:
    """A copy of ``record`` as if a parallel run had produced it, with tensors changed by
    ``mutate`` (None drops the entry), names changed by ``rename`` and ``meta`` merged in."""
    writer = RecordWriter(path, {**record.meta, "source": source, **(meta or {})})
    for s in record.steps[: steps if steps is not None else record.num_steps]:
        out = writer.step(s.step)
        out.loss, out.micro_losses, out.param_groups = s.loss, list(s.micro_losses), s.param_groups
        out.micro_sample_ids = [list(m) for m in s.micro_sample_ids]
        out.sample_ids = sample_ids(s.step, list(s.sample_ids)) if sample_ids else list(s.sample_ids)
        for kind in KINDS:
            for name in s.names(kind):
                t = record.tensor(s.step, kind, name)
                t = mutate(s.step, kind, name, t) if mutate else t
                if t is not None:
                    writer.add_tensor(s.step, kind, (rename or {}).get(name, name), t)
    return writer.finish()
