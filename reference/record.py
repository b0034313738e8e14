"""The record format shared by the single-device reference and the parallel rank runs.

A record is a directory::

    meta.json       format, source, case, ranks, per-step losses, sample ids, optimizer param
                    groups and an index of every tensor
    steps.jsonl     an unfinished record's steps, one JSON line each (see RecordWriter.checkpoint)
    steps/0000.bin  the step's tensors, one after the other: each full gradient just before the
                    optimizer step, parameter and optimizer state just after it, and the evidence
                    beside the compared state (parallel runs: the differing copies of a replicated
                    tensor, the random generators' states before each draw; never compared)

Each tensor is its raw bytes (C order) at an offset of its step's file; the index holds its
shape, dtype, offset, byte count and SHA-256, so a reader holds one tensor at a time, nothing is
unpickled, and :meth:`Record.verify` tells a damaged, truncated or missing tensor from a good
one (the reference cache never uses a damaged entry). One file a step, not one a tensor: creating
a file cost more than writing its bytes (two thirds of a 1,000-step run's recording). Raw bytes,
not ``torch.save``: its zip container cost a third of a small run's recording, and
``torch.load`` does not check the zip's checksums. A record is
written into a staging directory and renamed into place when finished, so a reader never sees
half a record; a run that fails part way is still finished with ``complete: false``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "KINDS",
    "RECORD_FORMAT",
    "RECORD_VERSION",
    "Record",
    "RecordError",
    "RecordWriter",
    "StepRecord",
    "TensorInfo",
    "dtype_from_str",
    "optim_state_name",
    "optimizer_param_groups",
    "optimizer_state_items",
    "split_optim_state_name",
]

RECORD_FORMAT = "harness-record"
STEP_JOURNAL = "steps.jsonl"  # an unfinished record's steps, one JSON line each (RecordWriter.checkpoint)
RECORD_VERSION = 3  # 3: one file a step (2: one raw file a tensor; 1: torch.save files)
KINDS: tuple[str, ...] = ("grad", "param", "optim")
"""Tensor kinds in a step, in the order they happen: gradients before the optimizer step,
parameters and optimizer state after it."""


class RecordError(RuntimeError):
    """A record directory is missing, malformed, or used inconsistently."""


def dtype_from_str(name: str) -> torch.dtype:
    """``"torch.float32"`` or ``"float32"`` -> ``torch.float32``."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise RecordError(f"unknown dtype {name!r} in record")
    return dtype


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    finite: bool
    file: str
    nbytes: int = -1  # the tensor's byte count (-1: not recorded)
    sha256: str = ""  # of the tensor's bytes ("": not recorded)
    offset: int = 0  # where its bytes start in ``file``

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "finite": self.finite, "file": self.file,
                "offset": self.offset, "nbytes": self.nbytes, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TensorInfo":
        return cls(shape=tuple(data["shape"]), dtype=data["dtype"], finite=data["finite"], file=data["file"],
                   nbytes=int(data.get("nbytes", -1)), sha256=str(data.get("sha256", "")),
                   offset=int(data.get("offset", 0)))

    @property
    def where(self) -> str:
        """The tensor's place on disk, for messages."""
        return f"{self.file}@{self.offset}"

    @property
    def key(self) -> str:
        """Its place and form: unique in a record (an empty tensor shares its offset with the next)."""
        return f"{self.file}@{self.offset}+{self.nbytes}:{self.dtype}{list(self.shape)}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_str(self.dtype)


