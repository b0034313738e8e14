"""Benchmark (not a test): what tracing costs per training step, next to PyTorch's DETAIL mode.

A DDP step and a tensor-parallel (DTensor) step of the tiny transformer on 2 gloo ranks, and a
worst case for the Python hooks (a "step" of 50 all-reduces of 16 floats issued from Python),
each measured in a fresh pair of processes per mode, in one run:

  off       no Flight Recorder, no hooks: plain PyTorch
  fr        Flight Recorder on (TORCH_FR_BUFFER_SIZE=20000), nothing else
  traced    what run_strategy does: FR on, the Python hooks, a Tracer noting each step and
            reading FR and the hooks every few steps (and once at the end, counted apart)
  detail    TORCH_DISTRIBUTED_DEBUG=DETAIL, no FR (PyTorch's own collective checking)

A step is the strategy's local_batches + forward_backward + optimizer step + zero_grad, timed
on rank 0 after warm-up; the median over the measured steps is taken per process, then the
median over the rounds. Prints the figures and the ratios to "off" side by side; asserts
nothing about time.

    python tests/bench/bench_tracing.py [--steps 40] [--warmup 10] [--rounds 3] [--workloads ddp tp allreduce]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("off", "fr", "traced", "detail")
WORKLOADS = ("ddp", "tp", "allreduce")
SMALL_ALL_REDUCES = 50


def _env(mode: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    env["TORCH_FR_BUFFER_SIZE"] = "20000" if mode in ("fr", "traced") else "0"
    if mode == "detail":
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    return env


class _SmallAllReduces:
    """Not a strategy: 50 tiny all-reduces from Python per step, where the hooks cost most."""

    name = "allreduce"

    def setup(self, case, ctx):
        import torch

        from harness.parallel_dims import RankLayout
        from harness.strategy import RankSetup

        model = torch.nn.Linear(2, 2)
        return RankSetup(model, torch.optim.SGD(model.parameters(), lr=0.1), RankLayout.data_parallel(ctx.rank, ctx.world_size), ctx.device)

    def local_batches(self, case, setup, step):
        return []

    def forward_backward(self, case, setup, batches):
        import torch
        import torch.distributed as dist

        t = torch.ones(16)
        for _ in range(SMALL_ALL_REDUCES):
            dist.all_reduce(t)
        return []

    def optimizer_step(self, case, setup):
        pass


def _strategy(workload: str):
    if workload == "allreduce":
        return _SmallAllReduces()
    if workload == "ddp":
        from cases.strategies import DDPStrategy

        return DDPStrategy()
    from cases.strategies.tp import TensorParallelStrategy

    return TensorParallelStrategy()


def _rank_main(rank: int, world: int, store_path: str, mode: str, workload: str, steps: int, warmup: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from cases import transformer_case
    from harness.context import DistContext

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, backend="gloo", device_type="cpu")
    case = transformer_case("adamw", steps=warmup + steps, global_batch_size=8)
    strategy = _strategy(workload)
    tracer = None
    if mode == "traced":
        from harness.tracing import Tracer

        tracer = Tracer(name=f"bench-{workload}")
    setup = strategy.setup(case, ctx)
    if tracer is not None:
        tracer.describe(layout=setup.layout, model=setup.model, state=setup.state)
    torch.manual_seed(case.seed)
    times = []
    dist.barrier()
    for step in range(case.steps):
        t0 = time.perf_counter()
        if tracer is not None:
            tracer.begin_step(step)
        batches = strategy.local_batches(case, setup, step)
        strategy.forward_backward(case, setup, batches)
        strategy.optimizer_step(case, setup)
        setup.optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    finish_s = 0.0
    records = 0
    if tracer is not None:
        t0 = time.perf_counter()
        rank_trace = tracer.finish()
        finish_s = time.perf_counter() - t0
        records = len(rank_trace.collectives)
    dist.barrier()
    if rank == 0:
        measured = times[warmup:]
        with open(out_path, "w") as fh:
            json.dump({"median_s": statistics.median(measured), "mean_s": statistics.mean(measured),
                       "finish_s": finish_s, "records": records}, fh)
    dist.destroy_process_group()


def _child(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    store = tempfile.mktemp(prefix="bench-tracing-store-")
    mp.spawn(_rank_main, args=(2, store, args.mode, args.workload, args.steps, args.warmup, args.out), nprocs=2)


def _measure(mode: str, workload: str, steps: int, warmup: int) -> dict:
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode, "--workload", workload,
             "--steps", str(steps), "--warmup", str(warmup), "--out", out],
            env=_env(mode), capture_output=True, text=True, timeout=600, check=False,
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            signal = next((line for line in reversed(tail) if "signal" in line or "Error" in line), tail[-1] if tail else "")
            return {"error": signal[-160:] or f"exit code {proc.returncode}"}
        with open(out) as fh:
            return json.load(fh)
    finally:
        os.unlink(out)


def _ratio(med: dict[str, float | None], a: str, b: str) -> str:
    x, y = med.get(a), med.get(b)
    return f"{x / y:.3f}x" if x and y else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    workloads = tuple(args.workloads)
    results: dict[tuple[str, str], list[dict]] = {(m, w): [] for m in MODES for w in workloads}
    started = time.time()
    for r in range(args.rounds):
        for workload in workloads:
            for mode in MODES:  # interleaved, so drift in machine load hits every mode alike
                res = _measure(mode, workload, args.steps, args.warmup)
                results[(mode, workload)].append(res)
                shown = f"{res['median_s'] * 1e3:.2f} ms" if "median_s" in res else f"FAILED: {res['error']}"
                print(f"  round {r + 1}/{args.rounds} {workload:>3} {mode:>6}: {shown}", flush=True)
    print(f"\n2 gloo ranks; ddp / tp: tiny transformer (dim 16, 4 layers); allreduce: {SMALL_ALL_REDUCES} all-reduces "
          f"of 16 floats; {args.steps} measured steps after {args.warmup} "
          f"warm-up, median of {args.rounds} rounds ({time.time() - started:.0f} s in all)\n")
    header = f"{'step':>9} | " + " | ".join(f"{m:>16}" for m in MODES) + " | traced/off | detail/off | traced/detail"
    print(header)
    print("-" * len(header))
    for workload in workloads:
        med: dict[str, float | None] = {}
        cells = []
        for mode in MODES:
            ok = [x["median_s"] for x in results[(mode, workload)] if "median_s" in x]
            med[mode] = statistics.median(ok) if ok else None
            if ok:
                cells.append(f"{med[mode] * 1e3:13.2f} ms")
            else:
                err = next((x["error"] for x in results[(mode, workload)] if "error" in x), "?")
                cells.append(f"{'crashed':>16}")
                print(f"  ({workload} {mode}: {err})")

        ratios = [_ratio(med, "traced", "off"), _ratio(med, "detail", "off"), _ratio(med, "traced", "detail")]
        print(f"{workload:>9} | " + " | ".join(cells) + f" | {ratios[0]:>10} | {ratios[1]:>10} | {ratios[2]:>13}")
    for workload in workloads:
        fin = [x["finish_s"] for x in results[("traced", workload)] if "finish_s" in x]
        recs = [x["records"] for x in results[("traced", workload)] if "records" in x]
        if fin:
            print(f"{workload}: end-of-run read of the trace (once per run, not per step): "
                  f"{statistics.median(fin) * 1e3:.1f} ms for {recs[0]} records")


if __name__ == "__main__":
    main()
