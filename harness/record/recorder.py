"""The rank-side recorder: what a parallel run calls on every rank to write its record.

It writes the same format as the reference (:mod:`reference.record`): per step the loss and
micro-batch losses, the full gradients just before the optimizer step, the full parameters and
optimizer state just after it, and the sample ids each rank consumed per micro-batch, plus each
rank's layout (data-parallel replica, pipeline stage, mesh coordinates, process groups).
Sharded state is gathered to full tensors one at a time (:mod:`harness.record.gather`) and only the
destination rank writes.

Use it directly from custom training code (the hooks are collective: every rank calls them in
the same order)::

    rec = RankRecorder(path, case, model, optimizer, RankLayout.data_parallel(rank, world))
    for step in range(case.steps):
        for batch in my_micro_batches:
            loss = ...; rec.micro_batch(step, loss, batch.ids); loss.backward()
        rec.grads(step)          # before optimizer.step()
        optimizer.step()
        rec.after_step(step)     # params + optimizer state + losses/ids
    record = rec.finish()        # the Record on dst, None elsewhere
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from reference.case import Case
from reference.record import Record, RecordError, RecordWriter, optimizer_param_groups
from reference.trainer import dropout_info

from harness.parallel_dims import RankLayout
from harness.record.gather import adopt_prefix_names, gather_state, local_digest, local_state, reference_named_parameters

__all__ = ["RankLayout", "RankRecorder", "RecorderError"]


class RecorderError(RuntimeError):
    """The recorder's hooks were called out of order or with inconsistent data."""


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather_object(obj: Any) -> list[Any]:
    rank, world = _rank_world()
    if world == 1 and not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def expected_param_shapes(case: Case) -> dict[str, tuple[int, ...]]:
    """Reference parameter names and shapes of ``case``'s model, built on the meta device (no
    memory, and the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                model = case.model_factory()
        except Exception:  # a factory that cannot run on meta tensors: build it for real
            model = case.model_factory()
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def expected_param_names(case: Case) -> list[str]:
    """Reference parameter names of ``case``'s model (see :func:`expected_param_shapes`)."""
    return list(expected_param_shapes(case))


