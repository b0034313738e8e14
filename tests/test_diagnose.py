"""Diagnosis end to end: every module of the bug catalogue is named with exactly its code,
correct strategies and the custom-loop example pass, and the reports and CLI keep their
contract (JSON schema, self-contained HTML, Chrome trace, exit codes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cases.bugs import catalogue
from cases.targets import DEMO_CORRECT
from harness.codes import CODES
from harness.report import SCHEMA, chrome_trace, render_html
from harness.targets.bundled import load_target
from harness.targets.target import TargetError
from harness.pipeline import diagnose_target

REPO = Path(__file__).resolve().parents[1]
BUGS = {module.rsplit(".", 1)[-1]: code for module, code in catalogue().items()}


def test_the_catalogue_covers_at_least_15_codes_each_declared_once_per_module() -> None:
    assert all(code in CODES for code in BUGS.values())
    assert len(set(BUGS.values())) >= 15, sorted(set(BUGS.values()))


@pytest.mark.parametrize("name", sorted(BUGS))
def test_each_bug_case_is_named_with_exactly_its_code(rank_runner, reference_cache, tmp_path, name: str) -> None:
    report = diagnose_target(name, runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    assert report.codes == [BUGS[name]], f"{name}: expected [{BUGS[name]}]\n{report.verdict.to_dict()}"
    assert report.verdict.verdict in ("fail", "hang")
    assert all(d.evidence for d in report.diagnoses)  # every code comes with evidence


# The transformer strategies are verified one by one in test_strategies / test_pipeline; here
# the targets whose only check is this one (and one TP run with dropout: rng-desync's twin).
@pytest.mark.parametrize("name", ["ddp", "manual-tp", "custom-example", "tp-dropout"])
def test_correct_targets_pass_without_a_code(rank_runner, reference_cache, tmp_path, name: str) -> None:
    report = diagnose_target(name, runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    assert report.verdict.verdict == "pass", report.verdict.to_dict()
    assert report.exit_code == 0


BUGGY_CUSTOM_LOOP = '''
import torch.distributed as dist
from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = mlp_case("sgd")

def train(ctx, run):
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)
        for p in model.parameters():
            dist.all_reduce(p.grad)          # summed, never divided
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()
'''


def test_a_custom_loop_with_a_bug_is_diagnosed(rank_runner, reference_cache, tmp_path) -> None:
    path = tmp_path / "my_loop.py"
    path.write_text(BUGGY_CUSTOM_LOOP)
    report = diagnose_target(str(path), runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    assert report.codes == ["grad-not-averaged"]
    assert report.diagnoses[0].evidence["factor"] == pytest.approx(2.0, rel=1e-3)
    assert report.target["strategy"] == "custom"


def test_reports_keep_their_contract(rank_runner, reference_cache, tmp_path) -> None:
    report = diagnose_target("unsharded_sampler", runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    data = json.loads(json.dumps(report.to_json()))
    assert data["schema"] == SCHEMA and data["verdict"] == "fail"
    assert [d["code"] for d in data["diagnoses"]] == ["duplicate-samples"]
    assert {"target", "losses", "comparison", "samples", "mesh", "collectives", "timing"} <= set(data)
    assert len(data["losses"]["reference"]) == len(data["losses"]["parallel"]) == 3
    assert data["comparison"]["first_divergence"]["step"] == 0
    assert set(data["samples"]["ranks"]) == {"0", "1"}

    html = render_html(report)
    assert "<svg" in html and "duplicate-samples" in html
    assert "src=\"http" not in html and "href=\"http" not in html and "<script src" not in html  # opens offline
    assert "class='ids dup'" in html  # the duplicated ids are marked in the grid

    trace = chrome_trace(report)
    assert isinstance(trace["traceEvents"], list)
    assert trace["otherData"]["codes"] == ["duplicate-samples"]


def test_bad_targets_get_errors_that_say_what_is_allowed(tmp_path) -> None:
    with pytest.raises(TargetError, match="unknown target 'no-such-thing'.*bundled name"):
        load_target("no-such-thing")
    with pytest.raises(TargetError, match="does not exist"):
        load_target(str(tmp_path / "missing.py"))
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(TargetError, match="does not define CASE"):
        load_target(str(empty))
    with pytest.raises(TargetError, match="has no attribute 'NOPE'"):
        load_target(f"{REPO / 'cases' / 'custom_example.py'}:NOPE")


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_cli_usage_errors_exit_2() -> None:
    bad = _cli("diagnose", "no-such-thing")
    assert bad.returncode == 2 and "unknown target" in bad.stderr
    assert _cli("diagnose", "ddp", "--nproc", "0").returncode == 2
    assert _cli().returncode == 2


def test_cli_diagnoses_a_file_target_and_writes_every_report(tmp_path) -> None:
    target = tmp_path / "double.py"
    target.write_text(textwrap.dedent('''
        from cases.bugs.double_averaged_ddp import CASE, DoubleAveragedDDP
        STRATEGY = DoubleAveragedDDP
    '''))
    out = _cli("diagnose", f"{target}:STRATEGY", "--steps", "2", "--json", str(tmp_path / "r.json"),
               "--html", str(tmp_path / "r.html"), "--trace", str(tmp_path / "r.trace.json"), "--cache", str(tmp_path / "cache"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.startswith("FAIL  grad-double-averaged")
    assert "step 2/2 trained" in out.stderr  # progress per phase and step
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "fail" and data["diagnoses"][0]["code"] == "grad-double-averaged"
    assert data["target"]["steps"] == 2
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    assert "traceEvents" in json.loads((tmp_path / "r.trace.json").read_text())


def test_the_demo_runs_every_target_and_checks_its_expected_code(rank_runner, reference_cache, tmp_path, monkeypatch, capsys) -> None:
    """The README's main job on a two-target slice of the catalogue (the full catalogue is
    covered target by target above)."""
    from harness import cli
    from harness.targets import bundled

    monkeypatch.setattr(bundled, "demo_targets", lambda: [("summed_grads", "grad-not-averaged"), ("ddp", None)])
    # The CLI's own parser: every option the demo reads has its default.
    args = cli._parser().parse_args(["diagnose", "--out", str(tmp_path / "reports"), "-q", "--cache", reference_cache])
    assert cli._demo(args, rank_runner) == 0
    out = capsys.readouterr().out
    assert "2/2 named as expected" in out
    index = json.loads((tmp_path / "reports" / "index.json").read_text())
    assert [(r["target"], r["ok"]) for r in index] == [("summed_grads", True), ("ddp", True)]
    assert {p.name for p in (tmp_path / "reports").iterdir()} >= {"summed_grads.html", "summed_grads.json", "ddp.trace.json",
                                                                 "index.html"}
    page = (tmp_path / "reports" / "index.html").read_text()
    assert "href='summed_grads.html'" in page and "href='ddp.html'" in page and "2/2 targets as expected" in page


def test_demo_targets_are_the_whole_catalogue_plus_correct_strategies() -> None:
    from harness.targets.bundled import demo_targets

    listed = dict(demo_targets())
    assert {n: c for n, c in listed.items() if c} == BUGS
    assert [n for n, c in listed.items() if c is None] == DEMO_CORRECT


USER_ERRORS = {
    "raises_on_rank_1": ('''
import torch.distributed as dist
from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = mlp_case("sgd", steps=2)

def train(ctx, run):
    model = CASE.build_model(ctx.device)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)
            if ctx.rank == 1 and step == 1:
                raise ValueError("my metric has the wrong shape")
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()
''', r"rank 1 raised ValueError at .*raises_on_rank_1\.py:18: my metric has the wrong shape"),
    "nondeterministic_factory": ('''
import random
import torch
from cases.catalog import mlp_case
from cases.models import TwoLayerMLP
from cases.strategies import DDPStrategy

def noisy():
    model = TwoLayerMLP(8, 16, 4)
    with torch.no_grad():
        model.fc1.bias.add_(random.random())
    return model

CASE = mlp_case("sgd", steps=1).replace(model_factory=noisy)
STRATEGY = DDPStrategy()
''', r"rank 0 raised CaseError .*model_factory is not deterministic.*'fc1.bias'"),
    "nan_in_the_data": ('''
import torch
from cases.catalog import mlp_case
from cases.data import SyntheticRegression
from cases.strategies import DDPStrategy

data = SyntheticRegression(64, 8, 4)
data.targets[:, 0] = float("nan")
CASE = mlp_case("sgd", steps=1).replace(dataset=data)
STRATEGY = DDPStrategy()
''', r"rank 0 raised NonFiniteReferenceError .*NaN/inf in loss 'loss' at step 0"),
}


@pytest.mark.parametrize("name", sorted(USER_ERRORS))
def test_a_users_own_error_is_the_verdict_error_never_a_code(rank_runner, reference_cache, tmp_path, name) -> None:
    """A rank that raises (the user's code, a check of the case) is the cause: verdict error,
    led by that exception with its rank and file:line - not collective-missing for the ranks
    left waiting."""
    import re

    from harness.report import format_terminal

    source, lead = USER_ERRORS[name]
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    report = diagnose_target(str(path), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "work", timeout=60)
    assert (report.verdict.verdict, report.codes) == ("error", []), report.verdict.to_dict()
    assert re.match(lead, report.verdict.error), report.verdict.error.splitlines()[0]
    terminal = format_terminal(report)
    assert terminal.splitlines()[0].startswith("ERROR") and re.search(lead, terminal.splitlines()[1])
    if name == "raises_on_rank_1":
        # Nothing recorded before the failure is lost: step 0's loss and the ranks' collectives
        # are in the report, and the folders they came from are named.
        assert report.losses["parallel"] and len(report.losses["parallel"]) == 1, report.losses
        assert report.collectives and report.collectives["events"]
        assert report.recorded["trace_parts"] and report.recorded["unfinished"]
        assert "trace parts: " in terminal and "unfinished record: " in terminal
        assert report.to_json()["recorded"] == report.recorded


@pytest.mark.parametrize(
    "args, message",
    [
        (["ddp", "--nproc", "10000"], "--nproc: 10000 ranks exceed this machine's bound of"),
        (["ddp", "--timeout", "-1"], "--timeout must be a finite number of seconds > 0, got -1.0"),
        (["ddp", "--timeout", "0"], "--timeout must be a finite number of seconds > 0, got 0.0"),
        (["ddp", "--timeout", "nan"], "--timeout must be a finite number of seconds > 0, got nan"),
        (["ddp", "--json", "/no/such/folder/r.json"], "--json /no/such/folder/r.json: the folder /no/such/folder does not exist"),
    ],
)
def test_bad_cli_values_are_usage_errors_before_anything_runs(args, message) -> None:
    from harness.cli import main

    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["diagnose", *args]) == 2
    assert message in err.getvalue()


def test_target_files_are_validated_and_package_files_import_as_part_of_their_package(tmp_path) -> None:
    bad = tmp_path / "bad_timeout.py"
    bad.write_text("from cases.catalog import mlp_case\nfrom cases.strategies import DDPStrategy\n"
                   "CASE = mlp_case()\nSTRATEGY = DDPStrategy()\nTIMEOUT = -5\n")
    with pytest.raises(TargetError, match="TIMEOUT must be a finite number of seconds > 0, got -5"):
        load_target(str(bad))
    stall = tmp_path / "bad_stall.py"
    stall.write_text("from cases.catalog import mlp_case\nfrom cases.strategies import DDPStrategy\n"
                     "CASE = mlp_case()\nSTRATEGY = DDPStrategy()\nSTALL_WINDOW = 'soon'\n")
    with pytest.raises(TargetError, match="STALL_WINDOW must be a finite number of seconds > 0, got 'soon'"):
        load_target(str(stall))
    relative = load_target(str(REPO / "cases" / "bugs" / "summed_grads.py"))  # uses `from ._manual_dp import`
    assert relative.expected_code == "grad-not-averaged"
    # The bundled hangs are named by their stall window; the deadline only caps a run that never stalls.
    hang = load_target(str(REPO / "cases" / "bugs" / "mesh_dims_per_node_hang.py"))
    assert (hang.stall_window, hang.timeout) == (3.0, 120.0)


def test_list_into_a_closed_pipe_ends_quietly() -> None:
    proc = subprocess.run(f"{sys.executable} -m harness list | head -1", shell=True, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() and "Traceback" not in proc.stderr, proc.stderr


RENAMED_LOOP = '''
import torch
import torch.distributed as dist
from torch import nn
from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = mlp_case("sgd", steps=2)
NAMES = {"up_w": "fc1.weight", "up_b": "fc1.bias", "down_w": "fc2.weight", "down_b": "fc2.bias"}


class Mine(nn.Module):
    """The reference MLP by hand, with its own parameter names."""

    def __init__(self, ref):
        super().__init__()
        self.up_w, self.up_b = nn.Parameter(ref.fc1.weight.detach().clone()), nn.Parameter(ref.fc1.bias.detach().clone())
        self.down_w, self.down_b = nn.Parameter(ref.fc2.weight.detach().clone()), nn.Parameter(ref.fc2.bias.detach().clone())

    def forward(self, x):
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, self.up_w, self.up_b)), self.down_w, self.down_b)


def train(ctx, run, names=NAMES, average=True):
    model = Mine(CASE.build_model(ctx.device))
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size), names=names)
    for step in range(run.steps):
        for batch in run.batches(step):
            loss = CASE.forward_loss(model, batch)
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            if average:
                p.grad /= ctx.world_size
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()


def unnamed(ctx, run):
    train(ctx, run, names=None)


def unnamed_unaveraged(ctx, run):
    train(ctx, run, names=None, average=False)
'''


def test_renamed_parameters_are_mapped_by_watch_and_proposed_from_shapes(rank_runner, reference_cache, tmp_path) -> None:
    """train(ctx, run, names=...) with a defaulted extra parameter is a custom loop; names= maps
    a hand-written model's parameters to the reference's; without it the state-structure report
    proposes that mapping from the shapes."""
    path = tmp_path / "renamed.py"
    path.write_text(RENAMED_LOOP)
    mapped = diagnose_target(str(path), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "a")
    assert mapped.verdict.verdict == "pass", mapped.verdict.to_dict()
    unnamed = diagnose_target(f"{path}:unnamed", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "b")
    assert unnamed.codes == ["state-structure"], unnamed.verdict.to_dict()
    hints = unnamed.verdict.diagnoses[0].evidence["hints"]
    assert any("names={" in h and "'up_w': 'fc1.weight'" in h and "'down_b': 'fc2.bias'" in h for h in hints), hints
    assert unnamed.verdict.diagnoses[0].evidence["compared_under_proposed_names"]["up_w"] == "fc1.weight"


def test_a_naming_mismatch_does_not_hide_the_bug_under_it(rank_runner, reference_cache, tmp_path) -> None:
    """The names differ from the reference's by a renaming the shapes propose one to one: the
    values are compared under it, so the gradients summed without averaging are named beside
    the names (which still fail as state-structure)."""
    path = tmp_path / "renamed.py"
    path.write_text(RENAMED_LOOP)
    run = diagnose_target(f"{path}:unnamed_unaveraged", runner=rank_runner, cache=reference_cache, workdir=tmp_path)
    assert run.codes == ["state-structure", "grad-not-averaged"], run.verdict.to_dict()


def test_a_target_that_is_neither_strategy_nor_loop_says_what_is_allowed(tmp_path) -> None:
    path = tmp_path / "t.py"
    path.write_text("from cases.catalog import mlp_case\nCASE = mlp_case()\n\ndef train(ctx, run, bug):\n    pass\n\ndef helper(x):\n    return x\n")
    with pytest.raises(TargetError, match=r"train is train\(ctx, run, bug\); a custom loop takes \(ctx, run\) first and gives every other parameter a default"):
        load_target(str(path))
    with pytest.raises(TargetError, match=r"t\.py:helper is helper\(x\): a target is a Strategy .* or a custom loop train\(ctx, run, \.\.\.\)"):
        load_target(f"{path}:helper")


TP_FUNCTIONAL_DROPOUT = '"""Hand-written TP on an MLP with F.dropout in forward; rank 1 draws one extra random number."""\nimport torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\nfrom torch import nn\nimport functools\nfrom reference.case import Case\nfrom cases.data import SyntheticRegression\nfrom cases.catalog import OPTIMIZERS\nfrom harness.parallel_dims import ParallelDims\n\nclass DropMLP(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.norm = nn.LayerNorm(8)\n        self.up = nn.Linear(8, 16)\n        self.down = nn.Linear(16, 4)\n    def forward(self, x):\n        h = F.dropout(self.norm(x), 0.2, self.training)\n        return self.down(torch.relu(self.up(h)))\n\nCASE = Case("dropmlp", DropMLP, SyntheticRegression(64, 8, 4), F.mse_loss, OPTIMIZERS["sgd"], 16, steps=2)\nNPROC = 2\nEXTRA = True\n\nclass _ReduceForward(torch.autograd.Function):\n    """Megatron\'s g: all-reduce the partial sums forward, identity backward."""\n\n    @staticmethod\n    def forward(ctx, x):\n        x = x.clone()\n        dist.all_reduce(x)\n        return x\n\n    @staticmethod\n    def backward(ctx, g):\n        return g\n\n\nclass ShardedMLP(nn.Module):\n    def __init__(self, full, rank, world):\n        super().__init__()\n        self.norm = full.norm\n        n = 16 // world\n        self.up = nn.Linear(8, n); self.down_w = nn.Parameter(full.down.weight[:, rank*n:(rank+1)*n].detach().clone())\n        self.down_b = full.down.bias\n        with torch.no_grad():\n            self.up.weight.copy_(full.up.weight[rank*n:(rank+1)*n]); self.up.bias.copy_(full.up.bias[rank*n:(rank+1)*n])\n    def forward(self, x):\n        h = F.dropout(self.norm(x), 0.2, self.training)\n        part = F.linear(torch.relu(self.up(h)), self.down_w)\n        return _ReduceForward.apply(part) + self.down_b\n\ndef train(ctx, run, extra=EXTRA):\n    dims = ParallelDims(tp=ctx.world_size)\n    full = CASE.build_model(ctx.device)\n    model = ShardedMLP(full, ctx.rank, ctx.world_size)\n    g = dist.group.WORLD\n    run.shard(model.up.weight, 0, group=g); run.shard(model.up.bias, 0, group=g); run.shard(model.down_w, 1, group=g)\n    opt = CASE.build_optimizer(model.parameters())\n    run.watch(model, opt, dims.layout(ctx.rank), names={"up.weight": "up.weight", "down_w": "down.weight", "down_b": "down.bias"})\n    for step in range(run.steps):\n        for batch in run.batches(step):\n            if extra and ctx.rank == 1:\n                torch.rand(1)  # BUG: an extra draw on one TP rank\n            loss = CASE.forward_loss(model, batch)\n            (loss * run.loss_weight(batch)).backward()\n            run.loss(step, loss if run.layout.holds_loss else None, batch.ids)\n        for p in (model.norm.weight, model.norm.bias):  # each rank holds its shard\'s part\n            dist.all_reduce(p.grad)\n        run.before_step(step); opt.step(); run.after_step(step); opt.zero_grad()\n\ndef correct(ctx, run):\n    train(ctx, run, extra=False)\n'


def test_functional_dropout_desync_in_hand_written_tp_is_rng_desync(rank_runner, reference_cache, tmp_path) -> None:
    """Hand-written TP (Megatron's f/g by hand) with ``F.dropout`` inside ``forward``: one TP
    rank drawing an extra random number is named ``rng-desync`` from the ranks' fingerprinted
    random ops, at its line; the same loop without the extra draw passes."""
    path = tmp_path / "tp_dropout_loop.py"
    path.write_text(TP_FUNCTIONAL_DROPOUT)
    bug = diagnose_target(str(path), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "bug")
    assert bug.codes == ["rng-desync"], bug.verdict.to_dict()
    assert "rank 1 drew rand [1] float32 at " in bug.verdict.diagnoses[0].summary and "tp_dropout_loop.py:65 in train" in bug.verdict.diagnoses[0].summary
    ok = diagnose_target(f"{path}:correct", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()


TP_ROW_PARTIAL = '"""Hand-written TP on an MLP whose row-parallel layer returns its partial sums (bug) or\nall-reduces them (correct)."""\nimport torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\nfrom torch import nn\nfrom cases.catalog import mlp_case\nfrom harness.parallel_dims import ParallelDims\n\nCASE = mlp_case("sgd", steps=2)\nNPROC = 2\n\n\nclass _ReduceForward(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n        x = x.clone()\n        dist.all_reduce(x)\n        return x\n\n    @staticmethod\n    def backward(ctx, g):\n        return g\n\n\nclass RowParallel(nn.Module):\n    def __init__(self, weight, bias, reduce):\n        super().__init__()\n        self.weight, self.bias, self.reduce = nn.Parameter(weight), bias, reduce\n\n    def forward(self, h):\n        part = F.linear(h, self.weight)\n        return (_ReduceForward.apply(part) if self.reduce else part) + self.bias  # BUG when not reduce\n\n\nclass Sharded(nn.Module):\n    def __init__(self, full, rank, world, reduce):\n        super().__init__()\n        n = full.fc1.out_features // world\n        self.fc1 = nn.Linear(full.fc1.in_features, n)\n        with torch.no_grad():\n            self.fc1.weight.copy_(full.fc1.weight[rank * n:(rank + 1) * n]); self.fc1.bias.copy_(full.fc1.bias[rank * n:(rank + 1) * n])\n        self.fc2 = RowParallel(full.fc2.weight[:, rank * n:(rank + 1) * n].detach().clone(), full.fc2.bias, reduce)\n\n    def forward(self, x):\n        return self.fc2(torch.relu(self.fc1(x)))\n\n\ndef train(ctx, run, reduce=False):\n    full = CASE.build_model(ctx.device)\n    model = Sharded(full, ctx.rank, ctx.world_size, reduce)\n    g = dist.group.WORLD\n    run.shard(model.fc1.weight, 0, group=g); run.shard(model.fc1.bias, 0, group=g); run.shard(model.fc2.weight, 1, group=g)\n    optimizer = CASE.build_optimizer(model.parameters())\n    run.watch(model, optimizer, ParallelDims(tp=ctx.world_size).layout(ctx.rank))\n    for step in range(run.steps):\n        for batch in run.batches(step):\n            loss = CASE.forward_loss(model, batch)\n            (loss * run.loss_weight(batch)).backward()\n            run.loss(step, loss if run.layout.holds_loss else None, batch.ids)\n        run.before_step(step)\n        optimizer.step()\n        run.after_step(step)\n        optimizer.zero_grad()\n\n\ndef correct(ctx, run):\n    train(ctx, run, reduce=True)\n'


def test_a_hand_written_row_parallel_without_its_all_reduce_is_tp_partial_sum(rank_runner, reference_cache, tmp_path) -> None:
    """The activation probe runs on a custom loop's watched model as on a bundled strategy:
    a hand-written row-parallel module returning its partial sums is ``tp-partial-sum``;
    with its all-reduce the same loop passes."""
    path = tmp_path / "tp_row_loop.py"
    path.write_text(TP_ROW_PARTIAL)
    bug = diagnose_target(str(path), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "bug")
    assert bug.codes == ["tp-partial-sum"], bug.verdict.to_dict()
    assert bug.verdict.diagnoses[0].evidence["module"] == "fc2"
    ok = diagnose_target(f"{path}:correct", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()


def test_sigterm_to_the_cli_ends_the_run_at_once_and_names_what_it_recorded(tmp_path) -> None:
    """SIGTERM mid-run (a CI job cancelled): the CLI exits 143 within seconds, names the record
    its ranks had checkpointed, and no rank outlives it."""
    import signal
    import time
    import uuid

    from tests._procs import processes_with_env

    started = tmp_path / "started"
    started.mkdir()
    tag = f"HARNESS_TEST_TAG={uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "STARTED_DIR": str(started), tag.split("=")[0]: tag.split("=")[1]}
    loop = REPO / "tests" / "custom_loops" / "sleeps_at_step_one.py"
    child = subprocess.Popen([sys.executable, "-m", "harness", "diagnose", str(loop), "--stall-window", "0", "-q",
                              "--cache", str(tmp_path / "cache")],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while len(list(started.iterdir())) < 2 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.1)  # both ranks asleep in step 1, step 0 recorded
        assert len(list(started.iterdir())) == 2, child.communicate(timeout=30)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=120)  # the ranks sleep 600 s: only the signal ends it sooner
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 143, (out, err)
    assert "interrupted (SIGTERM)" in err and "unfinished record" in err and ".custom-mlp-sgd-w2.partial-" in err, err
    deadline = time.monotonic() + 10
    while processes_with_env(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_env(tag) == [], "rank processes outlived the CLI"


def test_one_target_writes_its_reports_under_out_by_default_and_ends_with_the_line_to_open(rank_runner, reference_cache, tmp_path,
                                                                                         capsys) -> None:
    from harness import cli

    args = cli._parser().parse_args(["diagnose", "summed_grads", "--out", str(tmp_path / "reports"), "-q", "--cache", reference_cache])
    assert cli._diagnose_one(args, rank_runner) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"open {tmp_path / 'reports' / 'summed_grads.html'}", out[-4:]
    assert {p.name for p in (tmp_path / "reports").iterdir()} == {"summed_grads.html", "summed_grads.json", "summed_grads.trace.json"}
    assert "href='summed_grads.trace.json'" in (tmp_path / "reports" / "summed_grads.html").read_text()