@dataclass
class StepRecord:
    """Everything a step recorded except the tensor values (those stay on disk).

    ``sample_ids`` are the ids of the step's global batch in micro-batch order;
    ``micro_sample_ids[m]`` those of micro-batch ``m``. ``rank_sample_ids`` (parallel runs
    only) maps a rank to the ids it consumed per micro-batch. ``param_groups`` holds the
    optimizer's hyperparameters with parameter names instead of tensors."""

    step: int
    loss: float | None = None
    micro_losses: list[float] = field(default_factory=list)
    sample_ids: list[int] = field(default_factory=list)
    micro_sample_ids: list[list[int]] = field(default_factory=list)
    rank_sample_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    tensors: dict[str, dict[str, TensorInfo]] = field(
        default_factory=lambda: {kind: {} for kind in KINDS}
    )
    extra: dict[str, Any] = field(default_factory=dict)
    # Auxiliary tensors by key: evidence for the diagnosis, outside the compared structure.
    aux: dict[str, TensorInfo] = field(default_factory=dict)

    def names(self, kind: str) -> list[str]:
        _check_kind(kind)
        return list(self.tensors.get(kind, {}))

    def structure(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{kind: {name: {"shape": [...], "dtype": "..."}}}`` for structural diffs."""
        return {
            kind: {n: {"shape": list(i.shape), "dtype": i.dtype} for n, i in entries.items()}
            for kind, entries in self.tensors.items()
        }

    def to_json(self) -> dict[str, Any]:
        """The step as JSON-ready data, for dumping right away (lists and dicts are shared with
        the record, not copied: a long run writes every step once, and copying was most of it)."""
        return {
            "step": self.step,
            "loss": self.loss,
            "micro_losses": self.micro_losses,
            "sample_ids": self.sample_ids,
            "micro_sample_ids": self.micro_sample_ids,
            "rank_sample_ids": {str(k): v for k, v in self.rank_sample_ids.items()},
            "param_groups": self.param_groups,
            "tensors": {kind: {n: i.to_json() for n, i in entries.items()} for kind, entries in self.tensors.items()},
            "extra": self.extra,
            "aux": {k: i.to_json() for k, i in self.aux.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StepRecord":
        return cls(
            step=int(data["step"]),
            loss=data.get("loss"),
            micro_losses=list(data.get("micro_losses", [])),
            sample_ids=list(data.get("sample_ids", [])),
            micro_sample_ids=[list(m) for m in data.get("micro_sample_ids", [])],
            rank_sample_ids={
                int(k): [list(m) for m in v] for k, v in data.get("rank_sample_ids", {}).items()
            },
            param_groups=list(data.get("param_groups", [])),
            tensors={
                kind: {n: TensorInfo.from_json(i) for n, i in entries.items()}
                for kind, entries in data.get("tensors", {}).items()
            },
            extra=dict(data.get("extra", {})),
            aux={k: TensorInfo.from_json(i) for k, i in data.get("aux", {}).items()},
        )


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise RecordError(f"unknown tensor kind {kind!r}; allowed: {', '.join(KINDS)}")


def _check_name(name: str) -> None:
    if not name:
        raise RecordError("tensor name must not be empty")


def _tensor_bytes(data: torch.Tensor) -> bytes:
    """A contiguous CPU tensor's raw bytes (any dtype, bfloat16 and bool included)."""
    flat = data.reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


class _StepFiles:
    """Appends each tensor's raw bytes to its step's file (``steps/0000.bin``), keeping the file
    of the step being written open: a run writes its steps in order, a tensor at a time."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._open: tuple[str, Any] | None = None  # (relative path, binary file open for append)

    def write(self, step: int, tensor: torch.Tensor) -> tuple[torch.Tensor, TensorInfo]:
        """Write ``tensor``'s raw bytes at the end of ``step``'s file; its copy and index entry."""
        data = tensor.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        raw = _tensor_bytes(data)
        rel = f"steps/{step:04d}.bin"
        if self._open is None or self._open[0] != rel:
            self.close()
            (self.root / "steps").mkdir(exist_ok=True)
            self._open = (rel, open(self.root / rel, "ab"))
        fh = self._open[1]
        offset = fh.tell()
        fh.write(raw)
        finite = bool(torch.isfinite(data).all()) if data.is_floating_point() or data.is_complex() else True
        info = TensorInfo(shape=tuple(data.shape), dtype=str(data.dtype), finite=finite, file=rel,
                          nbytes=len(raw), sha256=hashlib.sha256(raw).hexdigest(), offset=offset)
        return data, info

    def flush(self) -> None:
        if self._open is not None:
            self._open[1].flush()

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None


def _read_raw(root: Path, info: TensorInfo) -> bytes:
    """The tensor's bytes as found on disk (shorter than ``info.nbytes`` where the file was cut)."""
    with open(root / info.file, "rb") as fh:
        fh.seek(info.offset)
        return fh.read(info.nbytes) if info.nbytes >= 0 else fh.read()


def _read_tensor(root: Path, info: TensorInfo) -> torch.Tensor:
    raw = _read_raw(root, info)
    if info.nbytes >= 0 and len(raw) != info.nbytes:
        raise RecordError(f"{root / info.file}: {len(raw)} bytes at offset {info.offset} where the record wrote "
                          f"{info.nbytes} (truncated or replaced)")
    dtype = dtype_from_str(info.dtype)
    if not raw:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(info.shape)


# Tensors a Record keeps after loading them (a comparison, the stepwise replay and the
# trajectory view each read the same tensors): bounded, so a large model's record is still read
# a tensor at a time.
TENSOR_CACHE_BYTES = 64 * 2**20


class _TensorCache:
    """The most recently used tensors of one record, by file, up to ``TENSOR_CACHE_BYTES``."""

    def __init__(self) -> None:
        self._tensors: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def get(self, file: str) -> torch.Tensor | None:
        tensor = self._tensors.get(file)
        if tensor is not None:
            self._tensors.move_to_end(file)
        return tensor

    def put(self, file: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if size > TENSOR_CACHE_BYTES:
            return
        self._tensors[file] = tensor
        self._bytes += size
        while self._bytes > TENSOR_CACHE_BYTES:
            _, old = self._tensors.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()


class Record:
    """A finished record on disk. Tensor values are loaded on demand, one at a time (the most
    recent ones, up to ``TENSOR_CACHE_BYTES``, kept for the next reader)."""

    def __init__(self, path: Path, meta: dict[str, Any], steps: list[StepRecord]):
        self.path = path
        self.meta = meta
        self.steps = steps
        self._cache = _TensorCache()

    # -- loading ----------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Record":
        path = Path(path)
        meta_file = path / "meta.json"
        if not meta_file.is_file():
            raise RecordError(f"{path} is not a record: {meta_file.name} is missing")
        try:
            meta = json.loads(meta_file.read_text())
        except json.JSONDecodeError as exc:
            raise RecordError(f"{meta_file} is not valid JSON: {exc}") from None
        if meta.get("format") != RECORD_FORMAT:
            raise RecordError(f"{path}: format is {meta.get('format')!r}, expected {RECORD_FORMAT!r}")
        if meta.get("version") != RECORD_VERSION:
            raise RecordError(
                f"{path}: record version {meta.get('version')!r} is not supported "
                f"(this harness reads version {RECORD_VERSION})"
            )
        rows = meta.pop("steps", None)
        journal = meta.pop("steps_journal", None)
        if rows is None and journal is not None:  # a checkpointed, unfinished record
            rows = []
            try:
                text = (path / journal).read_text(encoding="utf-8")
            except OSError:
                text = ""
            for line in text.splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # the last line of a run killed while writing it
                    break
            # A step journaled twice (recorded again after a checkpoint): the later one holds.
            rows = list({int(r["step"]): r for r in rows}.values())
        steps = sorted((StepRecord.from_json(s) for s in rows or []), key=lambda s: s.step)
        return cls(path, meta, steps)

    # -- access -----------------------------------------------------------------------------

    @property
    def source(self) -> str:
        return str(self.meta.get("source", "?"))

    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete", False))

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def losses(self) -> list[float | None]:
        return [s.loss for s in self.steps]

    def step(self, step: int) -> StepRecord:
        if not 0 <= step < len(self.steps):
            raise RecordError(f"{self.path}: no step {step} (record has {len(self.steps)} steps)")
        return self.steps[step]

    def info(self, step: int, kind: str, name: str) -> TensorInfo:
        _check_kind(kind)
        entries = self.step(step).tensors.get(kind, {})
        if name not in entries:
            raise RecordError(f"{self.path}: step {step} has no {kind} tensor {name!r}")
        return entries[name]

    def tensor(self, step: int, kind: str, name: str) -> torch.Tensor:
        """Load one tensor (on CPU). Each call returns a tensor of its own: callers may change it."""
        info = self.info(step, kind, name)
        cached = self._cache.get(info.key)
        if cached is not None:
            return cached.clone()
        value = _read_tensor(self.path, info)
        self._cache.put(info.key, value.clone())
        return value

    def aux(self, step: int, key: str) -> torch.Tensor:
        """One auxiliary tensor of ``step`` (see :meth:`RecordWriter.add_aux`)."""
        info = self.step(step).aux.get(key)
        if info is None:
            raise RecordError(f"{self.path}: step {step} has no auxiliary tensor {key!r}")
        return _read_tensor(self.path, info)

    def verify(self) -> list[str]:
        """What is wrong with the record's files: each tensor or auxiliary tensor that is
        missing, shorter than written, or whose bytes' SHA-256 differs from the index (a flipped
        byte); empty for a sound record. Reads every step's file once."""
        problems = []
        for s in self.steps:
            infos = [*(i for entries in s.tensors.values() for i in entries.values()), *s.aux.values()]
            files: dict[str, bytes | None] = {}
            for info in infos:
                if info.file not in files:
                    try:
                        files[info.file] = (self.path / info.file).read_bytes()
                    except OSError as exc:
                        problems.append(f"{info.file}: missing ({type(exc).__name__})")
                        files[info.file] = None
                content = files[info.file]
                if content is None:
                    continue
                end = info.offset + info.nbytes if info.nbytes >= 0 else len(content)
                raw = content[info.offset:end]
                if info.nbytes >= 0 and len(raw) != info.nbytes:
                    problems.append(f"{info.where}: {len(raw)} bytes, {info.nbytes} written (truncated)")
                elif info.sha256 and hashlib.sha256(raw).hexdigest() != info.sha256:
                    problems.append(f"{info.where}: its bytes differ from those written (checksum mismatch)")
                elif not info.sha256:
                    problems.append(f"{info.where}: no checksum recorded")
        return problems

    def iter_tensors(self, step: int, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.step(step).names(kind):
            yield name, self.tensor(step, kind, name)

    def renamed(self, names: Mapping[str, str]) -> "Record":
        """A view of this record with parameter names mapped by ``names`` (recorded -> new):
        tensors of every kind (an optimizer-state entry by its parameter's part), the param
        groups' lists and the per-rank evidence in ``extra`` that is keyed by name. The files
        are this record's; names not in ``names`` stay."""

        def param(name: str) -> str:
            return names.get(name, name)

        def entry(kind: str, name: str) -> str:
            if kind != "optim" or name in names:
                return param(name)
            owner, key = split_optim_state_name(name)
            return optim_state_name(param(owner), key) if owner in names else name

        def by_kind(table: Mapping[str, Any]) -> dict[str, Any]:
            return {kind: {entry(kind, n): v for n, v in entries.items()} if isinstance(entries, Mapping) else entries
                    for kind, entries in table.items()}

        steps = []
        for s in self.steps:
            extra = dict(s.extra)
            for key in ("replica_mismatch", "replica_copies"):
                if isinstance(extra.get(key), Mapping):
                    extra[key] = by_kind(extra[key])
            steps.append(dataclasses.replace(
                s,
                tensors=by_kind(s.tensors),
                param_groups=[{**g, "params": [param(n) for n in g.get("params", [])]} if "params" in g else dict(g)
                              for g in s.param_groups],
                extra=extra,
            ))
        view = Record(self.path, {**self.meta, "renamed": dict(names)}, steps)
        view._cache = self._cache
        return view

    def __repr__(self) -> str:
        return f"Record({str(self.path)!r}, source={self.source!r}, steps={self.num_steps})"


class RecordWriter:
    """Writes a record tensor by tensor; :meth:`finish` publishes it atomically at ``path``."""

    def __init__(
        self, path: str | os.PathLike[str], meta: Mapping[str, Any], *, overwrite: bool = False
    ):
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise RecordError(f"record {self.path} already exists (pass overwrite=True to replace it)")
        self.overwrite = overwrite
        self.meta: dict[str, Any] = {
            "format": RECORD_FORMAT,
            "version": RECORD_VERSION,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **meta,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._staging = self.path.parent / f".{self.path.name}.partial-{uuid.uuid4().hex[:8]}"
        self._staging.mkdir()
        self._steps: dict[int, StepRecord] = {}
        self._files = _StepFiles(self._staging)
        self._written = _TensorCache()  # the newest written tensors, for the finished Record
        self._journaled: set[int] = set()  # steps already in the checkpoint journal
        self._done = False

    def step(self, step: int) -> StepRecord:
        """The step's metadata, created on first use; set its fields directly."""
        if step < 0:
            raise RecordError(f"step must be >= 0, got {step}")
        if step not in self._steps:
            self._steps[step] = StepRecord(step=step)
        return self._steps[step]

    def add_tensor(self, step: int, kind: str, name: str, tensor: torch.Tensor) -> TensorInfo:
        """Save one full tensor. Views are copied so only their own elements are written."""
        _check_kind(kind)
        if self._done:
            raise RecordError(f"record {self.path} is already finished")
        if not isinstance(tensor, torch.Tensor) or is_dtensor(tensor):
            raise RecordError(
                f"{kind} {name!r} at step {step}: records hold plain full tensors, got "
                f"{type(tensor).__name__} (gather it first with harness.record.gather)"
            )
        entries = self.step(step).tensors.setdefault(kind, {})
        _check_name(name)
        if name in entries:
            raise RecordError(f"{kind} {name!r} recorded twice at step {step}")
        data, info = self._files.write(step, tensor)
        entries[name] = info
        self._written.put(info.key, data)
        return info

    def add_aux(self, step: int, key: str, tensor: torch.Tensor) -> TensorInfo:
        """Save one auxiliary tensor of ``step`` under ``key``: evidence for the diagnosis (the
        differing copies of a replicated tensor, a generator's state), not part of the record's
        compared structure."""
        if self._done:
            raise RecordError(f"record {self.path} is already finished")
        if not isinstance(tensor, torch.Tensor) or is_dtensor(tensor):
            raise RecordError(f"auxiliary {key!r} at step {step}: a plain tensor is needed, got {type(tensor).__name__}")
        entries = self.step(step).aux
        _check_name(key)
        if key in entries:
            raise RecordError(f"auxiliary tensor {key!r} recorded twice at step {step}")
        _, info = self._files.write(step, tensor)
        entries[key] = info
        return info

    def copy_step(self, source: "Record", step: int, *, kinds: tuple[str, ...] = KINDS, per_rank: bool = True) -> StepRecord:
        """Copy ``step`` of ``source`` into this record: its losses, sample ids, hyperparameters and
        the tensors of ``kinds``; with ``per_rank`` also what its ranks recorded of themselves
        (per-rank sample ids, extras, auxiliary tensors), which only means something when this
        record's ranks are the source's."""
        src = source.step(step)
        rec = self.step(step)
        rec.loss, rec.micro_losses = src.loss, list(src.micro_losses)
        rec.sample_ids, rec.micro_sample_ids = list(src.sample_ids), [list(m) for m in src.micro_sample_ids]
        rec.param_groups = [dict(g) for g in src.param_groups]
        for kind in kinds:
            for name in src.names(kind):
                self.add_tensor(step, kind, name, source.tensor(step, kind, name))
        if per_rank:
            rec.rank_sample_ids = {int(r): [list(m) for m in v] for r, v in src.rank_sample_ids.items()}
            rec.extra.update(src.extra)
            for key in src.aux:
                self.add_aux(step, key, source.aux(step, key))
        rec.extra["copied_from"] = str(source.path)
        return rec

    def checkpoint(self) -> None:
        """Publish the steps recorded so far in the staging folder (``complete: false``), so a
        run killed before :meth:`finish` still leaves a readable record there. Each step is
        appended once to a journal (``steps.jsonl``, one line a step) and ``meta.json`` holds
        only the header: the cost of a checkpoint does not grow with the steps before it (a
        rewrite of every step at every step made a 300-step run 80% checkpointing)."""
        if self._done:
            return
        self._files.flush()  # the journal only names bytes that are in the files
        new = [i for i in sorted(self._steps) if i not in self._journaled]
        if new:
            with open(self._staging / STEP_JOURNAL, "a", encoding="utf-8") as fh:
                fh.write("".join(json.dumps(self._steps[i].to_json(), default=_json_default) + "\n" for i in new))
            self._journaled.update(new)
        meta = {**self.meta, "complete": False, "steps_journal": STEP_JOURNAL}
        tmp = self._staging / "meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1, default=_json_default))
        os.replace(tmp, self._staging / "meta.json")

    def finish(self, *, complete: bool = True) -> Record:
        """Write ``meta.json`` and move the record into place."""
        if self._done:
            raise RecordError(f"record {self.path} is already finished")
        expected = list(range(len(self._steps)))
        if sorted(self._steps) != expected:
            raise RecordError(f"record {self.path}: steps {sorted(self._steps)} are not 0..n-1")
        steps = [self._steps[i] for i in expected]
        self._files.close()
        meta = {**self.meta, "complete": complete, "steps": [s.to_json() for s in steps]}
        (self._staging / "meta.json").write_text(json.dumps(meta, indent=1, default=_json_default))
        if self.path.exists():
            if not self.overwrite:
                self.abort()
                raise RecordError(f"record {self.path} appeared while writing (another writer?)")
            shutil.rmtree(self.path)
        os.replace(self._staging, self.path)
        self._done = True
        record = Record.load(self.path)
        record._cache, self._written = self._written, _TensorCache()
        return record

    def abort(self) -> None:
        """Discard the staging directory (nothing is published)."""
        self._done = True
        self._files.close()
        shutil.rmtree(self._staging, ignore_errors=True)


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (False where torch has no distributed support)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def optimizer_param_groups(
    optimizer: torch.optim.Optimizer, param_names: Mapping[int, str]
) -> list[dict[str, Any]]:
    """The optimizer's param groups as JSON-able dicts, parameters replaced by their names
    (``param_names`` maps ``id(param)`` to its reference name; unknown ones become ``"?"``)."""
    groups = []
    for group in optimizer.param_groups:
        entry: dict[str, Any] = {}
        for key, value in group.items():
            if key == "params":
                entry["params"] = [param_names.get(id(p), "?") for p in value]
            elif isinstance(value, (bool, int, float, str)) or value is None:
                entry[key] = value
            elif isinstance(value, Sequence) and all(isinstance(v, (int, float)) for v in value):
                entry[key] = list(value)
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                entry[key] = value.item()
            else:
                entry[key] = repr(value)
        groups.append(entry)
    return groups


def optim_state_name(param_name: str, key: str) -> str:
    """Name of one optimizer-state tensor in a record: ``"<param>.<state key>"``."""
    return f"{param_name}.{key}"


def split_optim_state_name(name: str) -> tuple[str, str]:
    """``"fc1.weight.exp_avg"`` -> ``("fc1.weight", "exp_avg")`` (state keys have no dots)."""
    param, _, key = name.rpartition(".")
    return param, key


def optimizer_state_items(
    optimizer: torch.optim.Optimizer, named_params: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The optimizer's per-parameter state as ``(record name, tensor)``, in parameter order.

    Python numbers (some optimizers keep ``step`` as an int) become 0-d tensors; ``None``
    entries (e.g. SGD's momentum buffer without momentum) are skipped. Values may be DTensors
    here: gathering them is the caller's job."""
    for param_name, param in named_params:
        state = optimizer.state.get(param)  # type: ignore[call-overload]
        if not state:
            continue
        for key in sorted(state):
            value = state[key]
            if value is None:
                continue
            if isinstance(value, (bool, int, float)):
                value = torch.tensor(value)
            if isinstance(value, torch.Tensor):
                yield optim_state_name(param_name, key), value
