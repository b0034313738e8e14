"""Tracing on real ranks: each check catches its bug, and correct strategies raise no alarm.

Buggy strategies live here (small variants of correct ones); the TP and 2x2 strategies are
minimal DTensor implementations on the MLP case, so these tests do not depend on the strategy
catalogue."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from cases import mlp_case
from cases.strategies import DDPStrategy
from harness.parallel_dims import ParallelDims
from harness.run import run_strategy
from harness.strategy import RankSetup, StrategyBase
from harness.tracing import (
    RunTrace,
    Tracer,
    check_collectives,
    check_samples,
    run_checks,
    trace_samples,
)
from reference import Batch, Case, Record, collate
from reference.schedule import micro_batch_indices, replica_micro_batch_indices

# -- strategies --------------------------------------------------------------------------------


class UnshardedSamplerDDP(DDPStrategy):
    """BUG: every rank iterates the whole global batch (a loader without DistributedSampler)."""

    name = "ddp-unsharded"

    def local_batches(self, case: Case, setup: RankSetup, step: int) -> list[Batch]:
        return [collate(case.dataset, idx, device=setup.device, dtype=case.dtype) for idx in micro_batch_indices(case, step)]


class MlpTensorParallel(StrategyBase):
    """Tensor parallelism on the MLP with DTensor: fc1 column-wise, fc2 row-wise, over a mesh
    of every rank (``ParallelDims(tp=world)``); every rank consumes the whole global batch."""

    name = "mlp-tp"

    def setup(self, case: Case, ctx) -> RankSetup:
        dims = ParallelDims(tp=ctx.world_size)
        mesh = dims.build_mesh(ctx.device.type)
        model = case.build_model(ctx.device)
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        return RankSetup(model, case.build_optimizer(model.parameters()), dims.layout(ctx.rank), ctx.device, state={"mesh": mesh})

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]):
        losses = []
        for batch in micro_batches:
            loss = case.forward_loss(setup.model, batch)
            (loss * case.loss_weight(len(batch), setup.layout.dp_size)).backward()
            losses.append(loss.detach() if setup.layout.holds_loss else None)
        return losses


class TensorParallelFedDifferentBatches(MlpTensorParallel):
    """BUG: the data loader is sharded by global rank, so the two ranks of one tensor-parallel
    group compute on different samples."""

    name = "mlp-tp-rank-sharded-data"

    def local_batches(self, case: Case, setup: RankSetup, step: int) -> list[Batch]:
        rank, world = dist.get_rank(), dist.get_world_size()
        return [collate(case.dataset, idx, device=setup.device, dtype=case.dtype)
                for idx in replica_micro_batch_indices(case, step, rank, world)]


class DataTensorParallel2x2(MlpTensorParallel):
    """2x2 mesh (dp outer, tp inner, as :class:`ParallelDims` lays it out): tensor parallelism
    over the tp dim, gradients averaged by hand over the dp dim's group."""

    name = "mlp-dp-tp"
    mesh_dim_names = ("dp", "tp")

    def setup(self, case: Case, ctx) -> RankSetup:
        dims = ParallelDims(dp=2, tp=2)
        dims.check_world(ctx.world_size)
        mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=self.mesh_dim_names)
        model = case.build_model(ctx.device)
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        return RankSetup(model, case.build_optimizer(model.parameters()), dims.layout(ctx.rank), ctx.device, state={"mesh": mesh})

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]):
        losses = super().forward_backward(case, setup, micro_batches)
        group = setup.state["mesh"].get_group("dp")
        for p in setup.model.parameters():
            local = p.grad.to_local()
            dist.all_reduce(local, group=group)
            local.div_(dist.get_world_size(group))
        return losses


class SwappedMeshDims2x2(DataTensorParallel2x2):
    """BUG: the mesh is built with its dim names in the wrong order, so the "tp" groups run
    along the data-parallel dim and the "dp" groups along the tensor-parallel one."""

    name = "mlp-dp-tp-swapped"
    mesh_dim_names = ("tp", "dp")


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _load(result) -> tuple[Record, RunTrace]:
    return Record.load(result.record_path), RunTrace.load(result.trace_path)


def _reference(case: Case, cache: str) -> Record:
    from reference.cache import cached_reference

    return cached_reference(case, cache=cache)


# -- data parallelism ---------------------------------------------------------------------------


