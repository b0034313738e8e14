"""Benchmark (not a test): what the stepwise comparison costs next to the trajectory one.

For each target below, the parallel run is trained once on warm ranks (its record kept), then
the comparison of that record with the reference is timed in this process, both ways, on the
same record:

  trajectory  compare the whole trajectory with the cached reference (default tolerances for
              fp32, calibrated for bf16: what ``run_strategy`` did before)
  stepwise    replay the reference one step at a time from the run's state, compare, plus
              the trajectory view (calibrated tolerances from the cached one-step noise runs)

"first" is each mode's first call on a fresh cache (it trains the reference and, stepwise, the
two calibration replays); the medians are over ``--rounds`` warm calls. Prints figures and the
ratio side by side; asserts nothing about time.

    python tests/bench/bench_compare.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from harness.launch.remote import RankRunner


def _targets():
    from cases import mlp_case, transformer_case
    from cases.strategies import DDPStrategy, FSDPStrategy, TensorParallelStrategy

    out = [
        ("ddp / mlp fp32", mlp_case("adamw"), DDPStrategy()),
        ("tp / transformer fp32", transformer_case(), TensorParallelStrategy()),
        ("fsdp / transformer bf16", transformer_case(dtype=torch.bfloat16), FSDPStrategy()),
    ]
    try:
        import transformers  # noqa: F401

        from cases.hf import hf_case

        out.append(("fsdp / hf llama fp32", hf_case("llama"), FSDPStrategy()))
    except ImportError:
        pass
    return out


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from harness.run import compare_to_reference, train_strategy
    from reference import Record

    runner = RankRunner()
    rows = []
    for label, case, strategy in _targets():
        work = tempfile.mkdtemp(prefix="bench-compare-")
        # train_strategy on the ranks, keywords only (ctx is passed by the runner); rank 0 writes.
        runner.run(train_strategy, nproc=2, timeout=300,
                   kwargs={"case": case, "strategy": strategy, "record_path": str(Path(work) / "record"), "trace": False})
        record = Record.load(Path(work) / "record")
        cache = Path(work) / "cache"
        timings = {}
        verdicts = {}
        for mode in ("trajectory", "stepwise"):
            first = _time(lambda: compare_to_reference(case, record, cache=cache, comparison=mode))
            warm = [_time(lambda: compare_to_reference(case, record, cache=cache, comparison=mode)) for _ in range(args.rounds)]
            verdicts[mode] = "PASS" if compare_to_reference(case, record, cache=cache, comparison=mode).passed else "FAIL"
            timings[mode] = (first, statistics.median(warm))
        rows.append((label, timings, verdicts))
    runner.close()

    print(f"\ncomparison cost per run, median of {args.rounds} warm calls (first call: fresh cache)\n")
    print(f"{'target':<26} {'trajectory':>11} {'stepwise':>9} {'ratio':>6}   {'first: traj / step':>19}   verdicts")
    for label, t, v in rows:
        (tf, tw), (sf, sw) = t["trajectory"], t["stepwise"]
        print(f"{label:<26} {tw:>10.2f}s {sw:>8.2f}s {sw / tw:>5.1f}x   {tf:>8.2f}s / {sf:>6.2f}s   "
              f"trajectory {v['trajectory']}, stepwise {v['stepwise']}")


if __name__ == "__main__":
    main()
