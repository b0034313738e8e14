"""Hangs on real ranks, named from the ranks' collective traces at the launcher's deadline:
a rank-dependent collective order, a rank that skips a collective, an unmatched receive."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from harness.launch.remote import RanksHung
from harness.tracing import diagnose_hang

HANG_TIMEOUT = 4


def _line(fn, text: str) -> int:
    """Line number of the first line of ``fn`` containing ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


# -- rank bodies (module level: the ranks import them) --------------------------------------


def order_depends_on_rank(ctx) -> None:
    t = torch.ones(8)
    dist.all_reduce(t)  # in step: collective #1 matches on both ranks
    if ctx.rank == 0:
        dist.broadcast(t, src=0)  # rank 0's second collective
        dist.all_reduce(t)
    else:
        dist.all_reduce(t)  # rank 1's second collective
        dist.broadcast(t, src=0)


def skips_a_collective(ctx) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    if ctx.rank == 0:
        dist.all_reduce(t)  # only rank 0 issues this one


def unmatched_receive(ctx) -> None:
    x = torch.zeros(3)
    if ctx.rank == 0:
        dist.send(torch.ones(3), dst=1)
    else:
        dist.recv(x, src=0)
        dist.recv(x, src=0)  # nobody sends this one


def deadlock_across_groups(ctx) -> None:
    first = dist.new_group([0, 1], group_desc="first")
    second = dist.new_group([0, 1], group_desc="second")
    t = torch.ones(2)
    if ctx.rank == 0:
        dist.all_reduce(t, group=first)
        dist.all_reduce(t, group=second)
    else:
        dist.all_reduce(t, group=second)
        dist.all_reduce(t, group=first)


def count_tokens(n: int) -> None:
    dist.all_reduce(torch.tensor([float(n)]))  # one per micro-batch


def uneven_micro_batches(ctx) -> None:
    grad = torch.ones(16, 8)
    for _ in range(2 if ctx.rank == 0 else 1):  # rank 0 runs one more micro-batch
        count_tokens(4)
    dist.all_reduce(grad)  # gloo aborts rank 0: 512 bytes arrive for its 4-byte all_reduce


def holds_the_gil_in_c(ctx) -> None:
    import ctypes

    if ctx.rank == 1:
        ctypes.PyDLL(None).sleep(30)  # libc sleep called with the GIL held: no Python thread runs
    dist.barrier()


def _hang(rank_runner, fn):
    with pytest.raises(RanksHung) as info:
        rank_runner.run(fn, nproc=2, timeout=HANG_TIMEOUT)
    return info.value


# -- tests ------------------------------------------------------------------------------------


def test_rank_dependent_order_is_named_a_mismatch_at_the_timeout(rank_runner) -> None:
    hung = _hang(rank_runner, order_depends_on_rank)
    found = diagnose_hang(hung.outcome)
    assert [d.code for d in found] == ["collective-mismatch"], found
    ev = found[0].evidence
    assert ev["seq"] >= 2 and ev["hang"] is True and sorted(ev["ranks"]) == [0, 1]
    assert ev["per_rank"]["0"]["op"] == "broadcast" and ev["per_rank"]["1"]["op"] == "all_reduce"
    a = _line(order_depends_on_rank, "rank 0's second")
    b = _line(order_depends_on_rank, "rank 1's second")
    assert ev["per_rank"]["0"]["call_site"].endswith(f"test_tracing_hang.py:{a} in order_depends_on_rank")
    assert ev["per_rank"]["1"]["call_site"].endswith(f"test_tracing_hang.py:{b} in order_depends_on_rank")
    # The launcher's report leads with it, in words.
    report = hung.report
    assert "DIAGNOSIS collective-mismatch" in report
    assert f"rank 0 is in broadcast #{ev['seq']}" in report and f"test_tracing_hang.py:{a}" in report
    assert f"rank 1 is in all_reduce #{ev['seq']}" in report and f"test_tracing_hang.py:{b}" in report
    assert report.index("DIAGNOSIS") < report.index("---- rank 0")