@pytest.mark.distributed(nproc=2)
def test_ddp_trace_is_complete_and_raises_no_alarm(dist_ctx, tmp_path, reference_cache) -> None:
    case = mlp_case("adamw", steps=2)
    result = run_strategy(case, DDPStrategy(), dist_ctx, workdir=tmp_path, cache=reference_cache)
    assert result.passed, result.summary()
    if dist_ctx.rank != 0:
        return
    record, trace = _load(result)
    assert sorted(trace.ranks) == [0, 1] and trace.complete
    assert run_checks(record, _reference(case, reference_cache), trace) == []
    for rank, rt in trace.ranks.items():
        assert rt.coords == {"dp": rank} and rt.params["fc1.weight"]["local_shape"] == [16, 8]
        assert rt.samples == {s: rank_ids for s, rank_ids in ((st.step, st.rank_sample_ids[rank]) for st in record.steps)}
        assert "grad-sync" in rt.groups["0"]["roles"]  # DDP's process group
        # DDP's reducer all-reduces from C++: Flight Recorder has it, with the call site in
        # the strategy's backward, one bucket per step.
        train = [c for c in rt.events() if c.phase == "train"]
        reducer = [c for c in train if c.op == "all_reduce" and c.source == "fr"]
        assert [c.step for c in reducer] == [0, 1]
        assert all("cases/strategies/ddp.py" in c.call_site and "forward_backward" in c.call_site for c in reducer)
        assert reducer[0].shapes == [[16 * 8 + 16 + 4 * 16 + 4]] and reducer[0].dtypes == ["float32"]
        assert all(c.step is None for c in rt.events() if c.phase == "setup")  # DDP's initial broadcast
        assert any(c.phase == "harness" for c in rt.collectives)  # the recorder's own, kept apart
    summary = trace.collective_summary()
    assert {"step": 0, "group": "default_pg [0, 1]", "group_ranks": [0, 1], "op": "all_reduce", "count": 1, "bytes": 212 * 4} in summary
    report = trace.to_report()
    assert set(report["events"]) == {"0", "1"} and report["summary"] == summary


@pytest.mark.distributed(nproc=2)
def test_an_unsharded_sampler_is_named_duplicate_samples(dist_ctx, tmp_path, reference_cache) -> None:
    case = mlp_case("sgd", steps=2)
    result = run_strategy(case, UnshardedSamplerDDP(), dist_ctx, workdir=tmp_path, cache=reference_cache)
    if dist_ctx.rank != 0:
        return
    record, trace = _load(result)
    found = run_checks(record, _reference(case, reference_cache), trace)
    assert [d.code for d in found] == ["duplicate-samples"], found
    ev = found[0].evidence
    step0 = [case.dataset[i].id for i in micro_batch_indices(case, 0)[0]]
    assert ev["id"] == min(step0) and ev["ranks"] == [0, 1] and ev["steps"] == [0]  # the first, by step then id
    assert ev["count"] == 2 * case.global_batch_size  # every sample of both steps, twice
    assert f"sample {ev['id']} was consumed 2 times in epoch 0" in found[0].summary
    # the same from the trace alone (a user's loop without a record)
    assert [d.code for d in check_samples(None, None, trace)] == ["duplicate-samples"]


# -- tensor parallelism -----------------------------------------------------------------------


@pytest.mark.distributed(nproc=2)
def test_tensor_parallel_traces_its_groups_and_raises_no_alarm(dist_ctx, tmp_path, reference_cache) -> None:
    case = mlp_case("adamw", steps=2)
    result = run_strategy(case, MlpTensorParallel(), dist_ctx, workdir=tmp_path, cache=reference_cache)
    assert result.passed, result.summary()
    if dist_ctx.rank != 0:
        return
    record, trace = _load(result)
    assert run_checks(record, _reference(case, reference_cache), trace) == []
    rt = trace.rank(1)
    assert rt.coords == {"tp": 1}
    assert rt.params["fc1.weight"] == {"shape": [16, 8], "local_shape": [8, 8], "dtype": "float32",
                                        "placements": ["Shard(dim=0)"], "mesh_dims": ["tp"]}
    assert rt.device_meshes[0]["dims"] == ["tp"] and rt.device_meshes[0]["groups"]["tp"]["ranks"] == [0, 1]
    # DTensor's row-parallel all-reduce runs from C++ (functional collectives): traced, per step,
    # with the model line that needed it as call site.
    train = [c for c in rt.events() if c.phase == "train" and c.step == 0]
    assert [(c.op, c.shapes, c.source) for c in train] == [("all_reduce", [[16, 4]], "fr")], [c.describe() for c in train]
    assert "tp" in rt.groups[train[0].group]["dims"]  # the mesh's tp dim is this group
    from cases.models import TwoLayerMLP

    assert train[0].call_site.endswith(f"cases/models.py:{_line_of(TwoLayerMLP.forward, 'self.fc2(')} in forward")


