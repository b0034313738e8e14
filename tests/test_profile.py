"""Step 5 of the method, the profile of a correct run (harness.analysis.profile, python -m
harness profile): the figures from synthetic trace events, then real ranks. Never a wall-clock
value: only the figures' presence and the identities between them (busy + idle = step,
compute + communication - overlap = busy), the collective counts and bytes against the
harness's own trace and against the arithmetic (DDP all-reduces every gradient once a step),
and the bubble's theory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness.analysis.profile import bubble_theory, op_key, summarize_rank
from harness.pipeline import profile_target


def _x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op", **args) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat, "args": args}


def _events() -> list[dict]:
    """One 10 ms step: an autograd node at 1-4.5 ms whose matmul computes at 1-3 ms and which then
    issues an all-reduce and waits for it, gloo moving 100 floats on a worker thread at 3-6 ms,
    compute again at 7-8 ms."""
    return [
        _x("harness.step#1", 0, 10_000, cat="user_annotation"),
        # an autograd node whose own time from 3 ms on is the wait for the all-reduce it issued
        _x("autograd::engine::evaluate_function: MyFunctionBackward", 1_000, 3_500),
        _x("aten::mm", 1_000, 2_000),
        _x("c10d::allreduce_", 3_000, 200),
        _x("gloo:all_reduce", 3_000, 3_000, tid=2, cat="user_annotation", **{"Input Dims": [[100]], "Input type": ["float"]}),
        _x("aten::add", 7_000, 1_000),
        {"ph": "i", "name": "[memory]", "ts": 2_000, "args": {"Total Allocated": 4096}},
        {"ph": "i", "name": "[memory]", "ts": 20_000, "args": {"Total Allocated": 1 << 30}},  # after the step: not in it
    ]


def test_the_figures_of_one_step_add_up_and_a_collective_call_is_not_compute() -> None:
    hooks = [{"op": "all_reduce", "group": "default_pg", "group_ranks": [0, 1], "bytes": 400}]
    r = summarize_rank(_events(), rank=0, hooks_saw=hooks)
    assert math.isclose(r["step_s"], 0.010) and math.isclose(r["compute_s"], 0.003)  # 1-3 and 7-8 ms
    assert math.isclose(r["comm_s"], 0.003) and math.isclose(r["overlap_s"], 0.0)
    assert math.isclose(r["busy_s"], 0.006) and math.isclose(r["busy_s"] + r["idle_s"], r["step_s"])
    assert r["collectives"] == {"allreduce": {"count": 1, "bytes": 400}} and r["collectives_agree"]
    assert r["peak_bytes"] == 4096
    # The hooks saw something else: reported, not hidden.
    r = summarize_rank(_events(), rank=0, hooks_saw=hooks * 2)
    assert not r["collectives_agree"] and r["collectives_disagree"]["allreduce"]["hooks"] == {"count": 2, "bytes": 800}


def test_opt_in_limits_name_what_exceeds_them_and_nothing_without_them() -> None:
    from harness.analysis.profile import check_thresholds

    r = summarize_rank(_events(), rank=0, hooks_saw=[])  # exposed communication 3 of 10 ms
    profile = {"ranks": {0: r}, "bubble": {"measured": {"mean": 0.5}, "theory": 0.2}}
    assert check_thresholds(profile) == []
    assert check_thresholds(profile, max_exposed_comm=0.5, max_bubble_over=0.4) == []
    exceeded = check_thresholds(profile, max_exposed_comm=0.25, max_bubble_over=0.1)
    assert len(exceeded) == 2 and "30%" in exceeded[0] and "0.30 above" in exceeded[1]


def test_a_trace_without_profiled_steps_is_refused_and_names_are_one_key() -> None:
    with pytest.raises(ValueError, match="no harness.step#"):
        summarize_rank([_x("aten::mm", 0, 1)], rank=3, hooks_saw=[])
    assert op_key("c10d::_allgather_base_") == op_key("gloo:all_gather") == op_key("all_gather") == "allgather"
    assert op_key("c10d::_reduce_scatter_base_") == op_key("reduce_scatter_tensor") == "reducescatter"
    assert bubble_theory(2, 4) == pytest.approx(0.2) and bubble_theory(4, 8) == pytest.approx(3 / 11)


def _consistent(profile: dict) -> None:
    assert {"ranks", "slowest_rank", "samples_per_s", "step_s", "spread", "collectives_agree"} <= set(profile)
    assert profile["collectives_agree"], {r: p["collectives_disagree"] for r, p in profile["ranks"].items()}
    for rank, r in profile["ranks"].items():
        assert {"step_s", "compute_s", "comm_s", "overlap_s", "collectives", "peak_bytes"} <= set(r)
        assert Path(r["trace"]).is_file()
        for s in r["steps"]:
            assert s["busy_s"] + s["idle_s"] == pytest.approx(s["step_s"])
            assert s["compute_s"] + s["comm_s"] - s["overlap_s"] == pytest.approx(s["busy_s"])
            assert 0 <= s["overlap_s"] <= min(s["compute_s"], s["comm_s"]) + 1e-12
    assert profile["slowest_rank"] == max(profile["ranks"].values(), key=lambda r: r["step_s"])["rank"]
    json.dumps(profile)


def test_fsdp2_collectives_agree_with_the_trace(rank_runner, tmp_path) -> None:
    profile = profile_target("fsdp", steps=1, warmup=1, runner=rank_runner, trace_dir=tmp_path)
    _consistent(profile)
    assert {"allgather", "allreduce"} <= set(profile["ranks"][0]["collectives"])  # gloo reduce-scatters as an all-reduce


def test_ddp_all_reduces_the_gradient_bytes_every_step(rank_runner, tmp_path) -> None:
    profile = profile_target("ddp", steps=2, warmup=1, runner=rank_runner, trace_dir=tmp_path)
    _consistent(profile)
    grad_bytes = profile["ranks"][0]["state_bytes"]["params"]  # float32 parameters: as many bytes as their gradients
    assert profile["ranks"][0]["state_arithmetic"]["grads"] == grad_bytes  # DDP: every rank holds the whole model
    for r in profile["ranks"].values():
        assert r["collectives"]["allreduce"]["bytes"] == 2 * grad_bytes, r["collectives"]
    assert "bubble" not in profile


def test_a_pipeline_reports_its_bubble_per_stage_against_the_formula(rank_runner, tmp_path) -> None:
    profile = profile_target("gpipe", steps=2, warmup=1, runner=rank_runner, trace_dir=tmp_path)
    _consistent(profile)
    bubble = profile["bubble"]
    assert (bubble["stages"], bubble["micro_batches"]) == (2, 4) and bubble["theory"] == pytest.approx(0.2)
    assert set(bubble["measured"]["per_stage"]) == {"[0]", "[1]"}
    # the harness annotates each stage's forward and backward chunks: busy is read from them
    assert {s["busy_from"] for s in bubble["measured"]["per_stage"].values()} == {"stage forward/backward chunks"}
    for stage in bubble["measured"]["per_stage"].values():
        rank = profile["ranks"][stage["rank"]]
        assert stage["busy_s"] + stage["idle_s"] == pytest.approx(rank["step_s"]) and 0 <= stage["fraction"] <= 1
    # p2p: every activation one stage sends, the other receives
    assert profile["ranks"][0]["collectives"]["send"] == profile["ranks"][1]["collectives"]["recv"]


def test_a_custom_loop_is_profiled_without_the_harness_recording(rank_runner, tmp_path) -> None:
    profile = profile_target("custom-example", steps=2, warmup=1, runner=rank_runner, trace_dir=tmp_path)
    _consistent(profile)
    assert profile["strategy"] == "custom"
    for r in profile["ranks"].values():
        # the loop's own all-reduce of each gradient, not the harness's gathers of the record
        assert r["collectives"]["allreduce"]["bytes"] == 2 * r["state_bytes"]["params"], r["collectives"]
        assert all(s["recording_s"] > 0 for s in r["steps"])


def test_the_cli_profiles_after_the_verdict_and_refuses_a_layout_plan(tmp_path, capsys) -> None:
    from harness import cli

    assert cli.main(["profile", "seed-8gpu", "-q"]) == cli.EXIT_USAGE
    assert "layout plan trains nothing" in capsys.readouterr().err
    out = tmp_path / "p.json"
    html = tmp_path / "p.html"
    assert cli.main(["profile", "tp", "-q", "--steps", "1", "--json", str(out), "--html", str(html), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("PASS") and "agree with the harness's collective trace" in printed
    data = json.loads(out.read_text())
    assert data["verdict"]["verdict"] == "pass" and data["profile"]["collectives_agree"]
    assert {"0", "1"} == set(data["profile"]["ranks"]) and "Timeline of the last profiled step" in html.read_text()
    for r in data["profile"]["ranks"].values():  # the timeline's intervals lie inside the step
        t = r["timeline"]
        assert t["compute"] and all(0 <= a <= b <= t["length_ms"] + 1e-6 for a, b in t["compute"] + t["comm"])


@pytest.mark.distributed(nproc=2)
def test_profile_run_in_a_distributed_test_gives_every_rank_the_profile(dist_ctx, tmp_path) -> None:
    from cases.catalog import mlp_case
    from cases.strategies.ddp import DDPStrategy
    from harness import profile_run

    profile = profile_run(mlp_case(), DDPStrategy(), dist_ctx, steps=2, trace_dir=tmp_path / "traces")
    _consistent(profile)
    assert profile["nproc"] == 2 and set(profile["ranks"]) == {0, 1}
    assert Path(profile["ranks"][dist_ctx.rank]["trace"]).parent == tmp_path / "traces"


def test_the_profile_page_judges_the_bubble_and_its_colours_differ_in_lightness() -> None:
    from harness.report.profile import PALETTE, bubble_judgement

    def luminance(colour: str) -> float:
        def channel(c: float) -> float:
            return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
        r, g, b = (channel(int(colour[i:i + 2], 16) / 255) for i in (1, 3, 5))
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    def contrast(a: str, b: str) -> float:
        la, lb = sorted((luminance(a), luminance(b)), reverse=True)
        return (la + 0.05) / (lb + 0.05)

    # Told apart in grey too (the review measured 1.01:1 between compute and communication).
    assert contrast(PALETTE["compute"], PALETTE["comm"]) >= 3 and contrast(PALETTE["idle"], "#ffffff") >= 3
    stages = {"[0]": {"rank": 0, "busy_s": 0.021, "idle_s": 0.022, "fraction": 0.51},
              "[1]": {"rank": 1, "busy_s": 0.017, "idle_s": 0.021, "fraction": 0.56}}
    bubble = {"theory": 0.2, "stages": 2, "micro_batches": 4, "imbalance": 1.05, "measured": {"mean": 0.53, "per_stage": stages}}
    said = bubble_judgement(bubble)
    assert said.startswith("2.6x theory: the stages are balanced") and "stage [0] (rank 0) idles most" in said, said
    assert bubble_judgement({**bubble, "measured": {"mean": 0.22, "per_stage": stages}}).startswith("at theory"), said
