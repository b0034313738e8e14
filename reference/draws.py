"""Randomness is an input: the reference replays the draws a parallel run made.

A correct data-parallel run with dropout does not draw the masks one device draws: each replica
draws for its own samples from its own generator (seeded alike or per rank), and a
tensor-parallel rank draws for the heads or positions it holds. :class:`DrawReplay` makes the
stepwise reference (:mod:`reference.replay`) compute with exactly those draws. It is a dispatch
mode over the reference's forward; at its ``j``-th random op of a step it takes every rank's
``j``-th draw of that step (:mod:`harness.record.draws`: the op, the rank's shapes and strides,
its generator's state before the op) and assembles the reference's tensor from the ranks'
pieces along the layout:

- along the batch: each data-parallel replica holds the rows of its samples (its micro-batch's
  ids, found in the reference's micro-batch; ``n x q`` rows when samples are flattened with
  another dim);
- along a sharded dim: the tensor-parallel peers of one replica each hold ``1/k`` of a dim, in
  the order of their mesh coordinates; peers whose piece is the whole (replica's) tensor hold
  a replicated draw and must have drawn it alike.

Each piece is the op run again on the matching slice of the reference's inputs (rebuilt with the
rank's strides, on which a kernel's fill order depends), from the rank's generator state, so it
is the rank's draw bit for bit. What cannot be assembled (a pipeline, an op the ranks did not
issue in the same order, generators of another device) is reported and the reference draws its
own numbers from then on, as it would without a replay. The mode also judges the draws
(:func:`judge`): TP peers that drew a replicated tensor differently, or a sharded one alike
(every rank's heads repeating the same mask), are ``rng-desync``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["DrawReplay", "RankDraws", "forward_draws_random_numbers", "random_output"]


# What a fused attention kernel returns of the generator it drew from (CUDA's flash,
# memory-efficient and cuDNN kernels): its Philox seed and offset, which decide the mask.
_KERNEL_RNG_RETURNS = ("rng_state", "philox_seed", "philox_offset")


def random_output(func: Any, args: tuple, kwargs: Mapping[str, Any] | None, out: Any) -> Any:
    """The tensor holding what a seeded op drew from the generator, for its fingerprint: the
    mask of a dropout (its scaled output mixes in the data, which differs between the shards
    of tensor-parallel peers that drew the same mask), the output of a pure draw (``rand``,
    ``bernoulli_``), the Philox seed and offset a fused attention kernel returns (the same on
    two ranks: the same mask). ``False``: the op drew nothing (an op with ``dropout_p == 0``,
    tagged seeded because it could). None: it drew, but what it drew cannot be read (a fused
    kernel that returns no generator state): recorded by op and shape only.

    An op that takes ``dropout_p`` is read by its schema (the attention ops differ in where
    the argument sits: ``attn_mask`` or ``attn_bias`` come first in some)."""
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" in names:
        at = names.index("dropout_p")
        p = args[at] if at < len(args) else (kwargs or {}).get("dropout_p", 0.0)
        if not p:
            return False
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        returns = [r.name for r in schema.returns]
        state = [outs[i] for i, name in enumerate(returns)
                 if name in _KERNEL_RNG_RETURNS and i < len(outs) and isinstance(outs[i], torch.Tensor) and outs[i].numel()
                 and outs[i].device.type != "meta"]
        if not state:
            return None
        return torch.cat([t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in state])
    name = str(func.overloadpacket.__name__)
    if name == "native_dropout" and isinstance(out, (tuple, list)) and len(out) > 1:
        return out[1]
    return out[0] if isinstance(out, (tuple, list)) else out


def forward_draws_random_numbers(case: Any) -> bool:
    """Whether the model's training forward consumes torch's RNG (dropout, as a module or as
    ``F.dropout`` inside ``forward``): measured by running one micro-batch and watching the
    generator's state, so no module type has to be known."""
    from .case import collate
    from .schedule import micro_batch_indices

    with torch.random.fork_rng(devices=[]):
        model = case.build_model("cpu")
        batch = collate(case.dataset, micro_batch_indices(case, 0)[0], dtype=case.dtype)
        torch.manual_seed(case.seed)
        before = torch.get_rng_state()
        with torch.no_grad():
            case.call_model(model, batch.inputs)
        return not torch.equal(before, torch.get_rng_state())


@dataclass
class RankDraws:
    """One rank's draws of one step and where the rank sits: its data-parallel replica, its
    position among the replica's ranks (tensor-parallel order), its micro-batches' sample ids."""

    rank: int
    replica: int
    position: tuple[Any, ...]
    micro_ids: list[list[int]]
    draws: list[dict[str, Any]]
    states: dict[str, torch.Tensor]


class ReplayUnmodelled(Exception):
    """The ranks' draws cannot be assembled into the reference's (the message says why)."""