@pytest.mark.distributed(nproc=2)
def test_a_tensor_parallel_group_fed_different_batches_is_named(dist_ctx, tmp_path, reference_cache) -> None:
    case = mlp_case("sgd", steps=1)
    result = run_strategy(case, TensorParallelFedDifferentBatches(), dist_ctx, workdir=tmp_path, cache=reference_cache)
    if dist_ctx.rank != 0:
        return
    record, trace = _load(result)
    found = run_checks(record, _reference(case, reference_cache), trace)
    assert [d.code for d in found] == ["inconsistent-replica-inputs"], found
    ev = found[0].evidence
    assert ev["replica"] == 0 and ev["ranks"] == [0, 1] and ev["step"] == 0 and ev["micro"] == 0
    assert set(ev["ids_per_rank"]["0"]).isdisjoint(ev["ids_per_rank"]["1"])


# -- a 2x2 mesh -----------------------------------------------------------------------------------


@pytest.mark.distributed(nproc=4)
@pytest.mark.parametrize("strategy", [DataTensorParallel2x2(), SwappedMeshDims2x2()], ids=["correct", "swapped"])
def test_swapped_mesh_dims_on_a_2x2_mesh(dist_ctx, tmp_path, reference_cache, strategy) -> None:
    case = mlp_case("sgd", steps=1)
    result = run_strategy(case, strategy, dist_ctx, workdir=tmp_path, cache=reference_cache)
    if dist_ctx.rank != 0:
        return
    record, trace = _load(result)
    found = run_checks(record, _reference(case, reference_cache), trace)
    if isinstance(strategy, SwappedMeshDims2x2):
        assert [d.code for d in found] == ["swapped-mesh-dims"], found
        ev = found[0].evidence
        assert ev["kind"] == "swapped" and sorted(ev["dims"]) == ["dp", "tp"]
        assert ev["expected"] == {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}
        assert ev["actual"] == {"dp": [[0, 1], [2, 3]], "tp": [[0, 2], [1, 3]]}
    else:
        assert result.passed, result.summary()
        assert found == []
        groups = {info["desc"]: info for info in trace.rank(0).groups.values() if info["dims"]}
        assert groups["mesh_dp"]["ranks"] == [0, 2] and "grad-sync" in groups["mesh_dp"]["roles"]
        assert groups["mesh_tp"]["ranks"] == [0, 1]


# -- collectives in a finished run ------------------------------------------------------------------


@pytest.mark.distributed(nproc=2)
def test_a_reduce_op_that_differs_between_ranks_is_a_mismatch(dist_ctx) -> None:
    with Tracer() as tracer:
        tracer.begin_step(0)
        t = torch.ones(4)
        dist.all_reduce(t)  # same on both ranks
        dist.all_reduce(t, op=dist.ReduceOp.SUM if dist_ctx.rank == 0 else dist.ReduceOp.MAX)  # differs
        dist.broadcast(t, src=0)
    trace = tracer.gather(dst=0)
    if dist_ctx.rank != 0:
        return
    found = check_collectives(trace)
    assert [d.code for d in found] == ["collective-mismatch"], found
    ev = found[0].evidence
    assert ev["per_rank"]["0"]["reduce_op"] == "sum" and ev["per_rank"]["1"]["reduce_op"] == "max"
    want = _line_of(test_a_reduce_op_that_differs_between_ranks_is_a_mismatch, "# differs")
    assert ev["per_rank"]["1"]["call_site"].endswith(f"test_tracing.py:{want} in test_a_reduce_op_that_differs_between_ranks_is_a_mismatch")
    first = trace.rank(0).events()[0].seq  # FR's own numbering: the group's count since it was created
    assert ev["position_per_rank"] == {"0": 1, "1": 1} and ev["seq"] == first + 1
    assert f"rank 0 issued all_reduce #{first + 1} [[4]] float32 sum" in found[0].summary
    assert f"rank 1 issued all_reduce #{first + 1} [[4]] float32 max" in found[0].summary


