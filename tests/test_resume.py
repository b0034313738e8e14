"""The resume check (``--resume-at K``, ``assert_resumes``): a checkpoint saved by one run after
step K-1 (DCP), loaded on fresh ranks of the same or another layout, gated bitwise, then the
continuation compared with the uninterrupted run. Unit checks of the chunk-permutation test,
then real ranks: FSDP2 resumes into the same layout (bitwise), TP, FSDP2 + TP on 4, FSDP2 on 4
(slow) and the plain model on one process; per-rank RNG that cannot map to another world size
is reported as not transferable; the bundled bug cases are each named by
tests/test_diagnose.py, and two of them again here through pytest's ``assert_resumes``."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy
from cases.strategies.fsdp import FSDPStrategy
from harness import assert_resumes
from harness.analysis.resume import chunk_permutation
from harness.pipeline import diagnose_target
from harness.report import format_terminal
from harness.report.html import render_html
from harness.targets.target import TargetError


# -- the permutation test -------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(chunks=st.integers(2, 6), rows=st.integers(1, 3), cols=st.integers(1, 4), data=st.data())
def test_chunks_in_another_order_are_found_with_their_order(chunks: int, rows: int, cols: int, data: st.DataObject) -> None:
    saved = torch.randn(chunks * rows, cols)
    order = data.draw(st.permutations(range(chunks)))
    loaded = torch.cat([saved.chunk(chunks, 0)[j] for j in order])
    found = chunk_permutation(saved, loaded)
    if list(order) == list(range(chunks)):
        assert found is None
    else:
        assert found is not None and found["dim"] == 0
        # The fewest chunks that explain it: reassembling the saved chunks in that order gives the loaded tensor.
        pieces = saved.chunk(found["chunks"], 0)
        assert torch.equal(torch.cat([pieces[j] for j in found["order"]]), loaded)


def test_a_changed_value_is_no_permutation() -> None:
    saved = torch.arange(8.0).reshape(4, 2)
    loaded = saved.flip(0).clone()
    loaded[0, 0] += 1e-6
    assert chunk_permutation(saved, loaded) is None
    assert chunk_permutation(saved, saved.clone()) is None


# -- what is refused before any rank starts ---------------------------------------------------
def test_resume_arguments_that_cannot_work_are_refused_with_the_allowed_values() -> None:
    with pytest.raises(TargetError, match=r"allowed 1\.\.2"):
        diagnose_target("fsdp", resume_at=3)
    with pytest.raises(TargetError, match="need resume_at"):
        diagnose_target("fsdp", resume_into="tp")
    with pytest.raises(TargetError, match="layout check"):
        diagnose_target("seed-8gpu", resume_at=1)
    with pytest.raises(TargetError, match="micro_batches 4 against 1"):
        diagnose_target("gpipe", resume_at=1, resume_into="fsdp")
    with pytest.raises(TargetError, match="same case"):
        diagnose_target("fsdp", resume_at=1, resume_into="ddp")  # the MLP, not the transformer
    with pytest.raises(TargetError, match="one at a time"):
        diagnose_target("fsdp", resume_at=1, repeat=2)


def test_the_cli_refuses_resume_flags_it_cannot_honour(capsys) -> None:
    from harness import cli

    assert cli.main(["diagnose", "fsdp", "--resume-into", "tp"]) == 2
    assert "--resume-at" in capsys.readouterr().err
    assert cli.main(["diagnose", "fsdp", "--resume-at", "0"]) == 2
    assert cli.main(["diagnose", "fsdp", "--resume-at", "1", "--simulate", "2"]) == 2
    capsys.readouterr()
    assert cli.main(["diagnose", "fsdp", "--resume-at", "1", "--resume-nproc", "0"]) == 2  # never silently the default
    assert "--resume-nproc: a world size must be an int >= 1, got 0" in capsys.readouterr().err


def test_a_resume_check_that_cannot_run_is_never_a_pass(tmp_path, monkeypatch) -> None:
    """RESUME_NPROC beyond the machine is refused when the target is read, not after the saving
    run; a saving run that left no checkpoint makes the check an error, not a PASS."""
    from harness import pipeline
    from harness.codes import Verdict
    from harness.report.model import DiagnosisReport
    from harness.targets.target import load_target

    target = tmp_path / "huge.py"
    target.write_text("from cases.bugs.double_averaged_ddp import CASE\nfrom cases.strategies.ddp import DDPStrategy\n"
                      "STRATEGY = DDPStrategy\nRESUME_AT = 1\nRESUME_NPROC = 100000\n")
    with pytest.raises(TargetError, match="RESUME_NPROC: 100000 ranks exceed"):
        load_target(str(target))

    def saved_nothing(*args, **kwargs):  # a saving run that passed but wrote no checkpoint
        return DiagnosisReport(verdict=Verdict("pass", [], ""), target={"name": "ddp"}, comparison={"actual": str(tmp_path / "rec")})

    monkeypatch.setattr(pipeline, "_diagnose_once", saved_nothing)
    report = diagnose_target("ddp", resume_at=1, runner=object(), workdir=tmp_path / "run")
    assert report.verdict.verdict == "error" and report.exit_code != 0, report.verdict.to_dict()
    assert "resume check at step 1 could not run: the saving run left no checkpoint" in report.verdict.error


# -- real ranks ---------------------------------------------------------------------------------
def test_fsdp_resumes_bitwise_on_its_own_layout(rank_runner, reference_cache, tmp_path) -> None:
    report = diagnose_target("fsdp", steps=4, resume_at=2, runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    resume = report.resume
    assert report.verdict.verdict == "pass", (report.verdict.to_dict(), resume)
    assert resume["load_exact"] and resume["same_layout"] and resume["passed"]
    assert resume["continuation"] == {"compared": "bitwise", "last_step": 3}
    # Everything the gate compares was compared: every tensor of the model and optimizer, the
    # param groups, both ranks' RNG, the first resumed batch.
    assert resume["compared"]["param"] > 0 and resume["compared"]["optim"] == 3 * resume["compared"]["param"]
    assert resume["compared"]["ranks"] == 2 and resume["compared"]["samples"] == 8
    assert (tmp_path / "checkpoint" / "manifest.json").is_file()
    assert json.loads(json.dumps(report.to_json()))["resume"]["at"] == 2
    text = format_terminal(report)
    assert "load gate exact" in text and "bitwise equal to the uninterrupted run" in text
    assert "Resumed from a checkpoint" in render_html(report)


# Another layout at the same world size stays in the default suite; into one process (plain)
# is the same load and continuation at another world size, under -m slow with the 4-rank ones.
@pytest.mark.parametrize("into, nproc", [("tp", 2), pytest.param("plain", 1, marks=pytest.mark.slow),
                                         pytest.param("fsdp-tp", 4, marks=pytest.mark.slow),
                                         pytest.param("fsdp", 4, marks=pytest.mark.slow)])
def test_fsdp_on_2_resumes_into_another_layout(rank_runner, reference_cache, tmp_path, into: str, nproc: int) -> None:
    report = diagnose_target("fsdp", resume_at=2, resume_into=into, resume_nproc=nproc, runner=rank_runner,
                             cache=reference_cache, workdir=tmp_path)
    resume = report.resume
    assert report.verdict.verdict == "pass", (report.verdict.to_dict(), resume)
    assert resume["load_exact"] and not resume["same_layout"] and resume["world"] == nproc
    assert resume["into"]["target"] == into
    assert resume["continuation"]["compared"] == "stepwise tolerance"
    assert "first_difference" not in resume["continuation"]


PER_RANK_DROPOUT = '''
import torch
from cases.catalog import mlp_case
from cases.strategies.ddp import DDPStrategy

CASE = mlp_case("adamw", dropout=0.1)

class PerRankDropout(DDPStrategy):
    """Data parallelism with each replica's own dropout stream (seed + rank), as many loops do."""
    name = "ddp-per-rank-dropout"

    def setup(self, case, ctx):
        setup = super().setup(case, ctx)
        self.rank = ctx.rank
        return setup

    def forward_backward(self, case, setup, micro_batches):
        if not getattr(self, "seeded", False):
            torch.manual_seed(case.seed + 1000 * (self.rank + 1))
            self.seeded = True
        return super().forward_backward(case, setup, micro_batches)