class RankRecorder:
    """Records one rank's view of a parallel run; the ``dst`` rank writes the record."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        case: Case,
        model: nn.Module | Sequence[nn.Module],
        optimizer: torch.optim.Optimizer,
        layout: RankLayout,
        *,
        source: str = "strategy",
        dst: int = 0,
        check_replicas: bool = True,
        overwrite: bool = False,
        meta: Mapping[str, Any] | None = None,
        reader: Any = None,
        digests: bool = False,
    ):
        """``digests``: also record, per step and rank, each local tensor's digest and the
        rank's losses bitwise (what the determinism gate compares; off by default: it costs
        a tenth more JSON per step in a record)."""
        self.case = case
        self.reader = reader  # a harness.record.frameworks.StateReader: the framework's own state
        self.model = model
        self.optimizer = optimizer
        self.layout = layout
        self.dst = dst
        self.check_replicas = check_replicas
        self.rank, self.world_size = _rank_world()
        if not 0 <= dst < self.world_size:
            raise RecorderError(f"dst {dst} is not a rank of this {self.world_size}-rank job")
        if layout.stages is not None and len(layout.stages) != len(self._modules()):
            raise RecorderError(
                f"layout.stages has {len(layout.stages)} entries but {len(self._modules())} model chunks were given"
            )
        self._expected = expected_param_names(case) if layout.stages is not None else None
        # Names that differ from the reference's by one common prefix (a wrapper the harness does
        # not know): mapped one to one, with a notice, rather than failed as state-structure.
        self.renamed = None
        if layout.stages is None and isinstance(model, nn.Module):
            self.renamed = adopt_prefix_names(model, expected_param_shapes(case))
        self._micro: dict[int, list[tuple[float | None, list[int]]]] = {}
        self._phase: dict[int, str] = {}
        # What the ranks draw at each random op of each step, for the reference to replay
        # (harness.record.draws); only for a model whose forward draws random numbers.
        from reference.draws import forward_draws_random_numbers

        from harness.record.draws import DrawLog

        self.draw_log: DrawLog | None = DrawLog() if forward_draws_random_numbers(case) else None
        self._drawing = False
        # Each rank's local state's digests per step and kind (what a repeated run is compared by,
        # harness.analysis.determinism), and the settings that make a run repeatable.
        self._digests: dict[int, dict[str, dict[str, str]]] | None = {} if digests else None
        self.layouts: list[dict[str, Any]] = _all_gather_object({"rank": self.rank, **layout.to_json(), "pins": run_pins()})
        self.writer: RecordWriter | None = None
        if self.rank == dst:
            if path is None:
                raise RecorderError(f"rank {dst} writes the record: give it a path")
            first = self._modules()[0]
            self.writer = RecordWriter(
                path,
                {
                    "source": source,
                    "case": case.describe(),
                    "dtype": str(case.dtype),
                    "world_size": self.world_size,
                    "dropout": dropout_info(first),
                    "ranks": self.layouts,
                    **({"renamed_by_prefix": {"strip": self.renamed[0], "add": self.renamed[1]}} if self.renamed else {}),
                    **(meta or {}),
                },
                overwrite=overwrite,
            )

    def _modules(self) -> list[nn.Module]:
        return [self.model] if isinstance(self.model, nn.Module) else list(self.model)

    # -- hooks -------------------------------------------------------------------------------

    def start_draws(self) -> None:
        """Local: log this rank's random draws from now on (the training part of a step)."""
        if self.draw_log is not None and not self._drawing:
            self.draw_log.__enter__()
            self._drawing = True

    def stop_draws(self) -> None:
        """Local: stop logging random draws (before the harness's own work)."""
        if self.draw_log is not None and self._drawing:
            self.draw_log.__exit__(None, None, None)
            self._drawing = False

    def micro_batch(
        self, step: int, loss: torch.Tensor | float | None, sample_ids: Sequence[int], weight: float | None = None
    ) -> None:
        """Local: this rank consumed ``sample_ids`` in its next micro-batch of ``step``, with
        ``loss`` the unweighted mean loss over them (None where this rank computes no loss,
        e.g. a pipeline stage other than the last). ``weight``: what the loss is a mean over
        (``Case.normaliser`` of the batch; default its number of samples), by which the
        replicas' pieces are combined."""
        if self._phase.get(step) not in (None, "micro"):
            raise RecorderError(f"micro_batch(step={step}) after grads()/after_step() of that step")
        self._phase[step] = "micro"
        value = None
        if loss is not None:
            value = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
        ids = [int(i) for i in sample_ids]
        self._micro.setdefault(step, []).append((value, ids, float(len(ids) if weight is None else weight)))

    def grads(self, step: int) -> None:
        """Collective: record full gradients (call just before ``optimizer.step()``)."""
        if self._phase.get(step) == "grads" or self._phase.get(step) == "done":
            raise RecorderError(f"grads(step={step}) called twice")
        self._phase[step] = "grads"
        self._record_kind(step, "grad")

    def after_step(self, step: int) -> None:
        """Collective: record full parameters, optimizer state, losses and sample ids (call
        just after ``optimizer.step()``)."""
        if self._phase.get(step) != "grads":
            raise RecorderError(f"after_step(step={step}) without grads(step={step}) before the optimizer step")
        self._phase[step] = "done"
        self._record_kind(step, "param")
        self._record_kind(step, "optim")
        self._record_step_info(step)

    def resumed(self, saved: Record | None, at: int, loaded: Any) -> None:
        """Collective, right after a checkpoint was loaded into a run that continues at step ``at``:
        on ``dst`` the steps before ``at`` are copied from ``saved`` (the saving run's record, so the
        resumed record has every step and the stepwise comparison starts step ``at`` from it), except
        step ``at - 1``'s parameters and optimizer state: those are this run's, gathered now, right
        after the load - what the load gate compares with ``saved`` bitwise. Every rank's view of its
        own loaded state (``loaded``: a :class:`harness.record.checkpoint.LoadedCheckpoint`) goes into
        the record's ``meta["resume"]``. Where the ranks are the saving run's (same world size and
        layouts), its per-rank entries are copied too."""
        everyone = _all_gather_object({"rank": self.rank, "view": loaded.view, "not_transferable": loaded.not_transferable,
                                       "param_groups": optimizer_param_groups(self.optimizer, self._param_names())})
        if self.writer is not None:
            assert saved is not None

            def without_pins(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
                return [{k: v for k, v in r.items() if k != "pins"} for r in ranks]

            same_ranks = loaded.saved_world == self.world_size and without_pins(saved.meta.get("ranks", [])) == without_pins(self.layouts)
            if saved.num_steps < at:
                raise RecorderError(f"the saved record {saved.path} has {saved.num_steps} steps; the resume at step {at} needs {at}")
            for step in range(at - 1):
                self.writer.copy_step(saved, step, per_rank=same_ranks)
            last = self.writer.copy_step(saved, at - 1, kinds=("grad",), per_rank=False)
            if same_ranks:
                last.rank_sample_ids = {int(r): [list(m) for m in v] for r, v in saved.step(at - 1).rank_sample_ids.items()}
            last.param_groups = _merge_param_groups([r.pop("param_groups") for r in everyone])  # the loaded ones
            self.writer.meta["resume"] = {"at": at, "saved_record": str(saved.path), "saved_world": loaded.saved_world,
                                          "same_ranks": same_ranks, "ranks": everyone}
        self._phase[at - 1] = "grads"
        self._record_kind(at - 1, "param")
        self._record_kind(at - 1, "optim")
        self._phase[at - 1] = "done"

    def finish(self, *, complete: bool = True) -> Record | None:
        """Local: publish the record on ``dst`` (returns it there, None elsewhere). Call with
        ``complete=False`` after a failure: what was recorded is kept."""
        if self.writer is None:
            return None
        writer, self.writer = self.writer, None
        try:
            return writer.finish(complete=complete)
        except RecordError:
            if complete:
                raise
            writer.abort()
            return None

    # -- internals ---------------------------------------------------------------------------

    def _record_kind(self, step: int, kind: str) -> None:
        local = (self.reader.local_state(kind) if self.reader is not None
                 else local_state(self.model, self.optimizer, kind, stages=self.layout.stages))
        if self._digests is not None:
            self._digests.setdefault(step, {})[kind] = {e.name: local_digest(e.tensor) for e in local}
        gathered = gather_state(
            self.model,
            self.optimizer,
            kind,
            dst=self.dst,
            stages=self.layout.stages,
            expected=self._expected if kind == "param" else None,
            check_replicas=self.check_replicas,
            local=local,
        )
        for name, full in gathered:
            if self.writer is not None and full is not None:
                self.writer.add_tensor(step, kind, name, full)
        if self.writer is not None and kind == "grad" and (sharding := gathered.sharding()):
            self.writer.step(step).extra["sharding"] = sharding
        if self.writer is not None and gathered.replica_mismatches:
            self.writer.step(step).extra.setdefault("replica_mismatch", {})[kind] = gathered.replica_mismatches
        copies = gathered.gather_copies() if kind in ("grad", "param") else {}
        if self.writer is not None and copies:
            index = self.writer.step(step).extra.setdefault("replica_copies", {}).setdefault(kind, {})
            for name, pieces in copies.items():
                index[name] = []
                for ranks, tensor in pieces:
                    key = f"{kind}:{name}@" + "-".join(str(r) for r in ranks)
                    self.writer.add_aux(step, key, tensor)
                    index[name].append({"ranks": ranks, "aux": key})

    def _param_names(self) -> dict[int, str]:
        """``id(param)`` -> reference name over every local model chunk."""
        names: dict[int, str] = {}
        for module in self._modules():
            names.update({id(p): n for n, p in reference_named_parameters(module)})
        return names

    def _record_step_info(self, step: int) -> None:
        names = self._param_names()
        draws, overflowed = self.draw_log.take() if self.draw_log is not None else ([], False)
        mine = {
            "rank": self.rank,
            "dp_rank": self.layout.dp_rank,
            "holds_loss": self.layout.holds_loss,
            "micro": self._micro.pop(step, []),
            "param_groups": self.reader.param_groups(names) if self.reader is not None else optimizer_param_groups(self.optimizer, names),
            "draws": [(d.to_json(), d.state) for d in draws],
            "draws_overflowed": overflowed,
            "digests": self._digests.pop(step, {}) if self._digests is not None else None,
        }
        self._write_step_info(step, _all_gather_object(mine))

    def _write_draws(self, step: int, everyone: list[dict[str, Any]]) -> None:
        if self.writer is not None:
            _write_draws_of(self.writer, step, everyone)

    def _write_step_info(self, step: int, everyone: list[dict[str, Any]]) -> None:
        """On dst: the step's losses, sample ids and param groups from every rank's
        ``{"rank", "dp_rank", "holds_loss", "micro": [(loss, ids)], "param_groups"}``."""
        if self.writer is None:
            return
        rec = self.writer.step(step)
        rec.rank_sample_ids = {r["rank"]: [ids for _, ids, _ in r["micro"]] for r in everyone}
        if everyone[0].get("digests") is not None:
            # Bitwise, per rank: its micro-batch losses (float.hex) and its local state's digests.
            rec.extra["rank_digests"] = {
                r["rank"]: {"loss": [None if loss is None else float(loss).hex() for loss, _, _ in r["micro"]], **r["digests"]}
                for r in everyone
            }
        holders = sorted((r for r in everyone if r["holds_loss"]), key=lambda r: (r["dp_rank"], r["rank"]))
        num_micro = max((len(r["micro"]) for r in holders), default=0)
        # Micro-batch m's loss: the replicas' pieces combined by what each is a mean over (its
        # normaliser); the step's: the micro-batches combined by their share of the step - their
        # units with a case loss_normaliser, else their samples (as the reference combines them).
        micro_entries: list[tuple[float, float]] = []
        for m in range(num_micro):
            ids: list[int] = []
            pieces: list[tuple[float, float]] = []
            samples = 0
            for r in holders:
                if m >= len(r["micro"]):
                    continue
                loss, mb_ids, weight = r["micro"][m]
                ids += mb_ids
                if loss is not None:
                    pieces.append((loss, weight))
                    samples += len(mb_ids)
            rec.micro_sample_ids.append(ids)
            rec.sample_ids += ids
            rec.micro_losses.append(self.case.combine_losses(pieces) if pieces else math.nan)
            if pieces:
                share = sum(w for _, w in pieces) if self.case.loss_normaliser is not None else samples
                micro_entries.append((rec.micro_losses[-1], share))
        counted = sum(n for _, n in micro_entries)
        # Each rank's pieces as the loop reported them (loss, ids, weight): another reading of
        # the same numbers where only the reported loss differs (harness.analysis.loss_reading).
        rec.extra["loss_pieces"] = {r["rank"]: [[loss, ids, weight] for loss, ids, weight in r["micro"] if loss is not None]
                                    for r in holders}
        rec.loss = self.case.mean_loss(self.case.combine_losses(micro_entries), counted) if micro_entries and counted else None
        self._write_draws(step, everyone)
        rec.param_groups = _merge_param_groups([r["param_groups"] for r in everyone])
        if any(len(g) != len(everyone[0]["param_groups"]) for g in (r["param_groups"] for r in everyone)):
            rec.extra["param_group_count_mismatch"] = {r["rank"]: len(r["param_groups"]) for r in everyone}
        self.writer.checkpoint()  # a run killed later still leaves these steps readable


def run_pins() -> dict[str, Any]:
    """What this rank runs with that decides whether a run repeats bitwise: threads, torch's
    deterministic switches, the backend's version (seeds are the case's, in the record)."""
    cudnn = torch.backends.cudnn
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(cudnn.deterministic),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
        "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else "",
    }


