"""The layout check: any ``(dp, tp, pp)`` mesh, 64 ranks and beyond, on simulated ranks.

What it checks and shows, per rank (seed 000 sections 1, 3, 8 and 9; seed 001 section 5):

- the mesh: every rank's coordinate, and the process groups of each dim as the mesh really
  built them, against the coordinates the job declares (``ParallelDims``: ``pp, dp, tp``
  outermost first, TP peers adjacent). Groups built along another dim are
  ``swapped-mesh-dims``;
- the samples of step 0 per rank, from its declared replica: no sample in two replicas, the
  same samples on every rank of a TP group and along a pipeline (``duplicate-samples``,
  ``dropped-samples``, ``inconsistent-replica-inputs``);
- the collectives of one training step per group: each pipeline stage's program (its blocks,
  tensor-parallel over ``tp``, replicated over ``dp``) runs forward and backward over the
  micro-batches (GPipe order) on its ``dp x tp`` simulated ranks, with the activations the
  previous stage sent; count and bytes per op and group, and the stage-boundary sends;
- memory per rank: parameters, gradients and optimizer state measured from each rank's local
  pieces, beside the arithmetic (each parameter's elements divided by the mesh sizes it is
  sharded over, times bytes per element) and one device's; activations saved for backward
  (peak), beside one device's for the global batch.

The model's numbers are not compared with the reference here: a stage's input is the previous
stage's real output, but a non-last stage's upstream gradient is a constant (the real one would
need the later stages' backward first). ``python -m harness diagnose TARGET --simulate N``
compares.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from reference.case import Case, collate
from reference.schedule import global_batch_indices, replica_micro_batch_indices

from harness.codes import Diagnosis
from harness.parallel_dims import ParallelDims
from harness.record.memory import SavedTensorMeter, expected_state_bytes, format_bytes, reference_memory, state_bytes_per_rank
from harness.simulate.trace import CollectiveLog, MeshGroups, build_trace, collective_records
from harness.simulate.world import SimulatedWorld, SimulationError
from harness.tracing.records import CollectiveRecord, record_bytes

__all__ = ["LayoutPlan", "LayoutReport", "check_layout", "format_layout"]

# build_stage(case, stage, num_stages, stage_mesh) -> the stage's parallelized module; the
# stage mesh is the stage's dp x tp ranks (dims named as ParallelDims names them).
StageBuilder = Callable[[Case, int, int, Any], nn.Module]


@dataclass(frozen=True)
class LayoutPlan:
    """A layout to check: the degrees, the case (model, data, global batch, micro-batches),
    how one pipeline stage is built and parallelized, and how the world mesh is built
    (default ``dims.build_mesh``; a bug target passes its own)."""

    name: str
    dims: ParallelDims
    case: Case
    build_stage: StageBuilder
    build_mesh: Callable[[ParallelDims], Any] | None = None
    description: str = ""


@dataclass
class LayoutReport:
    """What :func:`check_layout` found; :func:`format_layout` prints it."""

    plan: dict[str, Any]
    mesh_groups: dict[str, list[list[int]]]
    declared_groups: dict[str, list[list[int]]]
    ranks: list[dict[str, Any]]
    one_device: dict[str, Any]
    collectives: list[dict[str, Any]]
    diagnoses: list[Diagnosis] = field(default_factory=list)
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def codes(self) -> list[str]:
        return [d.code for d in self.diagnoses]

    @property
    def exit_code(self) -> int:
        return 1 if self.diagnoses else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan, "mesh_groups": self.mesh_groups, "declared_groups": self.declared_groups,
            "ranks": self.ranks, "one_device": self.one_device, "collectives": self.collectives,
            "diagnoses": [d.to_dict() for d in self.diagnoses], "elapsed_s": self.elapsed_s, "notes": self.notes,
        }


def _partition(groups: Mapping[int, list[int]]) -> list[list[int]]:
    """rank -> its group, as the list of distinct groups."""
    return [list(g) for g in sorted({tuple(sorted(g)) for g in groups.values()})]


def _stage_ranks(groups: MeshGroups, dims: ParallelDims, stage: int) -> list[list[int]]:
    """The global ranks of ``stage`` as a ``dp x tp`` grid, in the real mesh's arrangement."""
    grid = [[-1] * dims.tp for _ in range(dims.dp)]
    for rank, coords in groups.coords.items():
        if coords.get("pp", 0) == stage:
            grid[coords.get("dp", 0)][coords.get("tp", 0)] = rank
    return grid


