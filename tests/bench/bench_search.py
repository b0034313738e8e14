"""Benchmark (not a test): what one config-search example costs on the warm rank pool.

One Hypothesis example of the config search is one ``check_config`` call: one
``RankRunner.run`` on a warm pool (build the case and the strategy on the ranks, train, record,
compare with the cached single-device reference, calibrated tolerances). This measures that,
in one run, for:

  smallest   the smallest config of each built-in strategy (ddp, fsdp, tp, pipeline, ddp-tp,
             fsdp-tp) at each world size 1 / 2 / 4 it allows (what shrinking heads for)
  random     a few configs drawn from ``parallel_configs`` with a fixed seed (what a search
             generates: more micro-batches, steps, layers, other dtypes and optimizers)

Pool start-up (fork server, ranks, process group) and each strategy's ``warm_up`` (first-use
imports such as torch._dynamo for DDP, the smallest config's reference) are timed apart and
excluded. Each config then runs once untimed-for-the-median ("first": it also trains and caches
that config's reference and calibration runs), then ``--rounds`` times, interleaved over the
configs; the table shows the median, min and max. Last, the same ddp world-2 example on a
fresh pool (new PoolManager: start-up included), next to its warm median. Prints figures,
asserts nothing about time.

    python tests/bench/bench_search.py [--rounds 3] [--random 4] [--seed 0] [--random-max-world 2]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from harness.launch.pool import PoolConfig, PoolManager
from harness.launch.remote import RankRunner, RanksFailed, RanksHung
from harness.search import (
    ParallelConfig,
    available_strategies,
    check_config,
    noop,
    parallel_configs,
    smallest_config,
    warm_up,
)

BUILT_IN = ("ddp", "fsdp", "tp", "pipeline", "ddp-tp", "fsdp-tp")
WORLDS = (1, 2, 4)


@dataclass
class Row:
    kind: str  # "smallest" or "random"
    config: ParallelConfig
    warm_up_s: float | None = None
    first_s: float | None = None
    seconds: list[float] = field(default_factory=list)
    results: list[str] = field(default_factory=list)  # "ok", "MISMATCH", "crashed", "hung"


def _run(runner: RankRunner, config: ParallelConfig, cache: str, workdir: str) -> tuple[float, str]:
    """Wall time of one check_config call (one search example) and its result."""
    start = time.perf_counter()
    try:
        outcome = check_config(runner, config.strategy, config, cache=cache, workdir=workdir)
        result = "ok" if outcome.passed else "MISMATCH"
    except RanksFailed as exc:
        result = "hung" if isinstance(exc, RanksHung) else "crashed"
    return time.perf_counter() - start, result


def _random_configs(count: int, seed_value: int, max_world: int, names: list[str]) -> list[ParallelConfig]:
    """``count`` distinct configs drawn from ``parallel_configs`` (strategy drawn too), the same
    ones on every run for a given seed and Hypothesis version."""
    usable = []
    for name in names:
        try:
            parallel_configs(name, max_world=max_world)
        except ValueError:  # needs more ranks than max_world (ddp-tp, fsdp-tp need 4)
            continue
        usable.append(name)
    space = st.sampled_from(usable).flatmap(lambda name: parallel_configs(name, max_world=max_world))
    seen: list[ParallelConfig] = []

    @seed(seed_value)
    @settings(database=None, max_examples=max(30, 10 * count), phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(space)
    def collect(config: ParallelConfig) -> None:
        if config not in seen:
            seen.append(config)

    collect()
    # spread the picks over the strategies (and over all the examples: the first ones Hypothesis
    # generates are the simplest)
    rng = random.Random(seed_value)
    by_strategy = {name: [c for c in seen if c.strategy == name] for name in usable}
    order = [name for name in usable if by_strategy[name]]
    rng.shuffle(order)
    picked: list[ParallelConfig] = []
    while len(picked) < count and any(by_strategy.values()):
        for name in order:
            if by_strategy[name] and len(picked) < count:
                picked.append(by_strategy[name].pop(rng.randrange(len(by_strategy[name]))))
    return picked


def _cold(config: ParallelConfig, cache: str, workdir: str, start_method: str) -> tuple[float, str]:
    """The example on a fresh PoolManager: fork server / spawn, ranks, process group, imports."""
    runner = RankRunner(PoolManager(PoolConfig(), start_method=start_method))
    try:
        return _run(runner, config, cache, workdir)
    finally:
        runner.close()


def _allows(name: str, world: int) -> bool:
    try:
        smallest_config(name, world)
    except ValueError:
        return False
    return True


def _fmt(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per config (the median is shown)")
    parser.add_argument("--random", type=int, default=4, help="configs drawn from parallel_configs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random configs")
    parser.add_argument("--random-max-world", type=int, default=2, help="max_world of the random configs")
    parser.add_argument("--strategies", nargs="+", default=list(BUILT_IN), help="strategies for the smallest configs")
    parser.add_argument("--no-cold", action="store_true", help="skip the fresh-pool figures")
    args = parser.parse_args()

    started = time.perf_counter()
    known = available_strategies()
    names = [n for n in args.strategies if n in known]
    missing = [n for n in args.strategies if n not in known]
    rows = [
        Row("smallest", smallest_config(name, world))
        for name in names for world in WORLDS
        if _allows(name, world)
    ]
    rows += [Row("random", c) for c in _random_configs(args.random, args.seed, args.random_max_world, names)]
    worlds = sorted({r.config.world_size for r in rows})

    manager = PoolManager(PoolConfig(), max_pools=len(worlds))  # every world stays warm: no evictions
    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
        cache = os.path.join(tmp, "reference-cache")
        with RankRunner(manager) as runner:
            pool_start = {}
            for world in worlds:
                t0 = time.perf_counter()
                runner.run(noop, nproc=world)
                pool_start[world] = time.perf_counter() - t0
                print(f"  pool start, world {world}: {pool_start[world]:.2f} s", flush=True)

            warm = {}
            for name in sorted({r.config.strategy for r in rows}, key=lambda n: (*BUILT_IN, n).index(n)):
                needs = sorted({r.config.world_size for r in rows if r.config.strategy == name})
                for world, took in warm_up(runner, name, needs, cache=cache).items():
                    warm[(name, world)] = took
                    print(f"  warm_up {name:>8} world {world}: {took:.2f} s", flush=True)
            for row in rows:
                if row.kind == "smallest":
                    row.warm_up_s = warm.get((row.config.strategy, row.config.world_size))

            for i, row in enumerate(rows):
                row.first_s, result = _run(runner, row.config, cache, os.path.join(tmp, f"first-{i}"))
                print(f"  first  {row.config.strategy:>8} world {row.config.world_size}: {row.first_s:.2f} s {result}",
                      flush=True)
            for r in range(args.rounds):
                for i, row in enumerate(rows):  # interleaved, so drift in machine load hits every config alike
                    took, result = _run(runner, row.config, cache, os.path.join(tmp, f"round-{r}-{i}"))
                    row.seconds.append(took)
                    row.results.append(result)
                print(f"  round {r + 1}/{args.rounds} done", flush=True)
            pools_started = manager.started

        cold = {}  # after the warm pools are closed; same reference cache, so only start-up differs
        if not args.no_cold:
            target = smallest_config("ddp", 2)
            for method in ("forkserver", "spawn"):
                cold[method] = _cold(target, cache, os.path.join(tmp, f"cold-{method}"), method)
                print(f"  cold ddp world 2 ({method}): {cold[method][0]:.2f} s {cold[method][1]}", flush=True)

    total = time.perf_counter() - started
    print(f"\nconfig search, one example = one check_config call (calibrated tolerances, cached reference); "
          f"{os.cpu_count()} cores, gloo, median of {args.rounds} rounds ({total:.0f} s in all)")
    if missing:
        print(f"not registered here (skipped): {', '.join(missing)}")
    print("pool start (ranks + process group, one noop call; the first one also starts the fork server): "
          + ", ".join(f"world {w}: {s:.2f} s" for w, s in pool_start.items()))
    print(f"pools started on the warm runner: {pools_started} (one per world size means none was restarted)\n")
    header = (f"{'kind':>8} {'strategy':>8} {'world':>5} {'warm-up s':>9} {'first s':>7} {'median s':>8} "
              f"{'min s':>6} {'max s':>6} {'result':>8}  config")
    print(header)
    print("-" * len(header))
    for row in rows:
        results = sorted(set(row.results)) or ["-"]
        print(f"{row.kind:>8} {row.config.strategy:>8} {row.config.world_size:>5} {_fmt(row.warm_up_s):>9} "
              f"{_fmt(row.first_s):>7} {_fmt(statistics.median(row.seconds) if row.seconds else None):>8} "
              f"{_fmt(min(row.seconds, default=None)):>6} {_fmt(max(row.seconds, default=None)):>6} "
              f"{'/'.join(results):>8}  {row.config.describe()}")
    print("warm-up s: warm_up() for that strategy and world (first-use imports + the smallest config with "
          "default tolerances, reference training included); first s: the config's first run (its reference "
          "and calibration runs are trained and cached then)")
    if cold:
        target = smallest_config("ddp", 2)
        base = next((r for r in rows if r.kind == "smallest" and r.config == target), None)
        warm_s = statistics.median(base.seconds) if base is not None and base.seconds else None
        print(f"\nddp world 2, smallest config ({target.describe()}):")
        print(f"  {'warm pool (median)':<42} {_fmt(warm_s):>7} s")
        for method, (seconds, result) in cold.items():
            ratio = f"{seconds / warm_s:.0f}x warm" if warm_s else "-"
            print(f"  {'fresh pool, ' + method + ' (start-up included)':<42} {seconds:>7.2f} s  {ratio}  {result}")


if __name__ == "__main__":
    main()