STRATEGY = PerRankDropout
'''


def test_per_rank_rng_is_reported_not_transferable_to_another_world_size(rank_runner, reference_cache, tmp_path) -> None:
    target = tmp_path / "per_rank_dropout.py"
    target.write_text(PER_RANK_DROPOUT)
    report = diagnose_target(str(target), resume_at=2, resume_into=str(target), resume_nproc=1, runner=rank_runner,
                             cache=reference_cache, workdir=tmp_path / "run")
    resume = report.resume
    assert [n["state"] for n in resume["not_transferable"]] == ["rng"], resume
    assert resume["not_transferable"][0]["saved_world"] == 2 and resume["not_transferable"][0]["world"] == 1
    assert "not transferable to 1 ranks: rng" in format_terminal(report)
    # What can map did: the model, the optimizer, the scheduler-free param groups, the data.
    assert not [d for d in resume["gate"] if d["code"] != "resume-rng-not-restored"], resume["gate"]


@pytest.mark.distributed(nproc=2)
def test_assert_resumes_passes_a_correct_resume_into_another_strategy(dist_ctx, reference_cache) -> None:
    check = assert_resumes(mlp_case("adamw", steps=4), DDPStrategy(), dist_ctx, at=2, into=FSDPStrategy(), cache=reference_cache)
    assert check.passed and check.load_exact and not check.same_layout
    assert check.continuation["compared"] == "stepwise tolerance"


@pytest.mark.distributed(nproc=2)
def test_assert_resumes_fails_with_the_named_load_bug(dist_ctx, reference_cache) -> None:
    from cases.bugs.resume_step_counters_reset import CASE, StepCountersReset

    with pytest.raises(AssertionError) as failed:
        assert_resumes(CASE, StepCountersReset(), dist_ctx, at=2, cache=reference_cache)
    message = str(failed.value)
    assert "resume-step-reset" in message and "saved 2.0, loaded 0.0" in message
    assert "html report:" in message


# -- custom loops -------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["custom-example", "cases/pp_custom_example.py",
                                    pytest.param("cases/tp_custom_example.py", marks=pytest.mark.slow)])
def test_a_custom_loop_resumes_bitwise_through_the_harness_save(rank_runner, reference_cache, tmp_path, target: str) -> None:
    # The harness saves what run.watch was given (DCP), loads it at the end of watch on fresh
    # ranks, and the loop continues at run.start. The pipeline's stages hold different
    # parameters: their optimizer param groups must not overwrite each other in DCP.
    report = diagnose_target(target, resume_at=1, runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    resume = report.resume
    assert report.verdict.verdict == "pass", (report.verdict.to_dict(), resume)
    assert resume["load_exact"] and resume["same_layout"] and resume["continuation"]["compared"] == "bitwise"
    assert resume["compared"]["param"] > 0 and resume["compared"]["optim"] == 3 * resume["compared"]["param"]


GLUE_LOOP = '''
import dataclasses, functools, os
import torch
import torch.distributed as dist
from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = dataclasses.replace(mlp_case("sgd", steps=4), lr_scheduler_factory=functools.partial(
    torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5))