@dataclass
class _Piece:
    rank: int
    rows: list[int] | None  # batch rows of the reference's tensor (None: all)
    batch_dim: int | None
    shard_dim: int | None
    shard_index: int
    shard_count: int


@dataclass
class DrawReplay(TorchDispatchMode):
    """Active over one step's forward and backward of the reference (see the module docstring).
    The trainer calls :meth:`begin_forward` before each forward with the sample ids it feeds."""

    ranks: list[RankDraws]
    step: int = 0
    replayed: int = 0
    failed: str = ""
    ops: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()
        self._index = 0
        self._ids: list[int] = []
        self._micro = 0

    def begin_forward(self, micro: int, ids: Sequence[int]) -> None:
        self._micro, self._ids = micro, list(ids)

    def report(self) -> dict[str, Any]:
        return {"replayed": self.replayed, "failed": self.failed, "ops": self.ops[:64]}

    # -- dispatch ------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded not in func.tags or self.failed or kwargs.get("generator") is not None:
            return out  # a private generator (the sampler's epoch order) is not the model's randomness
        if random_output(func, args, kwargs, out) is False:
            return out
        index = self._index
        self._index += 1
        try:
            self._replay(func, args, kwargs, out, index)
        except ReplayUnmodelled as exc:
            self.failed = f"random op #{index} of step {self.step} ({func}): {exc}"
        return out

    def _replay(self, func: Any, args: tuple, kwargs: dict, out: Any, index: int) -> None:
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        ref_shape = list(outs[0].shape)
        contributing = [r for r in self.ranks if self._micro < len(r.micro_ids) and set(r.micro_ids[self._micro]) <= set(self._ids)
                        and r.micro_ids[self._micro]]
        if not contributing:
            raise ReplayUnmodelled("no rank's micro-batch lies within the reference's")
        for r in contributing:
            if index >= len(r.draws):
                raise ReplayUnmodelled(f"rank {r.rank} made only {len(r.draws)} random draws at this step")
            if r.draws[index]["op"] != str(func):
                raise ReplayUnmodelled(f"rank {r.rank}'s draw #{index} is {r.draws[index]['op']}")
            if r.draws[index]["device"] != "cpu" or r.draws[index].get("explicit_generator"):
                raise ReplayUnmodelled(f"rank {r.rank} drew on a {r.draws[index]['device']} generator the reference cannot restore")
        replicas: dict[int, list[RankDraws]] = {}
        for r in contributing:
            replicas.setdefault(r.replica, []).append(r)
        for peers in replicas.values():
            if any(r.micro_ids[self._micro] != peers[0].micro_ids[self._micro] for r in peers):
                raise ReplayUnmodelled(f"the ranks {[r.rank for r in peers]} of one replica consumed different samples")
        covered = sorted(i for peers in replicas.values() for i in peers[0].micro_ids[self._micro])
        if covered != sorted(self._ids):
            raise ReplayUnmodelled("the replicas' samples do not make up the reference's micro-batch")
        layout_of_op: dict[str, Any] = {"index": index, "op": str(func), "shape": ref_shape, "replicas": [],
                                         "call_site": contributing[0].draws[index].get("call_site", "")}
        for replica, peers in sorted(replicas.items()):
            peers = sorted(peers, key=lambda r: (r.position, r.rank))
            pieces, kind = self._pieces(peers, ref_shape, index)
            states = [self._state(r, index) for r in peers]
            alike = all(torch.equal(s, states[0]) for s in states[1:])
            layout_of_op["replicas"].append({"ranks": [r.rank for r in peers], "layout": kind, "peers_drew_alike": alike})
            for piece in pieces:
                rank = next(r for r in peers if r.rank == piece.rank)
                self._run_piece(func, args, kwargs, outs, ref_shape, piece, rank.draws[index], self._state(rank, index))
        self.ops.append(layout_of_op)
        self.replayed += 1

    def _state(self, r: RankDraws, index: int) -> torch.Tensor:
        key = r.draws[index]["state"]
        if key not in r.states:
            raise ReplayUnmodelled(f"rank {r.rank}'s generator state is missing")
        return r.states[key]

    def _pieces(self, peers: list[RankDraws], ref_shape: list[int], index: int) -> tuple[list[_Piece], str]:
        """How one replica's peers' pieces lie in the reference's tensor."""
        shapes = {tuple(r.draws[index]["shape"]) for r in peers}
        if len(shapes) != 1:
            raise ReplayUnmodelled(f"the ranks {[r.rank for r in peers]} of one replica drew shapes {sorted(shapes)}")
        shape = list(shapes.pop())
        if len(shape) != len(ref_shape):
            raise ReplayUnmodelled(f"a rank drew shape {shape} for the reference's {ref_shape}")
        local_ids = peers[0].micro_ids[self._micro]
        n_ref, n_local = len(self._ids), len(local_ids)
        batch_dim, rows = None, None
        if n_local != n_ref:
            for d, (full, mine) in enumerate(zip(ref_shape, shape)):
                if full % n_ref == 0 and mine * n_ref == full * n_local:
                    q = full // n_ref
                    position = {sid: i for i, sid in enumerate(self._ids)}
                    batch_dim, rows = d, [position[sid] * q + k for sid in local_ids for k in range(q)]
                    break
            if batch_dim is None:
                raise ReplayUnmodelled(f"no dim of shape {shape} holds the replica's {n_local} samples of {ref_shape}")
        rest = [d for d in range(len(shape)) if d != batch_dim and shape[d] != ref_shape[d]]
        if not rest:
            kind = "replicated" if len(peers) > 1 else "whole"
            # Replicated peers must have drawn alike: the lowest peer's draw stands for all.
            return [_Piece(peers[0].rank, rows, batch_dim, None, 0, 1)], kind
        if len(rest) > 1 or ref_shape[rest[0]] != shape[rest[0]] * len(peers):
            raise ReplayUnmodelled(f"shape {shape} of {len(peers)} ranks does not split the reference's {ref_shape} along one dim")
        dim = rest[0]
        return [_Piece(r.rank, rows, batch_dim, dim, i, len(peers)) for i, r in enumerate(peers)], f"sharded along dim {dim}"

    def _run_piece(self, func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor], ref_shape: list[int], piece: _Piece,
                   draw: dict[str, Any], state: torch.Tensor) -> None:
        """The op again on this piece's slice of the reference's inputs, from the rank's
        generator state, written into the reference's outputs at the piece's place."""
        leaves, spec = tree_flatten((args, kwargs))
        rank_specs = draw.get("args") or []
        written = _written_args(func, args)
        piece_leaves = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                sliced = _slice(leaf, ref_shape, piece)
                rank_spec = rank_specs[i] if i < len(rank_specs) else None
                if rank_spec is not None and list(sliced.shape) == list(rank_spec[0]):
                    fresh = torch.empty_strided(rank_spec[0], rank_spec[1], dtype=sliced.dtype, device=sliced.device)
                    if id(leaf) not in written:  # what an in-place op fills needs no values
                        fresh.copy_(sliced)
                    sliced = fresh
                piece_leaves.append(sliced)
            elif isinstance(leaf, (list, tuple)) and list(leaf) == ref_shape:
                piece_leaves.append(type(leaf)(draw["shape"]))
            else:
                piece_leaves.append(leaf)
        piece_args, piece_kwargs = tree_unflatten(piece_leaves, spec)
        keep = torch.get_rng_state()
        try:
            torch.set_rng_state(state)
            result = func(*piece_args, **piece_kwargs)
        finally:
            torch.set_rng_state(keep)
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        for full, part in zip(outs, results):
            if isinstance(full, torch.Tensor) and isinstance(part, torch.Tensor):
                _place(full, part, ref_shape, piece)


