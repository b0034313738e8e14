"""The fault matrix, scored: every fault kind injected on a first, a middle and the last rank
at nproc 4; a cell scores when the report blames exactly the injected rank (the anchor is
NVIDIA's resiliency fault-injection loop, which found the symptom rank blamed instead of the
faulting one for application exceptions).

    python tests/fault_matrix.py            # prints the score table (about a minute on 2 cores)

``tests/test_fault_matrix.py`` runs one cell per kind in the default suite and the whole
matrix under ``-m slow``. Blame is :func:`harness.launch.failure_text.culprits`, the ranks the report's
first lines name; each cell also checks that the report's first line names the injected rank.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

NPROC = 4
KINDS = ("exception", "sigkill", "sigsegv", "sleep", "extra-collective", "skipped-collective")
POSITIONS = {"first": 0, "middle": 1, "last": NPROC - 1}
TIMEOUT_S = 60.0
STALL_WINDOW_S = 2.0  # the matrix's hangs are named in seconds; the default window is 10 s
FAILURE_GRACE_S = 1.0  # how long the others may take to fail after the first (default 3 s)


def fast_runner():
    """A :class:`~harness.launch.remote.RankRunner` whose pools name hangs after
    ``STALL_WINDOW_S`` and stop the other ranks ``FAILURE_GRACE_S`` after a failure."""
    from harness.launch.remote import RankRunner

    return RankRunner(stall_window=STALL_WINDOW_S, failure_grace=FAILURE_GRACE_S)


def inject(ctx, kind: str, victim: int) -> None:
    """The rank body: every rank in step for one all_reduce, then ``victim`` misbehaves."""
    t = torch.ones(4)
    dist.all_reduce(t)
    if ctx.rank == victim:
        if kind == "exception":
            raise RuntimeError(f"injected fault on rank {victim}")
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "sigsegv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if kind == "sleep":
            time.sleep(TIMEOUT_S * 2)  # outside any collective; the others wait for it
        if kind == "extra-collective":
            dist.all_reduce(torch.zeros(4))  # an all_reduce the other ranks never issue
        if kind == "skipped-collective":
            return  # the all_reduce below is never issued by this rank
    dist.all_reduce(t)
    dist.barrier()


@dataclass
class Cell:
    kind: str
    position: str
    victim: int
    blamed: list[int]
    first_line: str
    seconds: float

    @property
    def scored(self) -> bool:
        return self.blamed == [self.victim] and f"rank {self.victim}" in self.first_line


def run_cell(runner, kind: str, position: str) -> Cell:
    from harness.launch.failure_text import culprits
    from harness.launch.remote import RanksFailed

    victim = POSITIONS[position]
    started = time.monotonic()
    try:
        runner.run(inject, nproc=NPROC, kwargs={"kind": kind, "victim": victim}, timeout=TIMEOUT_S)
    except RanksFailed as exc:
        lines = [ln for ln in exc.report.splitlines() if ln.strip()]
        first = lines[0] if lines else ""
        if first.startswith(("HANG", "TIMEOUT")) and len(lines) > 1:
            first = lines[1]  # the hang's diagnosis follows the headline
        return Cell(kind, position, victim, culprits(exc.outcome), first, time.monotonic() - started)
    return Cell(kind, position, victim, [], "(the run passed: the fault was not seen)", time.monotonic() - started)


def score(runner, kinds=KINDS, positions=tuple(POSITIONS)) -> list[Cell]:
    return [run_cell(runner, kind, position) for kind in kinds for position in positions]


def main() -> None:
    # The ranks import the body by module name: run it as `fault_matrix`, not `__main__`.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fault_matrix

    with fault_matrix.fast_runner() as runner:
        cells = fault_matrix.score(runner)
    width = max(len(k) for k in KINDS)
    print(f"fault matrix at nproc {NPROC}: a cell scores when the report blames exactly the injected rank")
    print(f"{'fault':<{width}} " + " ".join(f"{p + ' (rank ' + str(r) + ')':>16}" for p, r in POSITIONS.items()))
    for kind in KINDS:
        row = [c for c in cells if c.kind == kind]
        print(f"{kind:<{width}} " + " ".join(f"{('ok' if c.scored else 'blamed ' + str(c.blamed)) + f' {c.seconds:.1f}s':>16}" for c in row))
    print(f"score: {sum(c.scored for c in cells)} / {len(cells)}")


if __name__ == "__main__":
    main()
