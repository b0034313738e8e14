"""The record of a simulated run, in the format a real run writes (:mod:`reference.record`).

Every tensor of the run is a LocalTensor (one value per rank), and a DTensor's ``full_tensor()``
is too: the recorder takes each rank's full value, checks that the ranks which must hold the
same data do (replicas: the same coordinate on every mesh dim the tensor is not replicated
over), notes the groups that differ as a real run's replica check does, and writes the lowest
rank's value. Losses and sample ids are per rank, as each rank reported them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from reference.case import Case
from reference.record import RecordWriter, is_dtensor, optimizer_param_groups
from reference.trainer import dropout_info

from harness.parallel_dims import RankLayout
from harness.record.gather import local_state, reference_named_parameters, tensor_digest
from harness.record.recorder import RankRecorder
from harness.simulate.trace import MeshGroups
from harness.simulate.world import rank_values

__all__ = ["SimulatedRecorder"]


class SimulatedRecorder(RankRecorder):
    """:class:`~harness.record.recorder.RankRecorder` for one process holding every rank."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        case: Case,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        layouts: Mapping[int, RankLayout],
        groups: MeshGroups,
        *,
        source: str,
        meta: Mapping[str, Any] | None = None,
    ):
        self.case, self.model, self.optimizer = case, model, optimizer
        self.layouts_by_rank = dict(layouts)
        self.layout = layouts[0]
        self.groups = groups
        self.rank, self.world_size, self.dst = 0, len(layouts), 0
        self.check_replicas = True
        self._expected = None
        self._micro: dict[int, list[tuple[dict[int, float | None], dict[int, list[int]]]]] = {}
        self._phase: dict[int, str] = {}
        self.draw_log, self._drawing = None, False  # one process draws for every rank: nothing to replay
        self.layouts = [{"rank": r, **layouts[r].to_json()} for r in sorted(layouts)]
        self.writer = RecordWriter(
            path,
            {"source": source, "case": case.describe(), "dtype": str(case.dtype), "world_size": self.world_size,
             "dropout": dropout_info(model), "ranks": self.layouts, "simulated": True, **(meta or {})},
            overwrite=True,
        )

    def micro_batch(self, step: int, loss: Any, sample_ids: Any) -> None:  # type: ignore[override]
        """Every rank's next micro-batch of ``step``: ``loss`` a LocalTensor (or None),
        ``sample_ids`` rank -> ids."""
        if self._phase.get(step) not in (None, "micro"):
            from harness.record.recorder import RecorderError

            raise RecorderError(f"micro_batch(step={step}) after grads()/after_step() of that step")
        self._phase[step] = "micro"
        ranks = sorted(self.layouts_by_rank)
        losses = {r: (float(v.detach().float().item()) if self.layouts_by_rank[r].holds_loss else None)
                  for r, v in rank_values(loss, ranks).items()} if loss is not None else {r: None for r in ranks}
        self._micro.setdefault(step, []).append((losses, {r: [int(i) for i in sample_ids[r]] for r in ranks}))

    def _record_kind(self, step: int, kind: str) -> None:
        ranks = sorted(self.layouts_by_rank)
        mismatches: dict[str, list[list[int]]] = {}
        sharding: dict[str, list[list[int]]] = {}
        for entry in local_state(self.model, self.optimizer, kind):
            t = entry.tensor
            key_of = self._replica_keys(t, ranks)
            if is_dtensor(t):
                mesh = t.device_mesh
                shards = [[p.dim, mesh.size(i)] for i, p in enumerate(t.placements) if p.is_shard() and mesh.size(i) > 1]
                if shards:
                    sharding[entry.name] = shards
                full = t.full_tensor()
                local = t.to_local()
            else:
                full = local = t
            values = rank_values(local, ranks)
            if key_of is not None:
                by_key: dict[Any, dict[str, list[int]]] = {}
                for r in ranks:
                    by_key.setdefault(key_of[r], {}).setdefault(tensor_digest(values[r]), []).append(r)
                groups = [sorted(g) for digests in by_key.values() if len(digests) > 1 for g in digests.values()]
                if groups:
                    mismatches[entry.name] = sorted(groups)
            value = rank_values(full, ranks)[ranks[0]]
            self.writer.add_tensor(step, kind, entry.name, value.detach().clone())
        if kind == "grad" and sharding:
            self.writer.step(step).extra["sharding"] = sharding
        if mismatches:
            self.writer.step(step).extra.setdefault("replica_mismatch", {})[kind] = mismatches

    def _replica_keys(self, t: torch.Tensor, ranks: Sequence[int]) -> dict[int, Any] | None:
        """rank -> key; ranks with one key must hold identical local data (None: no promise,
        a Partial DTensor)."""
        if not is_dtensor(t):
            return {r: ("full",) for r in ranks}
        if any(p.is_partial() for p in t.placements):
            return None
        dims = list(t.device_mesh.mesh_dim_names or [])
        sharded = [d for d, p in zip(dims, t.placements) if not p.is_replicate()]
        return {r: tuple((d, self.groups.coords.get(r, {}).get(d)) for d in sharded) for r in ranks}

    def _record_step_info(self, step: int) -> None:
        names = {id(p): n for n, p in reference_named_parameters(self.model)}
        param_groups = optimizer_param_groups(self.optimizer, names)
        micro = self._micro.pop(step, [])
        everyone = [
            {"rank": r, "dp_rank": layout.dp_rank, "holds_loss": layout.holds_loss,
             "micro": [(losses[r], ids[r], float(len(ids[r]))) for losses, ids in micro], "param_groups": param_groups}
            for r, layout in sorted(self.layouts_by_rank.items())
        ]
        self._write_step_info(step, everyone)