def _written_args(func: Any, args: tuple) -> set[int]:
    """``id``s of the tensor arguments the op writes into (in place)."""
    return {id(args[i]) for i, arg in enumerate(func._schema.arguments)
            if i < len(args) and arg.alias_info is not None and arg.alias_info.is_write}


def _aligned(t: torch.Tensor, ref_shape: list[int], dim: int | None) -> int | None:
    """``t``'s dim matching the reference output's ``dim`` (aligned from the right, as
    broadcasting aligns), when it has that dim at full size; else None."""
    if dim is None:
        return None
    d = dim - (len(ref_shape) - t.dim())
    return d if 0 <= d < t.dim() and t.shape[d] == ref_shape[dim] else None


def _slice(t: torch.Tensor, ref_shape: list[int], piece: _Piece) -> torch.Tensor:
    d = _aligned(t, ref_shape, piece.batch_dim)
    if d is not None and piece.rows is not None:
        t = t.index_select(d, torch.tensor(piece.rows, device=t.device))
    d = _aligned(t, ref_shape, piece.shard_dim)
    if d is not None:
        size = t.shape[d] // piece.shard_count
        t = t.narrow(d, piece.shard_index * size, size)
    return t


def _place(full: torch.Tensor, part: torch.Tensor, ref_shape: list[int], piece: _Piece) -> None:
    with torch.no_grad():
        target = full
        d_shard = _aligned(full, ref_shape, piece.shard_dim)
        if d_shard is not None:
            size = full.shape[d_shard] // piece.shard_count
            target = target.narrow(d_shard, piece.shard_index * size, size)
        d_batch = _aligned(full, ref_shape, piece.batch_dim)
        if d_batch is not None and piece.rows is not None:
            target.index_copy_(d_batch, torch.tensor(piece.rows, device=full.device), part.to(full.dtype))
        else:
            target.copy_(part.to(full.dtype))
