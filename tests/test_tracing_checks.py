"""The tracing checks on plain data (no ranks): edge cases of the sample, mesh and collective
checks, FR/hook merging, the trace file, and the loader hook's errors."""

from __future__ import annotations

import json

import pytest

from harness.codes import Diagnosis
from harness.launch.pool import RunOutcome
from harness.launch.protocol import RankDump, RankResult
from harness.launch.failure_text import format_failure
from harness.tracing import (
    CollectiveRecord,
    RankTrace,
    RunTrace,
    TraceError,
    Tracer,
    check_collectives,
    check_mesh,
    check_sample_ids,
    diagnose_hang,
    trace_samples,
)
from harness.tracing.records import merge, to_entry
from harness.tracing.collective_order import compare_ranks
from harness.tracing.hooks import PyCall


def _json_ok(found: list[Diagnosis]) -> None:
    for d in found:
        json.dumps(d.to_dict())


# -- samples -------------------------------------------------------------------------------------


def test_a_truncating_sampler_drops_samples_and_names_them() -> None:
    expected = {0: [1, 2, 3, 4], 1: [5, 6, 7, 8]}
    per_rank = {0: {0: [[1]], 1: [[5]]}, 1: {0: [[3]], 1: [[7]]}}  # each rank keeps 1 of its 2
    found = check_sample_ids(per_rank, {0: 0, 1: 1}, expected, steps_per_epoch=2)
    assert [d.code for d in found] == ["dropped-samples"]
    ev = found[0].evidence
    assert ev["ids"] == [2, 4, 6, 8] and ev["count"] == 4 and ev["steps"] == [0, 1]
    assert ev["missing_by_step"] == {"0": [2, 4], "1": [6, 8]}
    _json_ok(found)


def test_a_sample_seen_again_in_the_next_epoch_is_not_a_duplicate() -> None:
    per_rank = {0: {0: [[1]], 1: [[1]]}, 1: {0: [[2]], 1: [[2]]}}
    assert check_sample_ids(per_rank, {0: 0, 1: 1}, steps_per_epoch=1) == []
    found = check_sample_ids(per_rank, {0: 0, 1: 1}, steps_per_epoch=None)  # one epoch: twice
    assert [d.code for d in found] == ["duplicate-samples"]
    assert found[0].evidence["id"] == 1 and found[0].evidence["steps"] == [0, 1] and found[0].evidence["ranks"] == [0]


def test_pipeline_stages_of_one_replica_must_agree_per_micro_batch() -> None:
    # replica 0 = ranks 0 (stage 0) and 1 (stage 1); replica 1 = ranks 2, 3
    good = {0: {0: [[1, 2], [3, 4]]}, 1: {0: [[1, 2], [3, 4]]}, 2: {0: [[5, 6], [7, 8]]}, 3: {0: [[5, 6], [7, 8]]}}
    replica = {0: 0, 1: 0, 2: 1, 3: 1}
    assert check_sample_ids(good, replica, {0: list(range(1, 9))}) == []
    bad = {**good, 3: {0: [[5, 6], [8, 7]]}}  # stage 1 of replica 1 got micro-batch 1 reordered
    found = check_sample_ids(bad, replica, {0: list(range(1, 9))})
    assert [d.code for d in found] == ["inconsistent-replica-inputs"]
    ev = found[0].evidence
    assert ev["replica"] == 1 and ev["ranks"] == [2, 3] and (ev["step"], ev["micro"]) == (0, 1)
    assert ev["ids_per_rank"] == {"2": [7, 8], "3": [8, 7]}


# -- mesh ------------------------------------------------------------------------------------------


def _rank(rank: int, coords: dict, groups: dict | None = None, pgs: dict | None = None, params: dict | None = None) -> RankTrace:
    return RankTrace(rank=rank, world_size=4, layout={"mesh": coords, "groups": groups or {}, "dp_rank": coords.get("dp", 0)},
                     groups=pgs or {}, params=params or {})


