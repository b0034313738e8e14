"""Benchmark (not a test): what a diagnosis costs per step, and where the time goes.

Diagnoses the bundled MLP custom loop (``custom-example``) and the tiny transformer under DDP
at 3, 30, 300 and 1,000 steps on 2 ranks (``python -m harness diagnose TARGET --steps K``'s
engine, each with a fresh reference cache), and prints in one table per run: the wall time,
the time of each phase (the reference's training and recording, the ranks' training and
recording, the calibration replays, the stepwise replay, the comparison, the trajectory view,
the diagnosis and reports), the disk written (run folder and reference cache), and the cost per
step with its growth from one step count to the next (linear: the per-step cost stays flat).

    python tests/bench/bench_long_runs.py [--steps 3,30,300,1000] [--targets mlp,transformer] [--nproc 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

TRANSFORMER_TARGET = '''
from cases.catalog import transformer_case
from cases.strategies import DDPStrategy

CASE = transformer_case()
STRATEGY = DDPStrategy()
NPROC = {nproc}
TIMEOUT = 1800
'''

PHASES = ("reference_s", "ranks_s", "calibration_s", "replay_s", "comparison_s", "trajectory_view_s", "diagnosis_s")


def _disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="3,30,300,1000")
    parser.add_argument("--targets", default="mlp,transformer")
    parser.add_argument("--nproc", type=int, default=2, help="the transformer's ranks (the MLP example's are its own: 2)")
    args = parser.parse_args()
    from harness.launch.remote import RankRunner
    from harness.pipeline import diagnose_target

    steps = [int(s) for s in args.steps.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-long-"))
    (root / "transformer_ddp.py").write_text(TRANSFORMER_TARGET.format(nproc=args.nproc))
    targets = {"mlp": "custom-example", "transformer": str(root / "transformer_ddp.py")}
    runner = RankRunner()
    rows = []
    try:
        for name in args.targets.split(","):
            for k in steps:
                work, cache = root / f"{name}-{k}-work", root / f"{name}-{k}-cache"
                started = time.perf_counter()
                report = diagnose_target(targets[name], steps=k, runner=runner, workdir=work, cache=cache, timeout=1800)
                wall = time.perf_counter() - started
                phases = report.timing.get("phases", {})
                rows.append((name, k, wall, report.verdict.verdict, phases, _disk(work), _disk(cache)))
                shutil.rmtree(work, ignore_errors=True)
                shutil.rmtree(cache, ignore_errors=True)
                print(f"  {name} {k} steps: {wall:.1f} s, {report.verdict.verdict}, "
                      + ", ".join(f"{p.removesuffix('_s')} {phases.get(p, 0.0):.1f}" for p in PHASES), flush=True)
    finally:
        runner.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nmlp on 2 ranks, transformer on {args.nproc}; {os.cpu_count()} cores; seconds per phase, disk in MiB "
          "(the first run's wall time includes starting the rank pool)")
    head = ["target", "steps", "wall", "verdict", *(p.removesuffix("_s") for p in PHASES), "run MiB", "cache MiB", "ms/step", "growth"]
    print(" | ".join(head))
    previous: dict[str, tuple[int, float]] = {}
    for name, k, wall, verdict, phases, run_bytes, cache_bytes in rows:
        per_step = 1000 * wall / k
        growth = ""
        if name in previous:
            k0, wall0 = previous[name]
            growth = f"x{wall / wall0:.1f} for x{k / k0:.0f} steps"
        previous[name] = (k, wall)
        cells = [name, str(k), f"{wall:.1f}", verdict, *(f"{phases.get(p, 0.0):.1f}" for p in PHASES),
                 f"{run_bytes / 2**20:.1f}", f"{cache_bytes / 2**20:.1f}", f"{per_step:.0f}", growth]
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
