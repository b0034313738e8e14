"""A strategy run's checkpoint: saved after a step, loaded on fresh ranks (of the same or another layout).

What a checkpoint holds, and where:

- the model and optimizer state, through ``torch.distributed.checkpoint`` (DCP) with
  ``get_state_dict`` / ``set_state_dict``: saved sharded as each layout holds it, resharded on
  load by fully qualified name, so an FSDP2 checkpoint loads into TP, another world size or one
  process;
- each rank's own state, one file a rank (``ranks/rank<N>.pt``): the torch RNG (CPU, and the
  current CUDA device's), the lr scheduler, and what the strategy keeps itself (a data
  loader's position) - state DCP's resharding cannot map;
- ``manifest.json``: the step it was saved after, the world size, the strategy and case.

Hand-sharded tensors (a plain tensor holding this rank's slice, declared with ``run.shard`` /
:func:`~harness.record.gather.annotate_shard` or by Megatron-Core's layers) go to DCP as DTensors
sharded over their group: DCP takes a plain tensor for a replicated one and writes rank 0's
copy alone, which would load rank 0's slice on every rank.

A custom loop takes part through :class:`LoopCheckpoint`: the harness's own save (the watched
model and optimizer through DCP, the RNG, the lr scheduler given to ``run.watch``), or the
target file's ``save(ctx, run, path)`` / ``load(ctx, run, path)``, the loop's own checkpoint
code; the harness then still writes each rank's RNG and scheduler state, as the gate's witness
of what was saved.

A strategy takes part through two optional methods (:class:`harness.strategy.StrategyBase` has
the defaults below): ``checkpoint_state(case, setup) -> dict`` (``{"model", "optim", "rank"}``)
and ``load_checkpoint_state(case, setup, state)``. A strategy that keeps more state adds it under
``state["rank"]["strategy"]`` and restores it.

Per-rank state saved by one world size is carried to another only where every saved rank held
the same value (a data-parallel run's common RNG); otherwise it is *not transferable* to that
layout, and the load says so (:attr:`LoadedCheckpoint.not_transferable`) rather than guessing.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reference.files import write_atomic
from reference.record import is_dtensor

from harness.record.recorder import _rank_world
from harness.strategy import buffer_digests, default_checkpoint_state, default_rank_state, load_default_checkpoint_state, rng_state

__all__ = [
    "CheckpointError",
    "CheckpointPlan",
    "LoadedCheckpoint",
    "LoopCheckpoint",
    "default_checkpoint_state",
    "load_checkpoint",
    "load_default_checkpoint_state",
    "rng_view",
    "save_checkpoint",
]

MANIFEST = "manifest.json"
DCP_DIR = "dcp"
RANKS_DIR = "ranks"
SHARDED_KEYS = ("model", "optim")  # what DCP saves and reshards; the rest is per rank


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded (the message says what and where)."""


@dataclass(frozen=True)
class CheckpointPlan:
    """What a run does with a checkpoint: ``save`` one into ``path`` after step ``at - 1``
    (training goes on to the end), or ``resume`` from the one at ``path``: load it on fresh
    ranks and train steps ``at`` .. end, the steps before copied from ``saved_record`` (the
    saving run's record) so the resumed record has every step."""

    path: str
    at: int
    resume: bool = False
    saved_record: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "at": self.at, "resume": self.resume, "saved_record": self.saved_record}


def rank_file(path: str | os.PathLike[str], rank: int) -> Path:
    return Path(path) / RANKS_DIR / f"rank{rank}.pt"


