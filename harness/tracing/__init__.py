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

import importlib
from typing import Any

# Public name -> the module that defines it. Loaded on first use, so that importing one
# light module of this package (fr, the Flight Recorder reader the launcher uses) does not
# import torch through the others.
_EXPORTS = {
    "CollectiveRecord": "records",
    "compare_ranks": "collective_order",
    "diagnose_hang": "hang",
    "hang_lines": "hang",
    "check_mesh": "mesh",
    "check_sample_ids": "samples",
    "check_samples": "samples",
    "RankTrace": "run_trace",
    "RunTrace": "run_trace",
    "TraceError": "run_trace",
    "Tracer": "tracer",
    "current_tracer": "tracer",
    "trace_samples": "tracer",
    "check_collectives": "checks",
    "run_checks": "checks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'harness.tracing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"harness.tracing.{module}"), name)