@pytest.mark.distributed(nproc=2)
def test_point_to_point_is_traced_and_a_shape_mismatch_named(dist_ctx) -> None:
    """A two-stage exchange as pipelining does it (batch_isend_irecv), then a send whose
    receiver expects another shape (gloo accepts it silently)."""
    peer = 1 - dist_ctx.rank
    with Tracer() as tracer:
        tracer.begin_step(0)
        out, inbox = torch.full((2, 3), float(dist_ctx.rank)), torch.empty(2, 3)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, inbox, peer)]):
            work.wait()
        assert inbox[0, 0].item() == peer
        tracer.begin_step(1)
        if dist_ctx.rank == 0:
            dist.send(torch.ones(4), dst=1)
        else:
            dist.recv(torch.empty(5), src=0)
    trace = tracer.gather(dst=0)
    if dist_ctx.rank != 0:
        return
    ops = [(c.op, c.peer, c.seq, c.step) for c in trace.rank(1).events()]
    assert ops == [("send", 0, 1, 0), ("recv", 0, 1, 0), ("recv", 0, 2, 1)]
    found = check_collectives(trace)
    assert [d.code for d in found] == ["collective-mismatch"], found
    ev = found[0].evidence
    assert ev["p2p"] is True and (ev["src"], ev["dst"], ev["seq"]) == (0, 1, 2)
    assert ev["per_rank"]["0"]["shapes"] == [[4]] and ev["per_rank"]["1"]["shapes"] == [[5]]
    summary = {r["op"]: r for r in trace.collective_summary() if r["step"] == 0}
    assert summary["send"]["count"] == 2 and summary["send"]["bytes"] == 2 * 6 * 4


@pytest.mark.distributed(nproc=2)
def test_trace_samples_records_a_users_loader(dist_ctx) -> None:
    loader = [{"id": torch.tensor([10 * s + dist_ctx.rank, 10 * s + 2 + dist_ctx.rank]), "x": torch.ones(2)} for s in range(3)]
    seen = []
    with Tracer() as tracer:
        for step, batch in enumerate(trace_samples(loader, ids=lambda b: b["id"])):
            tracer.begin_step(step)  # after fetching the batch, as loops usually do
            seen.append(batch["x"].sum().item())
            dist.all_reduce(batch["x"])
    assert seen == [2.0, 2.0, 2.0]  # batches pass unchanged
    trace = tracer.gather(dst=0)
    if dist_ctx.rank != 0:
        return
    assert trace.rank(1).samples == {0: [[1, 3]], 1: [[11, 13]], 2: [[21, 23]]}
    assert [(c.op, c.step) for c in trace.rank(1).events()] == [("all_reduce", 0), ("all_reduce", 1), ("all_reduce", 2)]
    assert check_samples(None, None, trace) == []
    # rank 1 reads rank 0's shard too: named
    trace.rank(1).samples[2] = [[21, 23, 20]]
    found = check_samples(None, None, trace)
    assert [d.code for d in found] == ["duplicate-samples"] and found[0].evidence["id"] == 20
    assert found[0].evidence["ranks"] == [0, 1] and found[0].evidence["steps"] == [2]


class FailsAtStep1(DDPStrategy):
    name = "ddp-fails"

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]):
        if self.step_seen:
            raise RuntimeError("boom at step 1")
        self.step_seen = True
        return super().forward_backward(case, setup, micro_batches)


@pytest.mark.distributed(nproc=2)
def test_a_failed_run_still_writes_each_ranks_trace(dist_ctx, tmp_path, reference_cache) -> None:
    strategy = FailsAtStep1()
    strategy.step_seen = False
    with pytest.raises(RuntimeError, match="boom at step 1"):
        run_strategy(mlp_case("sgd", steps=2), strategy, dist_ctx, workdir=tmp_path, cache=reference_cache)
    dist.barrier()  # both ranks failed alike and wrote their part
    if dist_ctx.rank != 0:
        return
    trace = RunTrace.load(tmp_path / "ddp-fails-mlp-sgd-w2.trace")
    assert sorted(trace.ranks) == [0, 1] and not trace.complete
    assert {c.step for c in trace.rank(1).events() if c.phase == "train"} == {0}  # step 0's all-reduce