def _write_draws_of(writer: RecordWriter, step: int, everyone: list[dict[str, Any]]) -> None:
    """Every rank's random draws of ``step`` into the record: per rank the ops
    (``extra["draws"]``), their generator states as auxiliary tensors keyed by content."""
    from harness.record.draws import state_key

    rec = writer.step(step)
    if not any(r.get("draws") for r in everyone):
        return
    stored: set[str] = set()
    table: dict[str, list[dict[str, Any]]] = {}
    for r in everyone:
        entries = []
        for info, state in r.get("draws", []):
            key = state_key(state) if state is not None else None
            if key is not None and key not in stored:
                writer.add_aux(step, key, torch.frombuffer(bytearray(state), dtype=torch.uint8))
                stored.add(key)
            entries.append({**info, "state": key})
        table[str(r["rank"])] = entries
    rec.extra["draws"] = table
    if any(r.get("draws_overflowed") for r in everyone):
        rec.extra["draws_overflowed"] = True


def _merge_param_groups(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Union of the ranks' optimizer param groups (pipeline stages each hold some parameters);
    hyperparameters are taken from the lowest rank that has the group."""
    merged: list[dict[str, Any]] = []
    for groups in per_rank:
        for i, group in enumerate(groups):
            if i == len(merged):
                merged.append({**group, "params": []})
            for name in group.get("params", []):
                if name not in merged[i]["params"]:
                    merged[i]["params"].append(name)
    return merged
