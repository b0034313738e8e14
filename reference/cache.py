"""Reference records cached on disk, keyed by a stable hash of the case.

The key covers what decides the reference's numbers: the case's numbers, the initial weights
and the source of the model's own module classes, the samples the run consumes, the
optimizer's class and hyperparameters, the loss function's source, the device, the variant and
the torch version. Strategies that share a case therefore share one reference training.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import torch

from . import record as _record
from .case import Case, _sample_at, callable_name, tensors_in
from .record import Record, RecordError
from .schedule import global_batch_indices
from .trainer import ReferenceVariant, train_reference

__all__ = ["cache_dir", "cached_noise_replay", "cached_reference", "case_fingerprint"]

CACHE_ENV = "HARNESS_CACHE_DIR"


def cache_dir() -> Path:
    """``$HARNESS_CACHE_DIR`` or ``./.harness_cache`` (git-ignored)."""
    return Path(os.environ.get(CACHE_ENV) or Path.cwd() / ".harness_cache")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return str(t.dtype).encode() + t.view(torch.uint8).numpy().tobytes()


def _source(obj: Any) -> str:
    try:
        return _cached_source(obj)
    except TypeError:  # unhashable: read it again
        return _read_source(obj)


@functools.lru_cache(maxsize=1024)
def _cached_source(obj: Any) -> str:
    # Reading source is slow (tokenising whole files) and a fingerprint reads every class's.
    return _read_source(obj)


def _read_source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return callable_name(obj)


def _callable_key(fn: Any) -> str:
    import functools

    if isinstance(fn, functools.partial):
        return repr((_callable_key(fn.func), [repr(a) for a in fn.args], sorted((k, repr(v)) for k, v in fn.keywords.items())))
    module = getattr(fn, "__module__", "") or ""
    # torch's own functions are identified by name; user code by its source.
    return callable_name(fn) if module.startswith("torch") else _source(fn)


def case_fingerprint(
    case: Case, *, device: torch.device | str = "cpu", variant: ReferenceVariant | None = None
) -> str:
    """A hex sha256 that changes whenever the reference's numbers could change."""
    h = hashlib.sha256()

    def add(label: str, data: bytes | str) -> None:
        h.update(label.encode() + b"\0")
        h.update(data.encode() if isinstance(data, str) else data)
        h.update(b"\0")

    add("record", str(_record.RECORD_VERSION))
    add("torch", torch.__version__)
    add("case", json.dumps(case.describe(), sort_keys=True))
    add("device", str(torch.device(device)))
    add("variant", json.dumps((variant or ReferenceVariant()).describe(), sort_keys=True))
    model = case.build_model(device="cpu")
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        if not cls.__module__.startswith("torch"):
            add("module-class", _source(cls))
    for name, value in model.state_dict().items():
        add("init:" + name, _tensor_bytes(value))
    optimizer = case.build_optimizer(model.parameters())
    add("optimizer", f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
    add("optimizer-defaults", json.dumps(optimizer.defaults, sort_keys=True, default=repr))
    add("loss", _callable_key(case.loss_fn))
    for step in range(case.steps):
        for index in global_batch_indices(case, step):
            sample = _sample_at(case.dataset, index)  # Sample, or a dict item with an "id"
            add("sample", f"{index}:{sample.id}")
            for part in ("input", "target"):
                for value in tensors_in(getattr(sample, part)):  # a tensor, or dicts / tuples of them
                    add(part, _tensor_bytes(value))
    return h.hexdigest()


def _sound(path: Path, fingerprint: str) -> tuple[Record | None, str]:
    """The complete, undamaged record at ``path`` with ``fingerprint``, or None and why not
    ('' when there is nothing there)."""
    if not path.exists():
        return None, ""
    try:
        existing = Record.load(path)
    except (RecordError, OSError) as exc:
        return None, f"unreadable: {exc}"
    if existing.meta.get("fingerprint") != fingerprint:
        return None, "another fingerprint"
    if not existing.complete:
        return None, "incomplete"
    problems = existing.verify()
    if problems:
        return None, problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
    return existing, ""


def _discard(path: Path) -> None:
    """Move ``path`` out of the way in one rename (a reader never sees it half deleted), then
    delete it. Another process that moved it first wins; nothing to do then."""
    aside = path.with_name(f".{path.name}.discarded-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _cached(path: Path, fingerprint: str, refresh: bool, train: Any) -> Record:
    """Load the complete record at ``path`` with ``fingerprint``, or ``train(path, overwrite)``
    it. Every file of a cached entry is checked against the checksum it was written with
    (:meth:`Record.verify`): a damaged, truncated, missing or incomplete entry is recomputed
    with a notice on stderr, never used. Safe when several processes ask at once: each trains
    into its own staging directory and publishes only where nothing sound is published yet (a
    published entry is never replaced under its readers); the others load that one."""
    existing, why = _sound(path, fingerprint) if not refresh else (None, "")
    if existing is not None:
        return existing
    if why and why != "another fingerprint":
        print(f"harness: the cached record {path} is not sound ({why}): recomputed, not used", file=sys.stderr)
    if path.exists():
        _discard(path)
    try:
        return train(path, False)
    except RecordError as exc:
        # Another process published the same record while we trained: use theirs if sound.
        existing, _ = _sound(path, fingerprint)
        if existing is not None:
            return existing
        raise exc from None


def _slug(case: Case) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", case.name)[:60] or "case"


def cached_reference(
    case: Case,
    *,
    cache: str | os.PathLike[str] | None = None,
    device: torch.device | str = "cpu",
    variant: ReferenceVariant | None = None,
    refresh: bool = False,
) -> Record:
    """The reference record of ``case``, trained once and then loaded from the cache."""
    case.validate()
    fingerprint = case_fingerprint(case, device=device, variant=variant)
    path = Path(cache or cache_dir()) / "reference" / f"{_slug(case)}-{fingerprint[:20]}"
    return _cached(
        path, fingerprint, refresh,
        lambda p, overwrite: train_reference(
            case, p, device=device, variant=variant, overwrite=overwrite, meta={"fingerprint": fingerprint}
        ),
    )


def cached_noise_replay(
    case: Case,
    variant: ReferenceVariant,
    *,
    cache: str | os.PathLike[str] | None = None,
    device: torch.device | str = "cpu",
    refresh: bool = False,
) -> Record:
    """The reference's one-step noise run: ``variant`` replayed step by step from the reference's
    own state (:func:`reference.replay.replay_reference`, gradients and losses only), cached
    like the reference."""
    from .replay import replay_reference

    reference = cached_reference(case, cache=cache, device=device)
    fingerprint = hashlib.sha256(
        (str(reference.meta.get("fingerprint")) + "\0replay\0" + case_fingerprint(case, device=device, variant=variant)).encode()
    ).hexdigest()
    path = Path(cache or cache_dir()) / "replay" / f"{_slug(case)}-{fingerprint[:20]}"
    return _cached(
        path, fingerprint, refresh,
        lambda p, overwrite: replay_reference(
            case, reference, p, device=device, variant=variant, apply_source_grads=False, overwrite=overwrite,
            meta={"fingerprint": fingerprint},
        ),
    )