NPROC = 2


def train(ctx, run):
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    scheduler = CASE.build_lr_scheduler(optimizer)
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size), lr_scheduler=scheduler)
    for step in range(run.start, run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        run.before_step(step)
        optimizer.step()
        scheduler.step()
        run.after_step(step)
        optimizer.zero_grad()


def save(ctx, run, path):
    torch.save({"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
                "scheduler": run.lr_scheduler.state_dict()}, os.path.join(path, f"rank{ctx.rank}.pt"))


def load(ctx, run, path):
    state = torch.load(os.path.join(path, f"rank{ctx.rank}.pt"), weights_only=True)
    run.model.load_state_dict(state["model"])
    LOAD_OPTIMIZER
    run.lr_scheduler.load_state_dict(state["scheduler"])
'''


@pytest.mark.parametrize("load_optimizer, code", [("run.optimizer.load_state_dict(state['optimizer'])", None),
                                                  ("pass  # BUG: the momentum buffers start over", "resume-state-missing")])
def test_a_custom_loop_resumes_through_its_own_save_and_load(rank_runner, reference_cache, tmp_path,
                                                            load_optimizer: str, code: str | None) -> None:
    target = tmp_path / "glue_loop.py"
    target.write_text(GLUE_LOOP.replace("LOAD_OPTIMIZER", load_optimizer))
    report = diagnose_target(str(target), resume_at=2, runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    resume = report.resume
    assert (tmp_path / "run" / "checkpoint" / "loop" / "rank1.pt").is_file()  # the loop's own files, where path said
    if code is None:
        assert report.verdict.verdict == "pass", (report.verdict.to_dict(), resume)
        assert resume["load_exact"] and resume["continuation"]["compared"] == "bitwise"
    else:
        # Named at load time, with the entries and before any loss moves.
        assert code in report.verdict.codes, report.verdict.to_dict()
        missing = [d for d in resume["gate"] if d["code"] == code]
        assert {d["name"] for d in missing} >= {"fc1.weight.momentum_buffer"}, missing


def test_a_custom_loop_that_ignores_run_start_is_told_so(rank_runner, reference_cache, tmp_path) -> None:
    target = tmp_path / "from_zero.py"
    target.write_text(open("cases/custom_example.py").read().replace("range(run.start, run.steps)", "range(run.steps)"))
    report = diagnose_target(str(target), resume_at=1, runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    assert report.verdict.verdict == "error"
    assert "range(run.start, run.steps)" in format_terminal(report)


def test_checkpoint_glue_is_both_functions_of_the_file_with_ctx_run_path(tmp_path) -> None:
    from harness.targets.target import load_target

    head = "from cases.catalog import mlp_case\nCASE = mlp_case()\ndef train(ctx, run):\n    pass\n"
    cases = {
        "only_save.py": (head + "def save(ctx, run, path):\n    pass\n", "but not load"),
        "bad_args.py": (head + "def save(ctx, run):\n    pass\ndef load(ctx, run, path):\n    pass\n", "takes \\(ctx, run, path\\)"),
        "imported.py": (head + "from torch import save, load\n", None),
        "both.py": (head + "def save(ctx, run, path):\n    pass\ndef load(ctx, run, path):\n    pass\n", None),
    }
    for name, (text, error) in cases.items():
        (tmp_path / name).write_text(text)
        if error is not None:
            with pytest.raises(TargetError, match=error):
                load_target(str(tmp_path / name))
        else:
            glue = load_target(str(tmp_path / name)).checkpoint_glue
            assert (glue is None) == (name == "imported.py"), name
    with pytest.raises(TargetError, match="resumes into itself"):
        diagnose_target(str(tmp_path / "both.py"), resume_at=1, resume_into="custom-example")


def test_an_rng_nobody_draws_from_after_the_resume_is_a_note_not_a_bug(rank_runner, reference_cache, tmp_path) -> None:
    # The loop draws a number it never uses, and its load does not restore the generator: the
    # state differs, but nothing the run computes depends on it (no draw in the forward).
    target = tmp_path / "unused_rng.py"
    target.write_text(GLUE_LOOP.replace("LOAD_OPTIMIZER", "run.optimizer.load_state_dict(state['optimizer'])")
                      .replace("        for batch in run.batches(step):", "        torch.rand(1)  # a log line's jitter\n"
                               "        for batch in run.batches(step):", 1))
    report = diagnose_target(str(target), resume_at=2, runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    resume = report.resume
    assert report.verdict.verdict == "pass", (report.verdict.to_dict(), resume)
    assert any("RNG was not restored" in n and "cannot change the run" in n for n in resume["notes"]), resume["notes"]
    assert "note: rank 0's RNG was not restored" in format_terminal(report)


def test_a_custom_loop_that_records_before_its_scheduler_steps_is_told_the_order(rank_runner, reference_cache, tmp_path) -> None:
    target = tmp_path / "late_scheduler.py"
    target.write_text(GLUE_LOOP.replace("LOAD_OPTIMIZER", "pass")
                      .replace("        scheduler.step()\n        run.after_step(step)\n",
                               "        run.after_step(step)\n        scheduler.step()\n"))
    report = diagnose_target(str(target), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    assert report.verdict.verdict == "error"
    assert "optimizer.step(), lr_scheduler.step(), then run.after_step(step)" in format_terminal(report)


@pytest.mark.distributed(nproc=2)
def test_assert_resumes_takes_a_custom_loop_and_its_own_checkpoint_code(dist_ctx, reference_cache) -> None:
    from cases.bugs import resume_custom_loop_scheduler_forgotten as bug
    from cases.custom_example import CASE, train

    check = assert_resumes(CASE, train, dist_ctx, at=1, cache=reference_cache)
    assert check.passed and check.load_exact and check.same_layout
    with pytest.raises(AssertionError, match="resume-scheduler-not-restored"):
        assert_resumes(bug.CASE, bug.train, dist_ctx, at=2, save=bug.save, load=bug.load, cache=reference_cache)
    with pytest.raises(TypeError, match="come together"):
        assert_resumes(CASE, train, dist_ctx, at=1, save=bug.save)


def test_hand_sharded_weights_resume_into_a_replicated_layout(rank_runner, reference_cache, tmp_path) -> None:
    # manual-tp holds plain tensors with annotate_shard: saved as DTensors Shard(dim) over their
    # group, so DCP writes every rank's slice and DDP's whole weights load from them.
    report = diagnose_target("manual-tp", resume_at=1, resume_into="ddp", runner=rank_runner, cache=reference_cache,
                             workdir=tmp_path)
    resume = report.resume
    assert report.verdict.verdict == "pass", (report.verdict.to_dict(), resume)
    assert resume["load_exact"] and not resume["same_layout"]


def test_a_scheduler_fast_forwarded_one_step_short_is_named_by_the_load_gate(rank_runner, reference_cache, tmp_path) -> None:
    """The loop's own load fast-forwards a fresh scheduler by stepping it, one step short. The
    loop's order of calls is right (the scheduler steps between before_step and after_step):
    no order error; the load gate names the scheduler, and the continuation departs."""
    target = tmp_path / "fast_forward.py"
    target.write_text(GLUE_LOOP.replace("LOAD_OPTIMIZER", "run.optimizer.load_state_dict(state['optimizer'])")
                      .replace("    run.lr_scheduler.load_state_dict(state[\"scheduler\"])\n",
                               "    for _ in range(run.start - 1):  # BUG: one step short\n        run.lr_scheduler.step()\n"))
    report = diagnose_target(str(target), resume_at=2, runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    assert report.verdict.verdict == "fail", (report.verdict.to_dict(), report.resume)
    assert "resume-scheduler-not-restored" in report.verdict.codes, report.verdict.to_dict()
    [first, *_] = [d for d in report.resume["gate"] if d["code"] == "resume-scheduler-not-restored"]
    assert (first["detail"]["saved_last_epoch"], first["detail"]["loaded_last_epoch"]) == (2, 1), first
    assert "skipped" not in report.resume, report.resume


# -- what the load gate sees beyond the optimizer's state -------------------------------------
def test_a_duplicated_chunk_is_said_as_the_rank_that_holds_another_ranks_shard() -> None:
    from harness.analysis.resume import chunk_duplication

    saved = torch.arange(24.0).reshape(4, 6)
    assert chunk_duplication(saved, torch.cat([saved[:2], saved[:2]])) == {"dim": 0, "chunks": 2, "sources": [0, 0]}
    assert chunk_duplication(saved, saved.flip(0)) is None  # a permutation is the permuted-chunk check's
    assert chunk_duplication(saved, saved + 1) is None


EVERY_RANK_LOADS_RANK_ZERO = '''
import torch
import torch.distributed as dist
from cases.catalog import mlp_case
from cases.strategies.fsdp import FSDPStrategy

NPROC = 2
CASE = mlp_case("adamw")


class EveryRankLoadsRankZero(FSDPStrategy):
    name = "fsdp-rank-zero-shards"

    def load_checkpoint_state(self, case, setup, state):
        super().load_checkpoint_state(case, setup, state)
        with torch.no_grad():  # BUG: every rank reads rank 0's shard files
            for param in setup.model.parameters():
                dist.broadcast(param.to_local(), src=0)


STRATEGY = EveryRankLoadsRankZero
'''


def test_every_rank_loading_rank_zeros_fsdp_shards_names_the_duplicated_chunk(rank_runner, reference_cache, tmp_path) -> None:
    target = tmp_path / "rank_zero_shards.py"
    target.write_text(EVERY_RANK_LOADS_RANK_ZERO)
    report = diagnose_target(str(target), resume_at=2, runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    assert report.verdict.codes == ["resume-value-differs"], report.verdict.to_dict()
    duplicated = [d for d in report.resume["gate"] if d["detail"].get("duplicated")]
    assert duplicated and duplicated[0]["detail"]["sources"] == [0, 0], report.resume["gate"]
    assert "rank 1 holds rank 0's chunk" in duplicated[0]["line"], duplicated[0]
    summary = report.verdict.diagnoses[0].summary
    assert "()" not in summary and "loaded values differ" in summary, summary


BUFFER_LOOP = GLUE_LOOP.replace('''CASE = dataclasses.replace(mlp_case("sgd", steps=4), lr_scheduler_factory=functools.partial(''', '''from torch import nn


class Warmup(nn.Module):
    """An MLP whose output scale warms up over its first forwards: a buffer the forward reads."""

    def __init__(self):
        super().__init__()
        self.inner = mlp_case("sgd").model_factory()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.seen += 1
        return self.inner(x) * (1 + 0.25 * self.seen.clamp(max=4))


CASE = dataclasses.replace(mlp_case("sgd", steps=4), model_factory=Warmup, lr_scheduler_factory=functools.partial(''').replace(
    '''    torch.save({"model": run.model.state_dict(),''', '''    torch.save({"model": dict(run.model.named_parameters()),''').replace(
    '''    run.model.load_state_dict(state["model"])''', '''    run.model.load_state_dict(state["model"], strict=False)  # BUG: no buffers in it''')


def test_a_checkpoint_without_the_models_buffers_is_named_at_the_buffer(rank_runner, reference_cache, tmp_path) -> None:
    """The loop saves named_parameters() only: parameters and optimizer load exactly, the
    running count the forward reads starts over. The gate names the buffer."""
    target = tmp_path / "buffer_loop.py"
    target.write_text(BUFFER_LOOP.replace("LOAD_OPTIMIZER", "run.optimizer.load_state_dict(state['optimizer'])"))
    report = diagnose_target(str(target), resume_at=2, runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    assert report.verdict.codes == ["resume-value-differs"], (report.verdict.to_dict(), report.resume)
    [buffer] = [d for d in report.resume["gate"] if d["what"] == "buffer"]
    assert buffer["name"] == "seen" and "named_parameters()" in buffer["line"], buffer


RESEEDED_LOOP = open(__file__.replace("test_resume.py", "../cases/custom_example.py")).read().replace(
    'CASE = mlp_case("adamw")', 'CASE = mlp_case("adamw", steps=4, dropout=0.2)').replace(
    "    for step in range(run.start, run.steps):", "    if run.start:\n        torch.manual_seed(CASE.seed)  # BUG: re-seeded after the load\n"
    "    for step in range(run.start, run.steps):", 1).replace("import torch.distributed as dist", "import torch\nimport torch.distributed as dist")


def test_a_reseed_after_the_load_names_the_random_op_that_drew_otherwise(rank_runner, reference_cache, tmp_path) -> None:
    """The load is exact (the RNG too); the loop then re-seeds. The continuation departs, and
    the draws both runs logged say which op drew from another generator state first."""
    target = tmp_path / "reseeded.py"
    target.write_text(RESEEDED_LOOP)
    report = diagnose_target(str(target), resume_at=2, runner=rank_runner, cache=reference_cache, workdir=tmp_path / "run")
    assert report.verdict.codes == ["resume-continuation-departs"], (report.verdict.to_dict(), report.resume)
    first = report.resume["continuation"]["first_difference"]
    assert first["step"] == 2 and first["draw"]["op"].startswith("aten.") and "re-seeded" in first["what"], first
    # The report draws the resumed run's losses against the uninterrupted run's.
    losses = report.resume["losses"]
    assert len(losses["uninterrupted"]) == len(losses["resumed"]) == 4 and losses["resumed"][2] != losses["uninterrupted"][2]
    assert "resumed at step 2" in render_html(report)