def check_layout(plan: LayoutPlan, *, echo: Callable[[str], None] | None = None) -> LayoutReport:
    """Check ``plan`` on simulated ranks (see the module docstring)."""
    from torch.distributed.device_mesh import DeviceMesh

    from harness.tracing.checks import check_collectives
    from harness.tracing.mesh import check_mesh
    from harness.tracing.samples import check_sample_ids

    say = echo or (lambda line: None)
    started = time.monotonic()
    dims, case = plan.dims, plan.case.replace(steps=1)
    world = dims.world_size
    case.validate()
    say(f"layout {plan.name}: {dims.describe()} = {world} ranks, global batch {case.global_batch_size}, "
        f"{case.micro_batches} micro-batch(es)")

    # 1. the mesh as built, on every rank
    with SimulatedWorld(world):
        mesh = plan.build_mesh(dims) if plan.build_mesh is not None else dims.build_mesh("cpu")
        groups = MeshGroups(mesh, world)
    if sorted(groups.coords) != list(range(world)):
        raise SimulationError(f"the mesh of {plan.name} covers ranks {sorted(groups.coords)[:8]}..., not all {world}")
    layouts = {r: dims.layout(r) for r in range(world)}

    # 2. samples of step 0 from each rank's declared replica
    ids_of = {i: collate(case.dataset, [i], device="cpu", dtype=case.dtype).ids[0] for i in global_batch_indices(case, 0)}
    samples: dict[int, dict[int, list[list[int]]]] = {}
    shards: dict[int, list[list[int]]] = {}
    for r, layout in layouts.items():
        if layout.dp_rank not in shards:
            shards[layout.dp_rank] = [list(m) for m in replica_micro_batch_indices(case, 0, layout.dp_rank, dims.dp)]
        samples[r] = {0: [[ids_of.get(i, i) for i in m] for m in shards[layout.dp_rank]]}

    # 3. one step of every stage program on its dp x tp ranks
    stage_dims = ParallelDims(dp=dims.dp, tp=dims.tp)
    rank_rows: dict[int, dict[str, Any]] = {}
    records: dict[int, list[CollectiveRecord]] = defaultdict(list)
    received: dict[int, list[torch.Tensor]] | None = None  # local rank -> activation per micro-batch
    element_bytes = torch.empty((), dtype=case.dtype).element_size()
    for stage in range(dims.pp):
        grid = _stage_ranks(groups, dims, stage)
        local_to_global = {d * dims.tp + t: grid[d][t] for d in range(dims.dp) for t in range(dims.tp)}
        say(f"stage {stage}: one step on {len(local_to_global)} simulated ranks (ranks {grid[0][0]}..{grid[-1][-1]})")
        log = CollectiveLog()
        with SimulatedWorld(stage_dims.world_size) as sim:
            stage_mesh = DeviceMesh("cpu", torch.arange(stage_dims.world_size).reshape(stage_dims.shape),
                                    mesh_dim_names=stage_dims.names)
            stage_groups = MeshGroups(stage_mesh, stage_dims.world_size)
            with log:
                model = plan.build_stage(case, stage, dims.pp, stage_mesh)
                optimizer = case.build_optimizer(model.parameters())
                log.step, log.phase = 0, "train"
                outputs: dict[int, list[torch.Tensor]] = defaultdict(list)
                with SavedTensorMeter() as meter:
                    pending = []
                    for m in range(case.micro_batches):
                        batches = {k: collate(case.dataset, shards[layouts[g].dp_rank][m], device="cpu", dtype=case.dtype)
                                   for k, g in local_to_global.items()}
                        if received is None:
                            x = sim.local({k: b.inputs for k, b in batches.items()})
                        else:
                            x = sim.local({k: received[k][m].requires_grad_(False) for k in local_to_global})
                        out = model(x)
                        if stage == dims.pp - 1:
                            targets = sim.local({k: b.targets for k, b in batches.items()})
                            loss = case.compute_loss(out, targets) * case.loss_weight(len(batches[0]), dims.dp)
                            pending.append((loss, None))
                        else:
                            plain = out.to_local() if hasattr(out, "to_local") else out
                            for k, value in plain._local_tensors.items():
                                outputs[k].append(value.detach().clone())
                            pending.append((out, torch.full_like(out, 1e-3)))
                    sync = getattr(model, "set_requires_gradient_sync", None)
                    for m, (value, grad) in enumerate(pending):  # GPipe: every forward, then every backward
                        if sync is not None:  # gradients accumulate locally; the last backward syncs them
                            sync(m == len(pending) - 1)
                        value.backward(grad)
                    del pending
                grads = state_bytes_per_rank(model, None, list(local_to_global))
                optimizer.step()
                measured_all = state_bytes_per_rank(model, optimizer, list(local_to_global))
                expected = expected_state_bytes(model, element_bytes)  # the same on every rank of the stage
            for k, g in local_to_global.items():
                measured = measured_all[k]
                coords = groups.coords[g]
                rank_rows[g] = {
                    "rank": g, "mesh": coords, "declared": layouts[g].mesh, "dp_replica": layouts[g].dp_rank, "stage": stage,
                    "samples": samples[g][0], "params": measured[0], "grads": grads[k][1], "optim": measured[2],
                    "expected": dict(expected), "activations": meter.peak_bytes,
                }
        # the stage's collectives, once per global rank, in that rank's real groups
        for g, stage_records in collective_records(log.calls, stage_groups, local_to_global).items():
            records[g].extend(stage_records)
        if stage < dims.pp - 1:
            # the next stage's local rank k (the same dp, tp place) is the peer of this stage's k
            nxt = _stage_ranks(groups, dims, stage + 1)
            for k, g in local_to_global.items():
                peer = nxt[k // dims.tp][k % dims.tp]
                pair = f"pp:{min(g, peer)},{max(g, peer)}"
                for m, act in enumerate(outputs[k]):
                    shape, dtype = [list(act.shape)], [str(act.dtype).removeprefix("torch.")]
                    # the activation forward (g -> peer), its gradient backward (peer -> g)
                    for direction, sender, receiver in (("forward", g, peer), ("backward", peer, g)):
                        for rank, other, op in ((sender, receiver, "send"), (receiver, sender, "recv")):
                            records[rank].append(CollectiveRecord(
                                rank=rank, index=len(records[rank]), op=op, group=pair, group_desc=f"pipeline p2p ({direction})",
                                group_ranks=sorted((g, peer)), is_p2p=True, peer=other, seq=m + 1, shapes=shape,
                                dtypes=dtype, step=0, phase="train", source="simulated"))
            received = {k: outputs[k] for k in local_to_global}

    trace = build_trace(world, groups, layouts, {}, samples, records, {"layout": plan.name})

    # 4. the checks
    expected_ids = {0: [ids_of.get(i, i) for i in global_batch_indices(case, 0)]}
    found = list(check_sample_ids(samples, {r: l.dp_rank for r, l in layouts.items()}, expected_ids))
    found += check_mesh(trace)
    found += check_collectives(trace)
    base = reference_memory(case, torch.device("cpu"))
    say("one device: the whole model, one step of the global batch")
    report = LayoutReport(
        plan={"name": plan.name, "description": plan.description, "dims": {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp},
              "world_size": world, "mesh_dims": groups.dims, "global_batch": case.global_batch_size,
              "micro_batches": case.micro_batches, "case": case.name, "per_replica_batch": case.global_batch_size // dims.dp},
        mesh_groups={d: _partition(groups.by_dim[d]) for d in groups.dims},
        declared_groups={d: [list(g) for g in dims.all_groups(d)] for d in dims.names},
        ranks=[rank_rows[r] for r in sorted(rank_rows)],
        one_device={"params": base.param_bytes, "grads": base.grad_bytes, "optim": base.optim_bytes,
                    "activations": base.activation_bytes, "parameters": sum(p.numel() for p in case.build_model("cpu").parameters())},
        collectives=_collective_table(records, world),
        diagnoses=_dedupe(found),
        elapsed_s=time.monotonic() - started,
    )
    if any(row["optim"] != row["expected"]["optim"] for row in report.ranks):
        report.notes.append("optimizer state measured = arithmetic + Adam's per-parameter step counters "
                            f"({report.ranks[0]['optim'] - report.ranks[0]['expected']['optim']} B on rank 0): scalars, never sharded")
    return report


def _dedupe(found: list[Diagnosis]) -> list[Diagnosis]:
    out: list[Diagnosis] = []
    for d in found:
        if not any(o.code == d.code and o.summary == d.summary for o in out):
            out.append(d)
    return out


def _collective_table(records: Mapping[int, list[CollectiveRecord]], world: int) -> list[dict[str, Any]]:
    """Per kind of group (its dim, or the pipeline boundary) and op: the count and bytes of
    one training step on one member, how many groups there are, and the bytes over the whole
    world (set-up collectives, such as distributing the initial weights, are left out)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    records = {r: [c for c in cs if c.step == 0 and c.phase == "train"] for r, cs in records.items()}
    for rank in sorted(records):
        per_rank: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for c in records[rank]:
            kind = c.group_desc or c.group
            per_rank[(kind, c.op)][0] += 1
            per_rank[(kind, c.op)][1] += record_bytes(c)
        for key, (count, nbytes) in per_rank.items():
            row = rows.setdefault(key, {"group": key[0], "op": key[1], "count_per_rank": count, "bytes_per_rank": nbytes,
                                        "ranks": 0, "groups": set(), "world_bytes": 0})
            row["count_per_rank"] = max(row["count_per_rank"], count)
            row["bytes_per_rank"] = max(row["bytes_per_rank"], nbytes)
            row["ranks"] += 1
            row["world_bytes"] += nbytes
        for c in records[rank]:
            rows[(c.group_desc or c.group, c.op)]["groups"].add(c.group)
    out = []
    for key in sorted(rows):
        row = rows[key]
        row["groups"] = len(row["groups"])
        out.append(row)
    return out


def format_layout(report: LayoutReport, *, all_ranks: bool = False) -> str:
    """The report as text: verdict, mesh groups, memory per rank against one device and the
    arithmetic, collectives per step. ``all_ranks``: every rank's row (default: the first
    rank of each stage and TP coordinate pattern, plus any rank whose figures differ)."""
    p = report.plan
    head = "PASS" if not report.diagnoses else f"FAIL  {' '.join(dict.fromkeys(report.codes))}"
    lines = [f"{head}  [layout {p['name']}: pp={p['dims']['pp']} dp={p['dims']['dp']} tp={p['dims']['tp']} = "
             f"{p['world_size']} simulated ranks, global batch {p['global_batch']}, {p['micro_batches']} micro-batch(es), "
             f"{report.elapsed_s:.1f} s]"]
    if p.get("description"):
        lines.append(f"  {p['description']}")
    for d in report.diagnoses:
        lines.append(f"  {d.code}: {d.summary}")
    lines.append(f"  mesh dims {p['mesh_dims']} (outermost first); each data-parallel replica reads "
                 f"{p['per_replica_batch']} samples per step")
    for dim, groups in report.mesh_groups.items():
        shown = ", ".join(str(g) for g in groups[:4]) + (f", ... ({len(groups)} groups)" if len(groups) > 4 else "")
        declared = report.declared_groups.get(dim)
        flag = "" if declared is None or declared == groups else f"   <- declared {declared[:2]}..."
        lines.append(f"    {dim:>2} groups: {shown}{flag}")
    one = report.one_device
    one_state = one["params"] + one["grads"] + one["optim"]
    lines.append(f"  memory per rank (one device: {one['parameters']} parameters, state {format_bytes(one_state)}, "
                 f"activations {format_bytes(one['activations'])}):")
    lines.append(f"    {'rank':>4} {'mesh':<24} {'stage':>5} {'params':>10} {'grads':>10} {'optim':>10} {'state':>10} "
                 f"{'arithmetic':>10} {'vs 1 dev':>8} {'activ.':>10}  samples (step 0)")
    seen: set[tuple] = set()
    for row in report.ranks:
        state = row["params"] + row["grads"] + row["optim"]
        expected = sum(row["expected"].values())
        key = (row["stage"], row["params"], row["grads"], row["optim"], row["activations"])
        if not all_ranks and key in seen:
            continue
        seen.add(key)
        mesh = ",".join(f"{k}={v}" for k, v in row["mesh"].items())
        ids = row["samples"]
        sample_text = f"{sum(len(m) for m in ids)} ids {ids[0][:4]}{'...' if len(ids[0]) > 4 else ''}"
        lines.append(f"    {row['rank']:>4} {mesh:<24} {row['stage']:>5} {format_bytes(row['params']):>10} "
                     f"{format_bytes(row['grads']):>10} {format_bytes(row['optim']):>10} {format_bytes(state):>10} "
                     f"{format_bytes(expected):>10} {state / one_state:>8.3f} {format_bytes(row['activations']):>10}  {sample_text}")
    if not all_ranks and len(seen) < len(report.ranks):
        lines.append(f"    ({len(report.ranks) - len(seen)} more ranks with the same figures as a row above; --all-ranks lists them)")
    lines.append("  collectives of one step (per rank, and over all ranks):")
    for row in report.collectives:
        lines.append(f"    {row['group']:<28} {row['op']:<14} x{row['count_per_rank']:<4} {format_bytes(row['bytes_per_rank']):>10} per rank"
                     f"   {row['groups']:>3} groups, {format_bytes(row['world_bytes']):>10} in all")
    for note in report.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
