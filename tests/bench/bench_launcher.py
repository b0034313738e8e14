"""Benchmark (not a test): the warm rank pool against spawning ranks per test.

Runs the same 20 small distributed tests at nproc 2 and 4 three ways, in one run:
  warm pool        - this plugin's default (ranks started once, forked from a fork server)
  spawn per test   - this plugin with --dist-fresh-pool --dist-start-method spawn: fresh
                     interpreters per test, which is how PyTorch's MultiProcessTestCase works
  mp.spawn per test - plain torch.multiprocessing.spawn + init/destroy_process_group per test
and prints total wall time, per-test time and the ratios; then the time from Ctrl-C (SIGINT
to pytest while every rank sleeps in a test body) to pytest's exit.

    python tests/bench/bench_launcher.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

N_TESTS = 20

TEST_FILE = f'''
import pytest
import torch
import torch.distributed as dist


@pytest.mark.parametrize("i", range({N_TESTS}))
@pytest.mark.distributed
def test_small(dist_ctx, i):
    t = torch.full((16,), float(i + dist_ctx.rank))
    dist.all_reduce(t)
    assert t[0].item() == dist_ctx.world_size * i + sum(range(dist_ctx.world_size))
'''

MP_SCRIPT = f'''
import os, sys, tempfile, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def body(rank, world, path, i):
    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)
    t = torch.full((16,), float(i + rank))
    dist.all_reduce(t)
    assert t[0].item() == world * i + sum(range(world))
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1])
    for i in range({N_TESTS}):
        path = tempfile.mktemp()
        mp.spawn(body, args=(world, path, i), nprocs=world)
'''


def run_pytest(directory: str, nproc: int, extra: list[str]) -> tuple[float, list[float]]:
    xml = os.path.join(directory, "report.xml")
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nproc", str(nproc),
         f"--junitxml={xml}", "test_bench.py", *extra],
        cwd=directory, check=True, stdout=subprocess.DEVNULL,
    )
    total = time.perf_counter() - start
    per_test = [float(case.get("time", 0)) for case in ET.parse(xml).iter("testcase")]
    return total, per_test


def time_pytest_alone(directory: str) -> float:
    """The same session with every test deselected (no rank starts): what both ways pay and no
    launcher can cut - pytest's start-up and plugins, the test file's ``import torch`` at
    collection, the summary (hypothesis's plugin imports itself there) and the interpreter's
    exit."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not distributed",
                           "test_bench.py"], cwd=directory, stdout=subprocess.DEVNULL)
    if done.returncode not in (0, 5):  # 5: no test ran, as asked
        done.check_returncode()
    return time.perf_counter() - start


SLEEP_FILE = '''
import os
import time
import pytest


@pytest.mark.distributed
def test_sleeps(dist_ctx):
    open(os.path.join(os.environ["MARKER_DIR"], f"rank{dist_ctx.rank}"), "w").close()
    time.sleep(120)
'''


def time_interrupt(directory: str, nproc: int) -> float:
    """Seconds from SIGINT to pytest's exit while the ranks sleep inside the test body."""
    import signal

    markers = tempfile.mkdtemp(dir=directory)
    with open(os.path.join(directory, "test_sleep_bench.py"), "w") as fh:
        fh.write(SLEEP_FILE)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nproc", str(nproc),
                             "test_sleep_bench.py"], cwd=directory, env={**os.environ, "MARKER_DIR": markers},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            # A benchmark started in the background of a shell inherits SIGINT
                            # ignored, and Python then installs no handler: pytest would never see it.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while len(os.listdir(markers)) < nproc and proc.poll() is None:
        time.sleep(0.05)
    start = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    proc.wait()
    os.remove(os.path.join(directory, "test_sleep_bench.py"))
    return time.perf_counter() - start


def run_mp_spawn(directory: str, nproc: int) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "mp_bench.py", str(nproc)], cwd=directory, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - start


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "test_bench.py"), "w") as fh:
            fh.write(TEST_FILE)
        with open(os.path.join(directory, "mp_bench.py"), "w") as fh:
            fh.write(MP_SCRIPT)
        rows = []
        fixed = statistics.median(time_pytest_alone(directory) for _ in range(3))
        for nproc in (2, 4):
            warm_total, warm_tests = run_pytest(directory, nproc, [])
            fresh_total, _ = run_pytest(directory, nproc, ["--dist-fresh-pool", "--dist-start-method", "spawn"])
            mp_total = run_mp_spawn(directory, nproc)
            dispatch_ms = 1000 * statistics.median(warm_tests[1:])
            rows.append((nproc, warm_total, fresh_total, mp_total, dispatch_ms))
        print(f"{N_TESTS} small distributed tests (one all_reduce each), {os.cpu_count()} cores")
        print(f"{'nproc':>5} {'warm pool s':>12} {'spawn/test s':>13} {'mp.spawn/test s':>16} "
              f"{'spawn/warm':>11} {'mp.spawn/warm':>14} {'warm per-test ms':>17} {'spawn/warm less pytest':>23}")
        for nproc, warm, fresh, mp_total, dispatch in rows:
            net = (fresh - fixed) / max(warm - fixed, 1e-3)
            print(f"{nproc:>5} {warm:>12.2f} {fresh:>13.2f} {mp_total:>16.2f} "
                  f"{fresh / warm:>10.1f}x {mp_total / warm:>13.1f}x {dispatch:>17.1f} {net:>22.1f}x")
        print("warm pool totals include pytest start-up and the one-time fork-server start;"
              " per-test ms is the median pytest-measured time of tests 2..20 (dispatch + body + reset)")
        print(f"pytest alone (the same session, every test deselected; both ways pay it): {fixed:.2f} s;"
              " the last column compares what remains")
        for nproc in (2, 4):
            print(f"Ctrl-C with {nproc} ranks inside a test body: pytest exits {time_interrupt(directory, nproc):.2f} s after SIGINT")


if __name__ == "__main__":
    main()