def rng_view(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What the gate compares of an RNG state: each generator's SHA-256 and the first number
    the CPU generator draws from it (``torch.rand(1)``, as float.hex): the evidence a user sees."""
    view: dict[str, Any] = {k: hashlib.sha256(v.cpu().numpy().tobytes()).hexdigest()[:16] for k, v in sorted(state.items())}
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state["cpu"])
        view["first_draw"] = float(torch.rand(1).item()).hex()
    return view


def _state_of(strategy: Any, case: Any, setup: Any, *, template: bool = False) -> dict[str, Any]:
    """What ``strategy`` saves; ``template``: the state a load fills in, from its
    ``checkpoint_template`` when it has one (a custom loop's own save must not run at a load)."""
    hook = (getattr(strategy, "checkpoint_template", None) if template else None) or getattr(strategy, "checkpoint_state", None)
    state = hook(case, setup) if hook is not None else default_checkpoint_state(case, setup)
    if not isinstance(state, dict) or any(k not in state for k in (*SHARDED_KEYS, "rank")):
        raise CheckpointError(f"strategy {strategy.name!r}: checkpoint_state must return a dict with 'model', 'optim' "
                              f"and 'rank', got {sorted(state) if isinstance(state, dict) else type(state).__name__}")
    return state


# -- hand-sharded tensors as DTensors ----------------------------------------------------------
def _hand_shards(model: Any, sharded: dict[str, Any]) -> dict[str, Any]:
    """``{fqn: ShardSpec}`` of the model state dict's entries that are hand-sharded plain
    tensors (matched to the model's parameters by storage, as ``get_state_dict`` returns them)."""
    from harness.record.gather import shard_spec

    modules = [model] if isinstance(model, torch.nn.Module) else list(model or [])
    by_storage = {}
    for module in modules:
        for p in module.parameters():
            spec = shard_spec(p)
            if spec is not None and not is_dtensor(p):
                by_storage[(p.data_ptr(), tuple(p.shape))] = spec
    if not by_storage:
        return {}
    found = {}
    for fqn, t in (sharded.get("model") or {}).items():
        if isinstance(t, torch.Tensor) and not is_dtensor(t) and (t.data_ptr(), tuple(t.shape)) in by_storage:
            found[fqn] = by_storage[(t.data_ptr(), tuple(t.shape))]
    return found


def _as_dtensors(sharded: dict[str, Any], specs: dict[str, Any]) -> dict[str, Any]:
    """Collective over each hand shard's group: a copy of ``sharded`` whose hand-sharded entries
    (and their optimizer state of the same shape) are DTensors ``Shard(dim)`` over the group, with
    the full shape; slices that ``torch.chunk`` would not cut (uneven in another way) are refused."""
    if not specs:
        return sharded
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    model = dict(sharded["model"])
    optim = dict(sharded.get("optim") or {})  # flattened: "state.<fqn>.<key>" (default_checkpoint_state)
    meshes: dict[int, Any] = {}
    for fqn in sorted(specs):
        spec, local = specs[fqn], model[fqn]
        group = spec.process_group()
        sizes: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(sizes, int(local.shape[spec.dim]), group=group)
        full = sum(sizes)
        if sizes != [len(c) for c in torch.empty(full).chunk(len(sizes))]:
            raise CheckpointError(f"the hand-sharded tensor {fqn!r} holds slices of {sizes} along dim {spec.dim}, which "
                                  f"torch.chunk does not cut from {full}: DCP's Shard placement cannot describe them; "
                                  "give the target its own save(ctx, run, path) / load(ctx, run, path)")
        mesh = meshes.get(id(group))
        if mesh is None:
            mesh = meshes[id(group)] = DeviceMesh.from_group(group, local.device.type)
        shape = list(local.shape)
        shape[spec.dim] = full

        def wrap(t: torch.Tensor) -> Any:
            return DTensor.from_local(t, mesh, [Shard(spec.dim)], run_check=False, shape=torch.Size(shape),
                                      stride=torch.empty(shape, device="meta").stride())

        model[fqn] = wrap(local)
        for key in _optim_keys(optim, fqn):
            if isinstance(optim[key], torch.Tensor) and optim[key].shape == local.shape:
                optim[key] = wrap(optim[key])
    return {**sharded, "model": model, "optim": optim}


def _optim_keys(optim: dict[str, Any], fqn: str) -> list[str]:
    """The flattened optimizer state's keys of parameter ``fqn`` (``state.<fqn>.<name>``)."""
    prefix = f"state.{fqn}."
    return [k for k in optim if k.startswith(prefix) and "." not in k[len(prefix):]]


def _as_local(wrapped: dict[str, Any], specs: dict[str, Any]) -> dict[str, Any]:
    """The loaded ``wrapped`` with the entries :func:`_as_dtensors` wrapped (``specs``) back as
    this rank's plain slices; the model's own DTensors (TP, FSDP2) stay DTensors."""
    if not specs:
        return wrapped

    model = dict(wrapped["model"])
    optim = dict(wrapped.get("optim") or {})
    for fqn in specs:
        for entries, key in [(model, fqn)] + [(optim, k) for k in _optim_keys(optim, fqn)]:
            if is_dtensor(entries[key]):
                entries[key] = entries[key].to_local()
    return {**wrapped, "model": model, "optim": optim}


# -- save and load ------------------------------------------------------------------------------
def save_checkpoint(path: str | os.PathLike[str], case: Any, strategy: Any, setup: Any, *, at: int) -> None:
    """Collective: save this run's state after step ``at - 1`` into ``path`` (module docstring)."""
    import torch.distributed.checkpoint as dcp

    rank, world = _rank_world()
    root = Path(path)
    state = _state_of(strategy, case, setup)
    sharded = {k: state[k] for k in SHARDED_KEYS}
    dcp.save(_as_dtensors(sharded, _hand_shards(setup.model, sharded)), checkpoint_id=str(root / DCP_DIR))
    mine = rank_file(root, rank)
    mine.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state["rank"], buffer)
    write_atomic(mine, buffer.getvalue())
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if rank == 0:
        write_atomic(root / MANIFEST, json.dumps({
            "version": 1, "at": at, "world_size": world, "strategy": strategy.name, "case": case.name,
            "lr_scheduler": setup.lr_scheduler is not None,
        }, indent=1))


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    file = Path(path) / MANIFEST
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not a harness checkpoint: {file.name} cannot be read ({exc})") from None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype \
            and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def saved_rank_state(path: str | os.PathLike[str], rank: int, world: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The per-rank state rank ``rank`` of a ``world``-rank job loads: its own file on the saved
    world size; on another, each entry all saved ranks agree on (their common value), the rest
    listed as not transferable (``{"state", "saved_world", "world", "why"}``)."""
    manifest = read_manifest(path)
    saved_world = int(manifest["world_size"])
    if saved_world == world:
        return torch.load(rank_file(path, rank), weights_only=True), []
    saved = [torch.load(rank_file(path, r), weights_only=True) for r in range(saved_world)]
    common: dict[str, Any] = {}
    lost: list[dict[str, Any]] = []
    for key in sorted({k for s in saved for k in s}):
        values = [s.get(key) for s in saved]
        if all(v is not None for v in values) and all(_same(values[0], v) for v in values[1:]):
            common[key] = values[0]
        else:
            lost.append({"state": key, "saved_world": saved_world, "world": world,
                         "why": f"the {saved_world} saved ranks hold different {key} states: which one a rank of "
                                f"{world} continues from is not defined by the layout"})
    return common, lost


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` did on this rank: the step training continues at, the
    per-rank state that could not come along, and this rank's state right after the load as
    the gate compares it (``view``: RNG digests and first draw, the lr scheduler's state)."""

    at: int
    saved_world: int
    not_transferable: list[dict[str, Any]] = field(default_factory=list)
    view: dict[str, Any] = field(default_factory=dict)


def loaded_view(setup: Any) -> dict[str, Any]:
    """This rank's state after a load, as the gate compares it with the saved files."""
    view: dict[str, Any] = {"rng": rng_view(rng_state())}
    if setup.lr_scheduler is not None:
        view["lr_scheduler"] = _jsonable(setup.lr_scheduler.state_dict())
    buffers = buffer_digests(setup.model)
    if buffers:
        view["buffers"] = buffers
    return view


def saved_view(rank_state: dict[str, Any]) -> dict[str, Any]:
    """The same view of a saved rank file (:func:`loaded_view`)."""
    view: dict[str, Any] = {}
    if "rng" in rank_state:
        view["rng"] = rng_view(rank_state["rng"])
    if "lr_scheduler" in rank_state:
        view["lr_scheduler"] = _jsonable(rank_state["lr_scheduler"])
    if "buffers" in rank_state:
        view["buffers"] = dict(rank_state["buffers"])
    return view


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def load_checkpoint(path: str | os.PathLike[str], case: Any, strategy: Any, setup: Any) -> LoadedCheckpoint:
    """Collective: load the checkpoint at ``path`` into a freshly set-up run (module docstring).
    DCP fills the strategy's own state-dict templates in place (resharding to this layout),
    then the strategy applies them with its ``load_checkpoint_state``."""
    import torch.distributed.checkpoint as dcp

    rank, world = _rank_world()
    manifest = read_manifest(path)
    template = _state_of(strategy, case, setup, template=True)
    specs = _hand_shards(setup.model, template)
    sharded = _as_dtensors({k: template[k] for k in SHARDED_KEYS}, specs)
    try:
        dcp.load(sharded, checkpoint_id=str(Path(path) / DCP_DIR))
        sharded = _as_local(sharded, specs)
    except Exception as exc:
        raise CheckpointError(f"the checkpoint {path} (saved by {manifest.get('strategy')!r} on {manifest.get('world_size')} "
                              f"ranks) does not load into {strategy.name!r} on {world}: {type(exc).__name__}: {exc}") from exc
    rank_state, lost = saved_rank_state(path, rank, world)
    state = {**sharded, "rank": rank_state}
    hook = getattr(strategy, "load_checkpoint_state", None)
    if hook is not None:
        hook(case, setup, state)
    else:
        load_default_checkpoint_state(case, setup, state)
    return LoadedCheckpoint(at=int(manifest["at"]), saved_world=int(manifest["world_size"]), not_transferable=lost,
                            view=loaded_view(setup))


# -- custom loops -------------------------------------------------------------------------------
LOOP_DIR = "loop"  # where a target's own save(ctx, run, path) writes


class LoopCheckpoint:
    """A custom loop's checkpoint, in the shape :func:`save_checkpoint` and :func:`load_checkpoint`
    take (the strategy and its setup in one): the objects the loop handed to ``run.watch``
    (``model``, ``optimizer``, ``lr_scheduler``), and ``glue``, the target file's
    ``(save, load)`` functions or None for the harness's own save. With ``glue`` the loop's code
    saves and restores everything; the harness's per-rank file is then only the witness of the
    RNG and scheduler state at the save, which the gate compares with what the loop's load left."""

    name = "custom"

    def __init__(self, run: Any, path: str | os.PathLike[str], glue: tuple[Any, Any] | None = None):
        self.run = run
        self.path = Path(path)
        self.glue = glue

    @property
    def model(self) -> Any:
        return self.run.model

    @property
    def optimizer(self) -> Any:
        return self.run.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.run.lr_scheduler

    def checkpoint_state(self, case: Any, setup: Any) -> dict[str, Any]:
        if self.glue is None:
            if getattr(self.run, "recorder", None) is not None and self.run.recorder.reader is not None:
                raise CheckpointError("the watched DeepSpeed ZeRO engine keeps its state in its own partitions: give the "
                                      "target save(ctx, run, path) / load(ctx, run, path) that call engine.save_checkpoint "
                                      "/ engine.load_checkpoint")
            return default_checkpoint_state(case, self)
        witness = default_rank_state(self)  # before the loop's own save can draw from the RNG
        (self.path / LOOP_DIR).mkdir(parents=True, exist_ok=True)
        self.glue[0](self.run.ctx, self.run, str(self.path / LOOP_DIR))
        return {"model": {}, "optim": {}, "rank": witness}

    def checkpoint_template(self, case: Any, setup: Any) -> dict[str, Any]:
        """What a load fills: the harness's own state, or nothing with the loop's glue (its load
        reads its own files) but the per-rank witness."""
        if self.glue is None:
            return self.checkpoint_state(case, setup)
        return {"model": {}, "optim": {}, "rank": {}}

    def load_checkpoint_state(self, case: Any, setup: Any, state: dict[str, Any]) -> None:
        if self.glue is None:
            load_default_checkpoint_state(case, self, state)
        else:
            self.glue[1](self.run.ctx, self.run, str(self.path / LOOP_DIR))
