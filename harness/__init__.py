"""parallel-harness: does your parallel training compute what one device computes?

Pipeline: case -> reference record -> rank records -> gather -> compare -> diagnose -> report.
The pytest plugin (``harness.pytest_plugin``) runs ``@pytest.mark.distributed`` tests on real
ranks. The user API is importable from here (``from harness import assert_matches_reference,
CustomRun, RankLayout``); each name is loaded on first use, so ``import harness`` does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it (one home each; see CONTRIBUTING.md for the map).
_EXPORTS = {
    # pytest and the one-line checks
    "assert_matches_reference": "harness.testing",
    "assert_resumes": "harness.testing",
    "profile_run": "harness.testing",
    "assert_matches_reference_for_all": "harness.search",
    # what trains: a strategy, or your own loop recorded with CustomRun
    "Strategy": "harness.strategy",
    "StrategyBase": "harness.strategy",
    "RankSetup": "harness.strategy",
    "DistContextLike": "harness.strategy",
    "DistContext": "harness.context",
    "CustomRun": "harness.record.custom",
    "ParallelDims": "harness.parallel_dims",
    "RankLayout": "harness.parallel_dims",
    "ParallelConfigError": "harness.parallel_dims",
    "annotate_shard": "harness.record.gather",
    "gather_state": "harness.record.gather",
    "rename_parameters": "harness.record.gather",
    "measure_memory": "harness.record.memory",
    # the case a run is compared on
    "Case": "reference.case",
    "Batch": "reference.case",
    "Sample": "reference.case",
    # running and diagnosing
    "run_strategy": "harness.run",
    "compare_to_reference": "harness.run",
    "RunResult": "harness.run",
    "diagnose_target": "harness.pipeline",
    "Target": "harness.targets.target",
    "target_from_module": "harness.targets.target",
    "RankRunner": "harness.launch.remote",
    "RanksFailed": "harness.launch.remote",
    "RanksHung": "harness.launch.remote",
    "SimulatedRanks": "harness.simulate.run",
    "simulate_target": "harness.pipeline",
    "check_layout": "harness.simulate.layout",
    # what a diagnosis says
    "CODES": "harness.codes",
    "Diagnosis": "harness.codes",
    "DiagnosisReport": "harness.report.model",
    "format_terminal": "harness.report",
    "write_html": "harness.report",
    "Tracer": "harness.tracing",
    "trace_samples": "harness.tracing",
    "RunTrace": "harness.tracing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
