"""Tracing: sample ids, mesh coordinates and groups, and the collective order of every rank,
with the checks that name what went wrong.

Recording (on every rank; :func:`harness.run.run_strategy` does it for you)::

    from harness.tracing import Tracer, trace_samples

    with Tracer(layout=layout, model=model) as tracer:
        for step in range(steps):
            tracer.begin_step(step)
            for batch in trace_samples(loader, ids=lambda b: b["id"]):   # your own loader
                ...
    trace = tracer.gather(dst=0)          # collective: a RunTrace on rank 0
    trace.save("run/trace.json")

Checking (anywhere, from files)::

    from harness.tracing import RunTrace, run_checks
    diagnoses = run_checks(Record.load(run), Record.load(ref), RunTrace.load("run/trace.json"))

- :func:`check_samples`: ``duplicate-samples``, ``dropped-samples``, ``inconsistent-replica-inputs``;
- :func:`check_mesh`: ``swapped-mesh-dims`` (groups not as the mesh says, gradient sync across shards);
- :func:`check_collectives`: ``collective-mismatch`` / ``collective-missing`` per group and p2p channel;
- :func:`diagnose_hang`: the same, from the launcher's timeout dumps.

Sources: PyTorch's Flight Recorder (every collective, C++-issued ones included) and Python
hooks on ``ProcessGroup`` (p2p ops, peers, reduce ops and call sites FR lacks); see
:mod:`harness.tracing.hooks`.
"""

from __future__ import annotations

from typing import Any

from harness.codes import Diagnosis

from . import hooks
from .collectives import CollectiveRecord, compare_ranks
from .hang import diagnose_hang, hang_lines
from .mesh import check_mesh
from .samples import check_sample_ids, check_samples
from .trace import (
    RankTrace,
    RunTrace,
    TraceError,
    Tracer,
    current_tracer,
    trace_samples,
)

__all__ = [
    "CollectiveRecord",
    "RankTrace",
    "RunTrace",
    "TraceError",
    "Tracer",
    "check_collectives",
    "check_mesh",
    "check_sample_ids",
    "check_samples",
    "current_tracer",
    "diagnose_hang",
    "hang_lines",
    "install_hooks",
    "run_checks",
    "trace_samples",
]


def install_hooks() -> None:
    """Install the Python-side collective hooks in this process (idempotent, cheap)."""
    hooks.install()


def check_collectives(trace: RunTrace, *, include_harness: bool = True) -> list[Diagnosis]:
    """``collective-mismatch`` / ``collective-missing``: per process group, every member must
    issue the same sequence of collectives; every send must meet its receive.

    The harness's own recording collectives are part of the sequence (a rank that skipped a
    training collective pairs the others' with its next recording one), but evidence positions
    index the report's event list, which leaves them out."""
    by_rank = {r: rt.events(include_harness=include_harness) for r, rt in trace.ranks.items()}
    return compare_ranks(by_rank, positions=trace.positions())


def run_checks(record: Any, reference: Any, trace: RunTrace | None) -> list[Diagnosis]:
    """Every tracing check that the inputs allow: samples (from ``record``, else the trace),
    mesh and collectives (from ``trace``)."""
    found: list[Diagnosis] = list(check_samples(record, reference, trace))
    if trace is not None:
        found += check_mesh(trace)
        found += check_collectives(trace)
    return found
