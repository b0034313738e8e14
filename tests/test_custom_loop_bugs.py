"""Custom loops (``CASE`` + ``train(ctx, run)``, files under ``tests/custom_loops``) with the
bugs that hand-written parallel code has, each named with its code on real ranks, and the
same loop without the bug passing."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.pipeline import diagnose_target

LOOPS = Path(__file__).resolve().parent / "custom_loops"


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _diagnose(spec: str, rank_runner, reference_cache, workdir: Path):
    return diagnose_target(spec, runner=rank_runner, cache=reference_cache, workdir=workdir)


def test_differing_micro_batch_counts_name_both_collectives_though_gloo_kills_a_rank(rank_runner, reference_cache, tmp_path) -> None:
    """Rank 1 runs one micro-batch fewer: its gradient all_reduce meets rank 0's per-micro-batch
    count, gloo aborts rank 0 (SIGABRT). Rank 0's journal still holds what it issued, so both
    collectives are named at their lines, with the step, and the rank that aborted."""
    path = LOOPS / "uneven_micro_batches.py"
    bug = _diagnose(str(path), rank_runner, reference_cache, tmp_path / "bug")
    assert bug.codes == ["collective-mismatch"], bug.verdict.to_dict()
    [d] = bug.verdict.diagnoses
    per_rank = d.evidence["per_rank"]
    count_line, sync_line = _line(path, "one per micro-batch"), _line(path, "the gradient sync")
    assert per_rank["0"]["call_site"].endswith(f"uneven_micro_batches.py:{count_line} in count_samples"), per_rank
    assert per_rank["1"]["call_site"].endswith(f"uneven_micro_batches.py:{sync_line} in train"), per_rank
    assert per_rank["0"]["shapes"] == [[1]] and per_rank["0"]["step"] == 0 == per_rank["1"]["step"]
    assert "SIGABRT" in bug.verdict.error or "signal 6" in bug.verdict.error, bug.verdict.error
    ok = _diagnose(f"{path}:correct", rank_runner, reference_cache, tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()


def test_clipping_on_one_tp_rank_is_a_per_rank_scale(rank_runner, reference_cache, tmp_path) -> None:
    """Hand-written TP where only rank 0 clips (by its own shards' norm): each rank's slices
    are off by a factor of its own, alike in every sharded gradient - grad-scaled, per rank.
    Clipping by the global norm on every rank passes."""
    path = LOOPS / "tp_clip_one_rank.py"
    bug = _diagnose(str(path), rank_runner, reference_cache, tmp_path / "bug")
    assert bug.codes == ["grad-scaled"], bug.verdict.to_dict()
    ev = bug.verdict.diagnoses[0].evidence
    assert ev["per_rank"] is True and ev["shards"] == 2 and ev["param_count"] == 3, ev
    slice0, slice1 = ev["factor_per_slice"]["0"], ev["factor_per_slice"]["1"]
    assert slice1 > slice0 > 1.0, ev  # rank 1 not clipped at all; rank 0 clipped by a smaller norm
    assert "clipping" in ev["likely_source"]
    ok = _diagnose(f"{path}:correct", rank_runner, reference_cache, tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()


def test_unnormalised_accumulation_with_dp_equal_to_micro_batches_names_both_sources(rank_runner, reference_cache, tmp_path) -> None:
    """dp 2 and 2 micro-batches: a factor 2 has two explanations. The report says both, and
    how to tell them apart, instead of picking the replicas."""
    path = LOOPS / "unnormalised_accumulation.py"
    bug = _diagnose(str(path), rank_runner, reference_cache, tmp_path / "bug")
    assert bug.codes == ["grad-scaled"], bug.verdict.to_dict()
    ev = bug.verdict.diagnoses[0].evidence
    assert abs(ev["factor"] - 2.0) < 1e-3 and len(ev["candidates"]) == 2, ev
    assert any("micro-batches" in c for c in ev["candidates"]) and any("data-parallel" in c for c in ev["candidates"])
    assert "micro-batch count other than 2" in ev["how_to_tell"]
    ok = _diagnose(f"{path}:correct", rank_runner, reference_cache, tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()


def test_the_readme_tp_and_pp_custom_loops_pass_and_an_unscaled_pipeline_loss_is_named(rank_runner, reference_cache, tmp_path) -> None:
    """README's two custom-loop examples pass as written; the pipeline one without the
    micro-batch weight before backward is pp-loss-scaling (the gradients are m x the reference's)."""
    cases_dir = Path(__file__).resolve().parents[1] / "cases"
    for name in ("tp_custom_example.py", "pp_custom_example.py"):
        report = _diagnose(str(cases_dir / name), rank_runner, reference_cache, tmp_path / name)
        assert report.verdict.verdict == "pass", (name, report.verdict.to_dict())
    source = (cases_dir / "pp_custom_example.py").read_text()
    assert "out = loss * run.loss_weight(batch)" in source
    unscaled = tmp_path / "pp_unscaled.py"
    unscaled.write_text(source.replace("out = loss * run.loss_weight(batch)", "out = loss"))
    bug = _diagnose(str(unscaled), rank_runner, reference_cache, tmp_path / "bug")
    assert bug.codes == ["pp-loss-scaling"], bug.verdict.to_dict()
    assert abs(bug.verdict.diagnoses[0].evidence["factor"] - 2.0) < 1e-3


def test_a_row_parallel_matmul_inline_in_the_models_forward_is_a_partial_sum(rank_runner, reference_cache, tmp_path) -> None:
    """The partial sums are formed in the root module's own forward, with no submodule to show
    them: the probe compares the model's output, which sums over the TP ranks to the reference."""
    path = LOOPS / "tp_inline_row_parallel.py"
    bug = _diagnose(str(path), rank_runner, reference_cache, tmp_path / "bug")
    assert bug.codes == ["tp-partial-sum"], bug.verdict.to_dict()
    assert "the model's own forward" in bug.verdict.diagnoses[0].summary
    ok = _diagnose(f"{path}:correct", rank_runner, reference_cache, tmp_path / "ok")
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()


@pytest.mark.parametrize("variant, says", [
    ("", ["rank 1 raised SystemExit at ", "{file}:{line}"]),
    ("os_exit", ["rank 1 died first (exit code 0: the test body called os._exit(0) at ", "{file}:{line} in train)"]),
    ("returns", ["raised LoopEndedEarly: returns (", "{file}:{line}) returned on rank 1 after 1 of the case's 3 steps"]),
])
def test_a_rank_that_exits_or_returns_early_is_reported_as_that_ranks_exit(variant, says, rank_runner, reference_cache, tmp_path) -> None:
    """sys.exit, os._exit or a return on one rank midway: the report leads with that rank's
    exit and where it happened, with no code (not a hang, not collective-missing)."""
    path = LOOPS / "exits_on_one_rank.py"
    marker = {"": "exit: sys", "os_exit": "exit: os", "returns": "def returns"}[variant]
    run = _diagnose(f"{path}:{variant}" if variant else str(path), rank_runner, reference_cache, tmp_path)
    assert run.verdict.verdict == "error" and run.codes == [], run.verdict.to_dict()
    for part in says:
        assert part.format(file=path.name, line=_line(path, marker)) in run.verdict.error, run.verdict.error


def test_a_bug_that_shows_only_after_the_epoch_wraps_is_named_in_a_long_run(rank_runner, reference_cache, tmp_path) -> None:
    """A loop that never reshuffles (no ``set_epoch``) is right for the first epoch (4 steps)
    and wrong from the first step of the second: a long run (100 steps, every step recorded and
    compared) fails there, with the sample ids first among what differs; the loop that
    reshuffles passes the same 100 steps."""
    path = LOOPS / "no_set_epoch.py"
    bug = diagnose_target(str(path), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "bug", steps=100)
    assert bug.verdict.verdict == "fail" and bug.codes, bug.verdict.to_dict()
    divergence = bug.comparison["first_divergence"]
    assert divergence["step"] == 4 and ["samples", "ids"] in divergence["entries"], divergence
    ok = diagnose_target(f"{path}:correct", runner=rank_runner, cache=reference_cache, workdir=tmp_path / "ok", steps=100)
    assert ok.verdict.verdict == "pass", ok.verdict.to_dict()


@pytest.mark.parametrize("variant, reading", [("train", "shares"),
                                              pytest.param("samples_declared", "units", marks=pytest.mark.slow)])
def test_a_loss_only_difference_passes_and_says_which_reading_gives_the_reference(variant, reading, rank_runner, reference_cache,
                                                                                  tmp_path) -> None:
    """Token-normalised accumulation (Hugging Face's num_items_in_batch) is right; the loop
    reports its loss otherwise than the harness reads it. Gradients and parameters match at
    every step: a PASS that says how the loss was combined, the reading under which it is the
    reference's, and the glue; the same loop with a gradient bug is still named."""
    spec = f"{LOOPS / 'token_mean_accumulation.py'}:{variant}"
    run = _diagnose(spec, rank_runner, reference_cache, tmp_path / variant)
    assert run.verdict.verdict == "pass", run.verdict.to_dict()
    said = run.comparison["reported_loss"]
    assert said["matching"][0] == reading, said
    first = said["steps"][0]
    assert abs(first["readings"][reading] - first["reference"]) < 1e-4 < abs(first["readings"]["given"] - first["reference"]), first
    assert any(n.startswith("only the reported loss differs") and "normaliser=" in n for n in run.comparison["notes"])
    if variant == "train":
        bug = _diagnose(f"{LOOPS / 'token_mean_accumulation.py'}:world_factor_forgotten", rank_runner, reference_cache, tmp_path / "bug")
        assert bug.codes == ["grad-scaled"], bug.verdict.to_dict()


def test_a_loss_difference_with_a_gradient_difference_is_never_excused() -> None:
    """The reading is offered only where gradients and parameters were compared at the step
    whose loss departs, and all of them matched."""
    from types import SimpleNamespace

    from harness.analysis.loss_reading import loss_only

    def cmp(*rows):
        return SimpleNamespace(structure=[], samples=[], tensors=[SimpleNamespace(step=s, kind=k, passed=p) for s, k, p in rows])

    assert loss_only(cmp((0, "loss", False), (0, "grad", True), (0, "param", True)))
    assert not loss_only(cmp((0, "loss", False), (0, "grad", False), (0, "param", True)))
    assert not loss_only(cmp((0, "loss", False), (0, "param", True)))  # no gradient compared at that step
    assert not loss_only(cmp((1, "loss", False), (0, "grad", True), (0, "param", True)))
    assert not loss_only(cmp((0, "loss", True), (0, "grad", True), (0, "param", True)))  # nothing departs
