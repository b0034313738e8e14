"""The tracing checks of a finished run: collectives per group and p2p channel, and every
check the inputs allow (samples, mesh, collectives)."""

from __future__ import annotations

from typing import Any

from harness.codes import Diagnosis
from harness.tracing.collective_order import compare_ranks
from harness.tracing.mesh import check_mesh
from harness.tracing.samples import check_samples
from harness.tracing.run_trace import RunTrace

__all__ = ["check_collectives", "run_checks"]


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
