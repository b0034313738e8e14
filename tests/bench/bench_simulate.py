"""Benchmark (not a test): simulated ranks against real ones, and simulation at scale.

One run prints two tables:

1. the same targets at 4 ranks, real (gloo processes, ``diagnose_target``) and simulated (one
   process, ``simulate_target``): wall time and verdict side by side, and the ratio;
2. simulated at 8, 16, 32 and 64 ranks: a diagnosed training run of a ``dp x tp=2`` mesh
   (record, trace, comparison with the reference) and the layout check of a
   ``dp x tp=8 x pp=2`` mesh (pp=1 at 8 ranks), each in a fresh interpreter so its wall time
   and peak resident memory are its own (interpreter start and imports included).

    python tests/bench/bench_simulate.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

SIDE_BY_SIDE = ["tp", "dp-tp", "tp_per_rank_batches", "tp_rank_seeded_dropout"]
SIZES = [8, 16, 32, 64]

CHILD = r'''
import json, resource, sys, time
sys.path.insert(0, {repo!r})
started = time.monotonic()
kind, n = sys.argv[1], int(sys.argv[2])
if kind == "train":
    from cases.catalog import transformer_case
    from cases.strategies.hybrid import DDPTensorParallelStrategy
    from harness.pipeline import simulate_target
    from harness.targets.target import Target
    case = transformer_case(global_batch_size=n * 2, num_samples=max(64, n * 4), steps=2)
    report = simulate_target(Target(f"dp{{n // 2}}-tp2", case, DDPTensorParallelStrategy(tp=2)), n, cache={cache!r})
    verdict = report.verdict.verdict
else:
    from cases.layouts import layout_plan
    from harness.simulate.layout import check_layout
    plan = layout_plan(dp=max(1, n // 16), tp=8, pp=2 if n >= 16 else 1)
    report = check_layout(plan)
    verdict = "fail " + " ".join(report.codes) if report.diagnoses else "pass"
print(json.dumps({{"s": time.monotonic() - started, "verdict": verdict,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
'''


def _child(kind: str, n: int, cache: str) -> dict:
    script = CHILD.format(repo=REPO, cache=cache)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script, kind, str(n)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"s": time.monotonic() - started, "verdict": f"error: {proc.stderr.strip().splitlines()[-1][:80]}", "rss_mib": 0.0,
                "wall": time.monotonic() - started}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall"] = time.monotonic() - started
    return out


def main() -> None:
    from harness.launch.remote import RankRunner
    from harness.pipeline import simulate_target
    from harness.targets.bundled import load_target
    from harness.pipeline import diagnose_target

    cache = tempfile.mkdtemp(prefix="bench-simulate-cache-")
    print(f"1. the same targets at 4 ranks, real (gloo) and simulated; {os.cpu_count()} cores")
    print(f"   {'target':<24} {'real s':>7} {'real verdict':<32} {'sim s':>6} {'sim verdict':<32} {'real/sim':>8}")
    runner = RankRunner()
    try:
        for name in SIDE_BY_SIDE:
            diagnose_target(name, nproc=4, runner=runner, cache=cache)  # warm the pool and the reference cache
            started = time.monotonic()
            real = diagnose_target(name, nproc=4, runner=runner, cache=cache)
            real_s = time.monotonic() - started
            started = time.monotonic()
            sim = simulate_target(load_target(name), 4, cache=cache)
            sim_s = time.monotonic() - started
            rv = f"{real.verdict.verdict} {' '.join(real.codes)}".strip()
            sv = f"{sim.verdict.verdict} {' '.join(sim.codes)}".strip()
            print(f"   {name:<24} {real_s:>7.1f} {rv:<32} {sim_s:>6.1f} {sv:<32} {real_s / sim_s:>8.2f}", flush=True)
    finally:
        runner.close()

    print("\n2. simulated at scale, each in a fresh interpreter (wall includes start-up and imports)")
    print(f"   {'ranks':>5}  {'diagnosed run dp x tp=2':<36}  {'layout check dp x tp=8 x pp':<40}")
    for n in SIZES:
        train = _child("train", n, cache)
        layout = _child("layout", n, cache)
        lay_dims = f"pp={2 if n >= 16 else 1}"
        print(f"   {n:>5}  {train['wall']:>6.1f} s {train['rss_mib']:>7.0f} MiB  {train['verdict']:<14}"
              f"  {layout['wall']:>6.1f} s {layout['rss_mib']:>7.0f} MiB  {lay_dims:<5} {layout['verdict']:<14}", flush=True)


if __name__ == "__main__":
    main()
