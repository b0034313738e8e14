"""Real third-party parallelization code: torchtitan's own Llama3 under torchtitan's own
``parallelize_llama`` (FSDP over 2 ranks, CPU / gloo) matches the single-device reference.

The CPU needs (device type, attention backend, gradient summing over gloo, triton-free import)
are handled in :mod:`cases.torchtitan_example`; its docstring lists them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "torchtitan",
    reason="torchtitan is not installed: pip install torchtitan==0.3.0 (it installs beside torch 2.13 without changing torch)",
)

from cases.torchtitan_example import CASE, TorchtitanFSDP  # noqa: E402
from harness.pipeline import run_and_diagnose  # noqa: E402


@pytest.mark.distributed(nproc=2)
def test_torchtitan_llama3_under_its_own_fsdp_passes(dist_ctx, tmp_path, reference_cache) -> None:
    """Every rank runs it; the verdict is broadcast from rank 0 so all ranks assert the same."""
    run = run_and_diagnose(CASE, TorchtitanFSDP(), dist_ctx, workdir=tmp_path, cache=reference_cache)
    outcome = [None]
    if dist_ctx.rank == 0:
        report = run.report
        outcome = [(report.verdict.verdict, report.verdict.codes, report.comparison_summary, report.verdict.to_dict())]
    torch.distributed.broadcast_object_list(outcome, src=0)
    verdict, codes, summary, full = outcome[0]
    assert verdict == "pass", f"{codes}\n{full}\n{summary}"
