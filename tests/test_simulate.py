"""Simulated ranks (harness.simulate): DTensor strategies on N ranks in the pytest process, the
same record, trace and diagnosis codes as real ranks; clear refusals; the layout check.

The bugs run on cases of this file's choosing (the MLP where it can show them: cheap); the
bundled 8-rank demo and the seeds' 64-rank layouts run under ``-m slow``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cases.bugs.tp_per_rank_batches import PerRankBatchTP
from cases.bugs.tp_rank_seeded_dropout import RankSeededTP
from cases.catalog import mlp_case, transformer_case
from cases.layouts import LAYOUT_TARGETS, layout_plan
from cases.mesh_targets import SIMULATION_DEMO
from cases.strategies.ddp import DDPStrategy
from cases.strategies.fsdp import FSDPStrategy
from cases.strategies.hybrid import DDPTensorParallelStrategy, apply_replicate
from cases.strategies.manual_tp import ManualTensorParallel
from cases.strategies.pipeline import PipelineStrategy
from cases.strategies.tp import TensorParallelStrategy, apply_tensor_parallel
from harness.parallel_dims import ParallelDims
from harness.pipeline import simulate_target
from harness.simulate import SimulatedWorld, SimulationError
from harness.simulate.layout import check_layout
from harness.strategy import RankSetup
from harness.targets.bundled import load_target
from harness.targets.target import Target
from harness.testing import assert_matches_reference

REPO = Path(__file__).resolve().parents[1]


class _TransposedMeshDPxTP(DDPTensorParallelStrategy):
    """Bug: the rank tensor enumerated (tp, dp) but named (dp, tp)."""

    name = "dp-tp-transposed-mlp"

    def setup(self, case, ctx):
        dims = ParallelDims.for_world(ctx.world_size, tp=self.tp)
        ranks = torch.arange(ctx.world_size).reshape(dims.tp, dims.dp).T.contiguous()
        mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "tp"))
        model = case.build_model(ctx.device)
        apply_tensor_parallel(model, mesh["tp"])
        apply_replicate(model, mesh["dp"])
        return RankSetup.on_mesh(case, ctx, model, dims, mesh)


def _diagnose(strategy, nproc, tmp_path, reference_cache, **case_options):
    target = Target(strategy.name, mlp_case("adamw", steps=2, **case_options), strategy)
    return simulate_target(target, nproc, workdir=tmp_path, cache=reference_cache)


@pytest.mark.simulate(nproc=4)
def test_tensor_parallel_on_simulated_ranks_matches_the_reference(sim_ranks, reference_cache, tmp_path) -> None:
    result = assert_matches_reference(mlp_case("adamw", steps=2), TensorParallelStrategy(), sim_ranks, cache=reference_cache,
                                      workdir=tmp_path)
    assert result.passed and result.world_size == 4
    assert not dist.is_initialized()  # the fake group is gone


def test_dp_x_tp_with_replicate_passes_and_the_trace_holds_every_rank(reference_cache, tmp_path) -> None:
    from harness.tracing.run_trace import RunTrace

    report = _diagnose(DDPTensorParallelStrategy(tp=2), 4, tmp_path, reference_cache)
    assert report.verdict.verdict == "pass", report.verdict.to_dict()
    assert report.target["simulated"] is True
    trace = RunTrace.load(next(tmp_path.glob("simulated-*/trace.json")))
    assert sorted(trace.ranks) == [0, 1, 2, 3]
    # seed 000 section 9 in small: replicas read different samples, TP peers the same ones
    assert trace.ranks[0].samples[0] == trace.ranks[1].samples[0] != trace.ranks[2].samples[0]
    ops = {(c.group_desc, c.op) for c in trace.ranks[3].events() if c.step == 0}
    assert ("mesh_dp", "all_reduce") in ops and ("mesh_tp", "all_reduce") in ops
    assert all(sorted(c.group_ranks) == [1, 3] for c in trace.ranks[3].events() if c.group_desc == "mesh_dp")


def test_tp_peers_reading_different_samples_are_named(reference_cache, tmp_path) -> None:
    report = _diagnose(PerRankBatchTP(), 4, tmp_path, reference_cache)
    assert report.codes == ["inconsistent-replica-inputs"], report.verdict.to_dict()


def test_rank_seeded_dropout_is_rng_desync_and_the_correct_dropout_passes(reference_cache, tmp_path) -> None:
    # The transformer: its dropouts act on replicated activations, so TP peers drawing the same
    # masks match one device (the MLP's dropout acts on fc1's sharded output and never can).
    case = transformer_case(steps=1, layers=2, dropout=0.1)
    bug = simulate_target(Target("bug", case, RankSeededTP()), 2, workdir=tmp_path / "bug", cache=reference_cache)
    assert bug.codes == ["rng-desync"], bug.verdict.to_dict()
    good = simulate_target(Target("good", case, TensorParallelStrategy()), 2, workdir=tmp_path / "good", cache=reference_cache)
    assert good.verdict.verdict == "pass", good.verdict.to_dict()


def test_a_transposed_mesh_is_swapped_mesh_dims_with_the_enumeration_order(reference_cache, tmp_path) -> None:
    report = _diagnose(_TransposedMeshDPxTP(tp=2), 4, tmp_path, reference_cache)
    assert report.codes[0] == "swapped-mesh-dims", report.verdict.to_dict()
    evidence = report.diagnoses[0].evidence  # 2 x 2: each dim's groups are exactly the other's
    assert evidence["kind"] == "swapped" and sorted(evidence["dims"]) == ["dp", "tp"], evidence


@pytest.mark.parametrize("strategy, why", [
    (FSDPStrategy(), "fully_shard"),
    (DDPStrategy(), "DistributedDataParallel"),
    (ManualTensorParallel(), "no DTensor parameter"),
    (PipelineStrategy("gpipe"), "pipeline stages"),
])
def test_what_cannot_be_simulated_is_refused_with_the_reason_and_the_real_rank_command(strategy, why, tmp_path, reference_cache) -> None:
    case = mlp_case("adamw", steps=1) if not isinstance(strategy, PipelineStrategy) else load_target("gpipe").case.replace(steps=1)
    with pytest.raises(SimulationError) as err:
        simulate_target(Target(strategy.name, case, strategy), 2, workdir=tmp_path, cache=reference_cache)
    assert why in str(err.value) and "--nproc N" in str(err.value), str(err.value)
    assert not dist.is_initialized()
    assert dist.get_rank.__module__ == "torch.distributed.distributed_c10d"  # the rank patch is undone


class _SetupBug(TensorParallelStrategy):
    name = "tp-setup-bug"

    def setup(self, case, ctx):
        raise ValueError("my plan names a layer that does not exist")


class _StepBug(TensorParallelStrategy):
    name = "tp-step-bug"

    def optimizer_step(self, case, setup):
        if setup.state.setdefault("steps", 0) == 1:
            raise RuntimeError("my scheduler broke at step 1")
        setup.state["steps"] += 1
        super().optimizer_step(case, setup)


def test_the_users_own_errors_stay_theirs_and_a_partial_record_is_kept(tmp_path, reference_cache) -> None:
    with pytest.raises(ValueError, match="my plan names a layer"):
        simulate_target(Target("setup-bug", mlp_case("adamw", steps=1), _SetupBug()), 2, workdir=tmp_path, cache=reference_cache)
    with pytest.raises(RuntimeError, match="my scheduler broke"):
        simulate_target(Target("step-bug", mlp_case("adamw", steps=3), _StepBug()), 2, workdir=tmp_path, cache=reference_cache)
    from reference.record import Record

    left = Record.load(tmp_path / "simulated-tp-step-bug-mlp-adamw-w2")  # published, marked incomplete
    assert not left.complete and left.num_steps == 2  # step 1: its gradients, recorded before the optimizer raised
    assert not dist.is_initialized()


def test_a_custom_loop_is_refused_before_anything_runs() -> None:
    with pytest.raises(SimulationError, match="custom training loop"):
        simulate_target(load_target("custom-example"), 2)


def test_the_world_is_torn_down_after_an_error_inside_it() -> None:
    with pytest.raises(ZeroDivisionError):
        with SimulatedWorld(4):
            assert isinstance(dist.get_rank(), torch.SymInt)
            1 / 0
    assert not dist.is_initialized()
    assert dist.get_rank.__module__ == "torch.distributed.distributed_c10d"
    with SimulatedWorld(2):  # and a new one starts cleanly
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        assert mesh.size() == 2


def test_a_simulated_world_inside_a_process_group_is_refused() -> None:
    with SimulatedWorld(2):
        with pytest.raises(SimulationError, match="already initialised"):
            SimulatedWorld(2).__enter__()


def test_layout_check_of_a_3d_mesh_shows_groups_samples_memory_and_collectives() -> None:
    report = check_layout(layout_plan(dp=2, tp=2, pp=2, micro_batches=2))
    assert report.diagnoses == [], [d.summary for d in report.diagnoses]
    assert report.mesh_groups == {"pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                                  "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    rows = {r["rank"]: r for r in report.ranks}
    assert rows[0]["samples"] == rows[1]["samples"] == rows[4]["samples"]  # TP peers and the next stage
    assert set(sum(rows[0]["samples"], [])).isdisjoint(sum(rows[2]["samples"], []))  # two replicas
    for row in report.ranks:  # measured state = the arithmetic, but for Adam's scalar step counters
        assert row["params"] == row["expected"]["params"] and row["grads"] == row["expected"]["grads"]
        assert 0 <= row["optim"] - row["expected"]["optim"] < 1024
    one_device_state = sum(report.one_device[k] for k in ("params", "grads", "optim"))
    assert all(r["params"] + r["grads"] + r["optim"] < one_device_state / 2 for r in report.ranks)
    table = {(row["group"], row["op"]): row for row in report.collectives}
    assert table[("mesh_dp", "all_reduce")]["count_per_rank"] == 3  # one per replicate group (2 blocks + root), once a step
    assert table[("pipeline p2p (forward)", "send")]["count_per_rank"] == 2  # one activation per micro-batch
    assert table[("pipeline p2p (forward)", "send")]["ranks"] == 4  # stage 0 sends, stage 1 receives
    assert table[("mesh_tp", "all_reduce")]["count_per_rank"] > 0


def test_a_mesh_enumerated_in_another_dim_order_is_one_swapped_mesh_dims_finding() -> None:
    """check_mesh on the trace of a (dp=2, tp=4) job whose DeviceMesh numbered ranks tp-major:
    both dims' groups are wrong, and the finding names the order (no simulation needed)."""
    from harness.tracing.mesh import check_mesh
    from harness.tracing.run_trace import RankTrace, RunTrace

    declared = ParallelDims(dp=2, tp=4)
    actual = torch.arange(8).reshape(4, 2).T  # actual[dp][tp]: rank 1 is (dp=1, tp=0)
    where = {int(actual[d, t]): {"dp": d, "tp": t} for d in range(2) for t in range(4)}
    ranks = {}
    for r in range(8):
        mine = where[r]
        groups = {
            "dp": sorted(q for q, c in where.items() if c["tp"] == mine["tp"]),
            "tp": sorted(q for q, c in where.items() if c["dp"] == mine["dp"]),
        }
        ranks[r] = RankTrace(
            rank=r, world_size=8, layout=declared.layout(r).to_json(),
            device_meshes=[{"dims": ["dp", "tp"], "coords": mine, "groups": {d: {"name": f"{d}{g[0]}", "ranks": g} for d, g in groups.items()}}],
            groups={f"{d}{g[0]}": {"ranks": g, "desc": f"mesh_{d}", "dims": [d], "roles": []} for d, g in groups.items()},
        )
    found = check_mesh(RunTrace(ranks=ranks))
    assert [d.code for d in found] == ["swapped-mesh-dims"], [d.summary for d in found]
    assert found[0].evidence["kind"] == "enumeration-order" and found[0].evidence["mesh_order"] == ["tp", "dp"]
    assert "numbers its ranks with dims in the order ('tp', 'dp') but names them ('dp', 'tp')" in found[0].summary