def test_a_skipped_collective_is_named_missing_with_who_waits_and_who_never_came(rank_runner) -> None:
    hung = _hang(rank_runner, skips_a_collective)
    found = diagnose_hang(hung.outcome)
    assert [d.code for d in found] == ["collective-missing"], found
    ev = found[0].evidence
    assert ev["waiting_ranks"] == [0] and ev["absent_ranks"] == [1] and ev["op"] == "all_reduce"
    assert ev["call_site"].endswith(f"test_tracing_hang.py:{_line(skips_a_collective, 'only rank 0')} in skips_a_collective")
    assert "finished its test body" in ev["absent"]["1"]
    assert "rank 0 waits in all_reduce" in found[0].summary and "rank 1 never issued it" in found[0].summary
    # The collectives the ranks reported to the launcher are the trace of a run stopped before
    # it saved its own: a hung run's report and --trace hold them.
    from types import SimpleNamespace

    from harness.report import chrome_trace
    from harness.report.model import build_report
    from harness.tracing.hang import outcome_trace

    trace = outcome_trace(hung.outcome)
    events = trace.to_report()["events"]
    assert sorted(events) == ["0", "1"] and events["0"][-1]["op"] == "all_reduce", events
    assert len(events["0"]) == len(events["1"]) + 1  # rank 0's extra, waiting all_reduce
    target = SimpleNamespace(name="t", source="", description="", strategy=None, expected_code=None)
    report = build_report(target=target, case=SimpleNamespace(name="c", steps=1), nproc=2, trace=trace, hang=True, diagnoses=found)
    spans = [e for e in chrome_trace(report)["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1} and len(spans) == len(events["0"]) + len(events["1"])


def test_an_unmatched_receive_is_named_missing(rank_runner) -> None:
    hung = _hang(rank_runner, unmatched_receive)
    found = diagnose_hang(hung.outcome)
    assert [d.code for d in found] == ["collective-missing"], found
    ev = found[0].evidence
    assert ev["p2p"] is True and ev["op"] == "recv" and ev["seq"] == 2
    assert ev["src"] == 0 and ev["dst"] == 1 and ev["waiting_ranks"] == [1] and ev["absent_ranks"] == [0]
    assert ev["call_site"].endswith(f"test_tracing_hang.py:{_line(unmatched_receive, 'nobody sends')} in unmatched_receive")
    assert "rank 0 never posted the matching send" in found[0].summary
    assert "recv p2p#2 from rank 0" in hung.report  # the p2p op is in the rank's last ops too


def test_a_deadlock_across_two_groups_names_both(rank_runner) -> None:
    hung = _hang(rank_runner, deadlock_across_groups)
    found = diagnose_hang(hung.outcome)
    assert [d.code for d in found] == ["collective-missing", "collective-missing"], found
    by_group = {d.evidence["group_desc"]: d.evidence for d in found}
    assert by_group["first"]["waiting_ranks"] == [0] and by_group["first"]["absent_ranks"] == [1]
    assert by_group["second"]["waiting_ranks"] == [1] and by_group["second"]["absent_ranks"] == [0]
    assert "waiting in all_reduce" in by_group["first"]["absent"]["1"]


CUSTOM_LOOP_EXTRA_FLAG = '''
import torch
import torch.distributed as dist
from cases.catalog import mlp_case
from harness.parallel_dims import RankLayout

CASE = mlp_case("sgd", steps=2)
TIMEOUT = 8


def found_inf(model):
    flag = torch.zeros(1)
    dist.all_reduce(flag)  # only the "first stage" calls this


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
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        if ctx.rank == 0:
            found_inf(model)
        run.before_step(step)
        optimizer.step()
        run.after_step(step)
        optimizer.zero_grad()
'''


def test_a_collective_on_some_ranks_only_is_named_at_its_line_not_the_harness_collective(rank_runner, reference_cache, tmp_path) -> None:
    """Rank 0 all-reduces a flag the other rank never issues; rank 1 goes on into the harness's
    own all_gather (run.before_step). The collective named is rank 0's, at its line - never
    the harness's."""
    from harness.pipeline import diagnose_target

    path = tmp_path / "extra_flag.py"
    path.write_text(CUSTOM_LOOP_EXTRA_FLAG)
    report = diagnose_target(str(path), runner=rank_runner, cache=reference_cache, workdir=tmp_path / "work")
    assert report.verdict.verdict == "hang" and report.codes == ["collective-missing"], report.verdict.to_dict()
    [d] = report.verdict.diagnoses
    assert d.evidence["extra_on_ranks"] == [0] and d.evidence["absent_ranks"] == [1]
    assert d.evidence["call_site"].endswith("extra_flag.py:13 in found_inf"), d.evidence
    assert "the harness's own all_gather" in d.summary


def test_a_rank_that_gloo_aborts_still_names_its_collective_from_its_journal(rank_runner) -> None:
    """Rank 0 runs one micro-batch more than rank 1; gloo kills rank 0 (SIGABRT) when rank 1's
    gradient all_reduce meets its token count. The dead rank's journal still says what it
    issued: the report names both collectives at their lines, ahead of gloo's own words."""
    from harness.launch.remote import RanksFailed

    with pytest.raises(RanksFailed) as info:
        rank_runner.run(uneven_micro_batches, nproc=2, timeout=30)
    outcome = info.value.outcome
    assert 0 in outcome.deaths and "SIGABRT" in outcome.deaths[0]
    [found] = diagnose_hang(outcome)
    assert found.code == "collective-mismatch" and found.evidence["hang"] is False, found
    per_rank = found.evidence["per_rank"]
    assert per_rank["0"]["shapes"] == [[1]] and per_rank["1"]["shapes"] == [[16, 8]]
    assert per_rank["0"]["call_site"].endswith(f"test_tracing_hang.py:{_line(count_tokens, 'one per micro-batch')} in count_tokens")
    assert per_rank["1"]["call_site"].endswith(f"test_tracing_hang.py:{_line(uneven_micro_batches, 'gloo aborts')} in uneven_micro_batches")
    report = info.value.report
    assert report.index("DIAGNOSIS collective-mismatch") < report.index("rank 0 died first")
    assert "rank 0 last collectives (from its journal)" in report


@pytest.mark.slow  # 14 s: a rank blocked in C for longer than the dump wait
def test_a_rank_holding_the_gil_in_c_still_shows_its_python_stack(rank_runner) -> None:
    """Rank 1 sleeps in C with the GIL held, so its control thread cannot answer the dump:
    faulthandler's stack (asked for with SIGUSR1) is in the report, not an empty one, though
    the rank's fd 2 was the test's capture file at the time."""
    hung = _hang(rank_runner, holds_the_gil_in_c)
    report = hung.report
    assert "rank 1: did not answer (faulthandler stack below)" in report, report
    stack = report.split("---- rank 1 Python stack ----", 1)[1]
    assert "(empty)" not in stack.split("----")[0], stack
    assert "holds_the_gil_in_c" in stack and "test_tracing_hang.py" in stack, stack
