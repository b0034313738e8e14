"""The fault matrix of ``tests/fault_matrix.py`` on real ranks: every fault kind is blamed on
the rank it was injected on - one cell per kind by default, the whole matrix under -m slow."""

from __future__ import annotations

import pytest

from fault_matrix import KINDS, POSITIONS, fast_runner, run_cell

# One cell per kind, the faulting rank rotating through first, middle and last.
DEFAULT_CELLS = [(kind, list(POSITIONS)[i % len(POSITIONS)]) for i, kind in enumerate(KINDS)]


@pytest.fixture(scope="module")
def fast_stall_runner():
    with fast_runner() as runner:
        yield runner


def _check(runner, kind: str, position: str) -> None:
    cell = run_cell(runner, kind, position)
    assert cell.scored, f"{kind} on the {position} rank (rank {cell.victim}): blamed {cell.blamed}; report opens: {cell.first_line}"


@pytest.mark.parametrize("kind, position", DEFAULT_CELLS)
def test_each_fault_kind_is_blamed_on_the_injected_rank(fast_stall_runner, kind, position) -> None:
    _check(fast_stall_runner, kind, position)


@pytest.mark.slow
@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("kind", KINDS)
def test_the_whole_fault_matrix(fast_stall_runner, kind, position) -> None:
    _check(fast_stall_runner, kind, position)


def test_a_hang_is_named_from_the_journals_when_no_rank_answers_its_dump() -> None:
    """A busy machine can keep ranks from answering the launcher's dump request in time: the
    hang is then still named, from the collectives each rank journalled before issuing them."""
    from fault_matrix import STALL_WINDOW_S

    from harness.launch.pool import PoolConfig, PoolManager
    from harness.launch.remote import RankRunner

    manager = PoolManager(PoolConfig(stall_window=STALL_WINDOW_S, dump_timeout=1e-3))
    with RankRunner(manager) as runner:
        try:
            cell = run_cell(runner, "sleep", "middle")
        finally:
            manager.close()
    assert cell.scored, f"blamed {cell.blamed}; report opens: {cell.first_line}"
    assert "collective-missing" in cell.first_line
