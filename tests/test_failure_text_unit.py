"""A rank's traceback as pytest prints it, whatever its depth (pytest >= 8 made traceback
entries immutable: a deep traceback once fell back to Python's own format)."""

from __future__ import annotations


def _three(n: int) -> None:
    if n == 0:
        raise ValueError("deep")
    _three(n - 1)


def test_a_deep_traceback_is_pytest_style_with_the_middle_short() -> None:
    from harness.launch.worker import _pytest_longrepr

    try:
        _three(3)
    except ValueError as exc:
        text = _pytest_longrepr(exc, _three)
    assert "Traceback (most recent call last)" not in text
    assert "raise ValueError(\"deep\")" in text and "E           ValueError: deep" in text
    assert text.count(": in _three") >= 2, text  # the middle entries, short style


def test_an_internal_failure_is_ours_only_for_pythons_own_exception_raised_in_the_harness() -> None:
    """An AttributeError raised in harness code is ours; the harness's own error classes (a
    message to a person) and anything raised in the user's code stay the user's to read."""
    import os

    from harness.frames import HARNESS_DIR
    from harness.launch.failure_text import is_internal_failure

    ours = (os.path.join(HARNESS_DIR, "pipeline.py"), "195", "_train_custom")
    user = ("/home/me/loop.py", "12", "train")
    assert is_internal_failure("AttributeError", [user, ours])
    assert not is_internal_failure("RecorderError", [user, ours])
    assert not is_internal_failure("AttributeError", [ours, user])
    assert not is_internal_failure("AttributeError", [])


def test_where_each_rank_is_comes_from_its_dump_as_data() -> None:
    """The hang page's table: each rank's state, the collective it waits in, the user's frame;
    a rank held in the harness's own recording says so instead of torch's frame."""
    from harness.launch.failure_text import rank_states
    from harness.launch.pool import RunOutcome
    from harness.launch.protocol import RankDump
    from harness.tracing.entries import CollectiveEntry

    def entry(op, group, ranks, seq, state, phase="train", site="loop.py:46 in sync_grads"):
        return CollectiveEntry(record_id=seq, op=op, process_group=group, group_ranks=ranks, seq_id=seq, p2p_seq_id=0,
                               input_sizes=[], state=state, call_site=site, phase=phase)

    waiting = RankDump(rank=0, pid=1, state="running t", stack="", waiting_in="all_reduce", user_site="loop.py:46 in sync_grads",
                       collectives=[entry("barrier", "0:default_pg", [0, 1], 1, "completed"),
                                    entry("all_reduce", "1:mesh_dp", [0, 1], 1, "scheduled")])
    held = RankDump(rank=1, pid=2, state="running t", stack="", waiting_in="all_gather", user_site="",
                    collectives=[entry("all_gather", "0:default_pg", [0, 1], 4, "scheduled", phase="harness", site="/torch/x.py:1 in f")])
    outcome = RunOutcome(nproc=2, timed_out=True, aborted={0: waiting, 1: held})
    first, second = rank_states(outcome)
    assert (first["state"], first["op"], first["seq"], first["group"], first["site"]) == \
        ("waiting", "all_reduce", 1, "1:mesh_dp", "loop.py:46 in sync_grads"), first
    assert first["last_completed"] == "barrier #1 on 0:default_pg"
    assert second["op"] == "all_gather" and "harness's own recording" in second["site"], second