def test_cli_refuses_fsdp_under_simulation_with_usage_status(capsys) -> None:
    from harness import cli

    assert cli.main(["diagnose", "fsdp", "--simulate", "2", "-q"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot simulate fsdp (fully_shard)" in err and "--nproc N" in err
    assert cli.main(["diagnose", "--simulate", "4"]) == cli.EXIT_USAGE  # the simulated demo is the 8-rank one
    assert cli.main(["diagnose", "tp", "--simulate", "2", "--nproc", "2"]) == cli.EXIT_USAGE


@pytest.mark.parametrize("pp", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_a_pipeline_of_one_block_a_stage_is_checked(pp: int) -> None:
    """Each stage holds one block of its ModuleDict: the container has no forward to wrap, so
    its block is the replicated unit (a pipeline of 4 or more stages once crashed in replicate)."""
    report = check_layout(layout_plan(pp=pp))
    assert report.diagnoses == [], [d.summary for d in report.diagnoses]
    assert sorted(report.mesh_groups["pp"]) == [list(range(pp))]
    assert all(row["params"] == row["expected"]["params"] for row in report.ranks)


def test_layout_of_a_model_the_degrees_do_not_split_is_a_usage_error(capsys) -> None:
    """--heads / --layers fix the model: tp=5 over 4 heads (or pp=3 over 4 layers) exits with
    the usage status naming the degrees that would split it; without them the plan says how
    it widened the model."""
    from harness import cli

    assert cli.main(["layout", "--dp", "3", "--tp", "5", "--heads", "4", "-q"]) == cli.EXIT_USAGE
    assert "tp=5 does not divide the model's 4 heads; tp may be one of [1, 2, 4]" in capsys.readouterr().err
    assert cli.main(["layout", "--pp", "3", "--layers", "4", "-q"]) == cli.EXIT_USAGE
    assert "pp=3 does not divide the model's 4 layers" in capsys.readouterr().err
    assert cli.main(["layout", "--heads", "0"]) == cli.EXIT_USAGE
    plan = layout_plan(dp=3, tp=5)
    assert "5 heads, not 4, so that tp=5 divides them" in plan.description
    assert "widened" not in layout_plan(tp=2, heads=4, layers=4).description


@pytest.mark.slow
def test_the_simulated_demo_names_every_mesh_bug_at_8_ranks(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "harness", "diagnose", "--simulate", "8", "-q", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{len(SIMULATION_DEMO)}/{len(SIMULATION_DEMO)} named as expected" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["seed-64gpu", "seed-64gpu-swapped-mesh"])
def test_the_64_gpu_seed_layouts(name: str) -> None:
    target = LAYOUT_TARGETS[name]()
    report = check_layout(target.layout)
    assert report.plan["world_size"] == 64
    if target.expected_code:
        assert report.codes == [target.expected_code], [d.summary for d in report.diagnoses]
    else:
        assert report.diagnoses == []
        assert report.plan["per_replica_batch"] == 32
        assert {len(g) for g in report.mesh_groups["tp"]} == {8} and report.mesh_groups["tp"][0] == list(range(8))