def _coords(r: int) -> dict:
    return {"dp": r // 2, "tp": r % 2}


def test_correct_declared_groups_pass_and_groups_that_are_no_partition_are_named() -> None:
    good = RunTrace(ranks={r: _rank(r, _coords(r), {"dp": [r % 2, r % 2 + 2], "tp": [r - r % 2, r - r % 2 + 1]}) for r in range(4)})
    assert check_mesh(good) == []
    bad = RunTrace(ranks={r: _rank(r, _coords(r), {"dp": [r % 2, r % 2 + 2], "tp": [0, 1, 2, 3]}) for r in range(4)})
    found = check_mesh(bad)
    assert [d.code for d in found] == ["swapped-mesh-dims"]
    ev = found[0].evidence
    assert ev["kind"] == "wrong-groups" and ev["dim"] == "tp" and ev["actual_groups"] == [[0, 1, 2, 3]]
    assert ev["expected_groups"] == [[0, 1], [2, 3]] and ev["per_rank"]["0"] == {"expected": [0, 1], "actual": [0, 1, 2, 3]}
    _json_ok(found)


def test_gradient_sync_over_ranks_holding_different_shards_is_named() -> None:
    # DDP was handed the tp group: ranks 0 and 1 hold different halves of the weight.
    shards = {"w": {"local_shape": [4, 8]}}
    ranks = {}
    for r in range(4):
        tp = [r - r % 2, r - r % 2 + 1]
        ranks[r] = _rank(r, _coords(r), pgs={f"g{tp[0]}": {"ranks": tp, "desc": "ddp", "dims": [], "roles": ["grad-sync"]}}, params=shards)
    found = check_mesh(RunTrace(ranks=ranks))
    assert [d.code for d in found] == ["swapped-mesh-dims"]
    ev = found[0].evidence
    assert ev["kind"] == "grad-sync-across-shards" and ev["differing_dims"] == ["tp"]
    assert ev["actual_groups"] == [[0, 1], [2, 3]] and ev["expected_groups"] == [[0, 2], [1, 3]]


def test_duplicate_coordinates_are_named() -> None:
    trace = RunTrace(ranks={r: _rank(r, {"dp": 0, "tp": r % 2}) for r in range(4)})
    found = check_mesh(trace)
    assert [d.evidence["kind"] for d in found] == ["duplicate-coordinates"]


# -- collectives -------------------------------------------------------------------------------------


def _rec(rank: int, index: int, op: str, seq: int, *, group: str = "0", ranks=(0, 1), shapes=((4,),), reduce_op: str = "",
         site: str = "train.py:1 in f", **kw) -> CollectiveRecord:
    return CollectiveRecord(rank=rank, index=index, op=op, group=group, group_desc="default_pg", group_ranks=list(ranks), seq=seq,
                            shapes=[list(s) for s in shapes], dtypes=["float32"] * len(shapes), reduce_op=reduce_op,
                            call_site=site, t_ns=seq * 10 + rank, **kw)


def test_same_sequences_pass_and_shape_differences_only_count_for_bound_ops() -> None:
    ok = {r: [_rec(r, 0, "all_reduce", 1), _rec(r, 1, "all_to_all", 2, shapes=((r + 1,),))] for r in (0, 1)}
    assert compare_ranks(ok) == []  # all_to_all may split unevenly
    bad = {0: [_rec(0, 0, "all_reduce", 1, shapes=((4,),))], 1: [_rec(1, 0, "all_reduce", 1, shapes=((5,),))]}
    found = compare_ranks(bad)
    assert [d.code for d in found] == ["collective-mismatch"]
    assert found[0].evidence["per_rank"]["1"]["shapes"] == [[5]]


def test_a_missing_collective_in_a_finished_trace_names_who_issued_it() -> None:
    by_rank = {0: [_rec(0, 0, "all_reduce", 1), _rec(0, 1, "broadcast", 2, site="a.py:9 in g")], 1: [_rec(1, 0, "all_reduce", 1)]}
    trace = RunTrace(ranks={r: RankTrace(rank=r, world_size=2, collectives=recs) for r, recs in by_rank.items()})
    found = check_collectives(trace)
    assert [d.code for d in found] == ["collective-missing"]
    ev = found[0].evidence
    assert ev["issued_by"] == [0] and ev["absent_ranks"] == [1] and ev["call_site"] == "a.py:9 in g"
    assert ev["position_per_rank"] == {"0": 1}
    assert "its last on that group was all_reduce #1" in ev["absent"]["1"]


def test_records_outside_a_window_are_not_counted_missing() -> None:
    # rank 1's dump holds only its newest op (seq 6): its seq 5 is not shown, not missing
    by_rank = {0: [_rec(0, 0, "all_reduce", 5), _rec(0, 1, "all_reduce", 6)], 1: [_rec(1, 0, "all_reduce", 6)]}
    assert compare_ranks(by_rank) == []


def test_merge_pairs_python_calls_with_flight_recorder_entries() -> None:
    fr = [
        {"record_id": 7, "process_group": ("0", "default_pg"), "collective_seq_id": 3, "p2p_seq_id": 0,
         "profiling_name": "gloo:all_reduce", "time_created_ns": 150, "input_sizes": [[4]], "input_dtypes": ["Float"], "frames": []},
        {"record_id": 8, "process_group": ("0", "default_pg"), "collective_seq_id": 4, "p2p_seq_id": 0,
         "profiling_name": "gloo:all_reduce", "time_created_ns": 300, "input_sizes": [[10]], "input_dtypes": ["BFloat16"],
         "frames": [{"filename": "/abs/model.py", "line": 42, "name": "forward"}]},
    ]
    calls = [
        PyCall(index=1, op="all_reduce", pg_name="0", t0_ns=100, t1_ns=200, shapes=[[4]], dtypes=["float32"], _reduce="avg", call_site="train.py:5 in step"),
        PyCall(index=2, op="send", pg_name="0", t0_ns=400, t1_ns=410, shapes=[[2]], dtypes=["float32"], peer=1, p2p_seq=1, call_site="pipe.py:9 in run"),
    ]
    records = merge({}, fr, calls, rank=0)
    assert [(r.op, r.seq, r.source) for r in records] == [("all_reduce", 3, "fr+python"), ("all_reduce", 4, "fr"), ("send", 1, "python")]
    assert records[0].reduce_op == "avg" and records[0].call_site == "train.py:5 in step"
    assert records[1].call_site == "/abs/model.py:42 in forward" and records[1].dtypes == ["bfloat16"] and records[1].nbytes == 20
    assert records[2].is_p2p and records[2].peer == 1 and [r.index for r in records] == [0, 1, 2]
    entry = to_entry(records[2])
    assert entry.is_p2p and entry.p2p_seq_id == 1 and entry.peer == 1
    # Flight Recorder off: the Python calls alone, numbered per group in issue order.
    alone = merge({}, [], calls[:1] + [PyCall(index=3, op="broadcast", pg_name="0", t0_ns=500, t1_ns=510)], rank=0)
    assert [(r.op, r.seq, r.source) for r in alone] == [("all_reduce", 1, "python"), ("broadcast", 2, "python")]


# -- hangs from the launcher's dumps -----------------------------------------------------------------


def _dump(rank: int, records: list[CollectiveRecord], waiting_in: str = "all_reduce", site: str = "x.py:1 in f") -> RankDump:
    return RankDump(rank=rank, pid=100 + rank, state="running t", stack="", waiting_in=waiting_in, user_site=site,
                    collectives=[to_entry(r) for r in records])


def test_the_timeout_report_leads_with_the_named_cause() -> None:
    outcome = RunOutcome(nproc=2, timed_out=True, timeout_s=5.0)
    outcome.aborted = {
        0: _dump(0, [_rec(0, 0, "all_reduce", 17, site="model.py:42 in forward")], "all_reduce", "model.py:42 in forward"),
        1: _dump(1, [_rec(1, 0, "broadcast", 17, site="train.py:88 in step")], "broadcast", "train.py:88 in step"),
    }
    found = diagnose_hang(outcome)
    assert [d.code for d in found] == ["collective-mismatch"]
    text = format_failure(outcome)
    assert "rank 0 is in all_reduce #17 [[4]] float32 at model.py:42 in forward" in text
    assert "rank 1 is in broadcast #17 [[4]] float32 at train.py:88 in step" in text
    assert text.splitlines()[1].startswith("DIAGNOSIS collective-mismatch")


def test_a_hang_without_records_is_still_named_from_the_stacks() -> None:
    outcome = RunOutcome(nproc=2, timed_out=True, timeout_s=5.0)
    outcome.aborted = {0: RankDump(0, 1, "running t", "", "all_reduce", "t.py:3 in body")}
    outcome.results = {1: RankResult(rank=1, outcome="passed", duration_s=0.1, finished_at=0.0)}
    outcome.finished = {1: RankDump(1, 2, "idle", "", "", "")}
    found = diagnose_hang(outcome)
    assert [d.code for d in found] == ["collective-missing"]
    assert found[0].evidence["waiting_ranks"] == [0] and found[0].evidence["absent_ranks"] == [1]


# -- the trace file ---------------------------------------------------------------------------------


def test_a_trace_round_trips_and_bad_files_say_what_is_wrong(tmp_path) -> None:
    trace = RunTrace(ranks={r: RankTrace(rank=r, world_size=2, samples={0: [[r]]}, collectives=[_rec(r, 0, "all_reduce", 1)]) for r in (0, 1)})
    path = trace.save(tmp_path / "run" / "trace.json")
    back = RunTrace.load(tmp_path / "run")  # the record directory finds trace.json
    assert back.to_json() == trace.to_json() and back.complete
    assert back.rank(1).samples == {0: [[1]]} and back.rank(0).collectives[0].describe() == "all_reduce #1 [[4]] float32"
    with pytest.raises(TraceError, match="has no rank 5; it has ranks \\[0, 1\\]"):
        back.rank(5)
    with pytest.raises(TraceError, match="no trace at"):
        RunTrace.load(tmp_path / "nothing.json")
    path.write_text("{not json")
    with pytest.raises(TraceError, match="is not valid JSON"):
        RunTrace.load(path)
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(TraceError, match="format is 'other', expected 'harness-trace'"):
        RunTrace.load(path)
    parts = tmp_path / "failed.trace"
    parts.mkdir()
    (parts / "rank1.json").write_text(json.dumps(RankTrace(rank=1, world_size=2, complete=False).to_json()))
    partial = RunTrace.load(parts)
    assert sorted(partial.ranks) == [1] and not partial.complete
    assert issubclass(TraceError, ValueError)


def test_trace_samples_finds_ids_and_explains_when_it_cannot() -> None:
    class B:
        def __init__(self, ids):
            self.ids = ids

    with Tracer() as tracer:
        assert len(list(trace_samples([B((1, 2)), B((3, 4)), B((5, 6)), B((7, 8))], micro_batches=2))) == 4
        with pytest.raises(TraceError, match="cannot find sample ids in a batch of type tuple; pass ids="):
            list(trace_samples([(1, 2)]))
        with pytest.raises(TraceError, match="micro_batches must be a positive int, got 0"):
            list(trace_samples([], micro_batches=0))
    assert tracer.samples == {0: [[1, 2], [3, 4]], 1: [[5, 6], [7, 8]]}
    assert list(trace_samples([1, 2])) == [1, 2]  # no active tracer: batches pass through


def test_the_hooks_wrap_process_group_methods_once_and_come_off() -> None:
    from torch._C._distributed_c10d import ProcessGroup

    from harness.tracing import hooks

    was_installed = hooks.installed()
    if was_installed:
        hooks.uninstall()
    raw = ProcessGroup.__dict__["allreduce"]
    hooks.install()
    hooks.install()  # idempotent: wrapped once
    wrapped = ProcessGroup.allreduce
    assert hooks.installed() and wrapped.__wrapped__ is not None and not hasattr(wrapped.__wrapped__, "__wrapped__")
    assert ProcessGroup.send.__qualname__ == "ProcessGroup.send"
    hooks.uninstall()
    assert ProcessGroup.__dict__["allreduce"] is raw and not hooks.installed()  # pybind's descriptor back
    if was_installed:
        hooks.install()


def test_collective_sequences_are_aligned_so_an_extra_collective_is_named_with_its_line() -> None:
    """Rank 0 issues one all_reduce more (a flag of the same shape and dtype as the next
    gradient's): position by position every later collective would differ; aligned, the extra
    one and its call site are named."""
    from harness.tracing.records import CollectiveRecord
    from harness.tracing.collective_order import compare_ranks

    def rec(rank: int, seq: int, shape: list[int], site: str, t: int) -> CollectiveRecord:
        return CollectiveRecord(rank=rank, index=seq, op="all_reduce", group="0", group_desc="default_pg", group_ranks=[0, 1],
                                seq=seq, shapes=[shape], dtypes=["float32"], reduce_op="sum", call_site=site, t_ns=t)

    grads = [([4], "loop.py:20 in sync"), ([4], "loop.py:20 in sync"), ([16, 4], "loop.py:20 in sync")]
    rank0 = [rec(0, 1, [4], "loop.py:31 in found_inf", 1)] + [rec(0, i + 2, s, site, 10 + i) for i, (s, site) in enumerate(grads)]
    rank1 = [rec(1, i + 1, s, site, 10 + i) for i, (s, site) in enumerate(grads)]
    [d] = compare_ranks({0: rank0, 1: rank1})
    assert d.code == "collective-mismatch" and d.evidence["aligned"]
    assert d.evidence["extra_on_ranks"] == [0] and d.evidence["absent_ranks"] == [1]
    assert d.evidence["call_site"] == "loop.py:31 in found_inf"
    assert "which rank 1 never issued" in d.summary


def test_steps_cut_from_the_reference_sequence_at_another_size_are_batch_size_mismatch() -> None:
    """The reference's samples consumed in order, none twice or skipped, but in steps of
    another size: batch-size-mismatch. Counts changed by a sampler that duplicates or drops
    samples are those checks' findings, never this one."""
    from harness.tracing.samples import check_sample_ids

    expected = {0: [0, 1, 2, 3, 4, 5, 6, 7], 1: [8, 9, 10, 11, 12, 13, 14, 15]}
    replica = {0: 0, 1: 1}
    twice = {0: {0: [[0, 1], [4, 5], [8, 9], [12, 13]]}, 1: {0: [[2, 3], [6, 7], [10, 11], [14, 15]]}}
    [d] = check_sample_ids(twice, replica, expected)
    assert d.code == "batch-size-mismatch" and d.evidence["consumed"] == 16 and d.evidence["micro_batches_per_replica"] == {"0": 4, "1": 4}
    halved = {0: {0: [[0, 1]], 1: [[4, 5]]}, 1: {0: [[2, 3]], 1: [[6, 7]]}}
    assert [d.code for d in check_sample_ids(halved, replica, expected)] == ["batch-size-mismatch"]
    truncated = {0: {0: [[0, 1], [4]], 1: [[8, 9], [12]]}, 1: {0: [[2, 3], [6]], 1: [[10, 11], [14]]}}
    assert "batch-size-mismatch" not in [d.code for d in check_sample_ids(truncated, replica, expected)]
    duplicated = {r: {0: [[0, 1, 2, 3], [4, 5, 6, 7]]} for r in (0, 1)}
    assert "batch-size-mismatch" not in [d.code for d in check_sample_ids(duplicated, replica, expected)]
