"""Benchmark (not a test): one long pytest session on the warm pool, and what the ranks carry.

Runs one session of 300 distributed tests at ``--nproc 2`` and one of 100 at ``--nproc 4``.
Each test body does what real distributed tests do - a DDP model and a DeviceMesh built, one
training step, a new process group, a collective - and then writes its rank's resident memory
(``VmRSS``), open file descriptors and threads to a log. Printed per session: the first and last
tests' figures per rank, the largest growth over the session against the bound README states,
and the per-test time (pytest's own, from JUnit XML) of the first and last 50 tests.

    python tests/bench/bench_endurance.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict

SESSIONS = ((2, 300), (4, 100))
# What README promises for one session, measured from the tenth test (after the first tests'
# one-time imports and caches) to the last: per rank.
RSS_BOUND_MIB = 32
FD_BOUND = 8

TEST_FILE = '''
import json
import os
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel


def _status(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


@pytest.mark.parametrize("i", range(int(os.environ["BENCH_TESTS"])))
@pytest.mark.distributed
def test_one(dist_ctx, i):
    world = dist_ctx.world_size
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(torch.randn(16, 32)).square().mean()
    loss.backward()
    opt.step()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    group = dist.new_group(list(range(world)))
    t = torch.full((4,), float(i))
    dist.all_reduce(t, group=group)
    dist.all_reduce(t, group=mesh.get_group("dp"))
    assert t[0].item() == i * world * world
    row = {"i": i, "rank": dist_ctx.rank, "rss_kib": _status("VmRSS"), "fds": len(os.listdir("/proc/self/fd")),
           "threads": threading.active_count(), "os_threads": _status("Threads")}
    with open(os.path.join(os.environ["BENCH_LOG"], f"rank{dist_ctx.rank}.jsonl"), "a") as fh:
        fh.write(json.dumps(row) + "\\n")
'''


def run_session(directory: str, nproc: int, tests: int) -> dict:
    log = tempfile.mkdtemp(dir=directory)
    xml = os.path.join(directory, f"report-{nproc}.xml")
    env = {**os.environ, "BENCH_TESTS": str(tests), "BENCH_LOG": log}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nproc", str(nproc),
                    f"--junitxml={xml}", "test_endurance.py"], cwd=directory, env=env, check=True, stdout=subprocess.DEVNULL)
    total = time.perf_counter() - start
    per_test = [float(case.get("time", 0)) for case in ET.parse(xml).iter("testcase")]
    rows: dict[int, list[dict]] = defaultdict(list)
    for name in os.listdir(log):
        with open(os.path.join(log, name)) as fh:
            for line in fh:
                row = json.loads(line)
                rows[row["rank"]].append(row)
    return {"total": total, "per_test": per_test, "rows": {r: sorted(v, key=lambda x: x["i"]) for r, v in rows.items()}}


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "test_endurance.py"), "w") as fh:
            fh.write(TEST_FILE)
        print(f"endurance: one pytest session per row on the warm pool, {os.cpu_count()} cores")
        print(f"bound per rank from test 10 to the last: RSS +{RSS_BOUND_MIB} MiB, open fds +{FD_BOUND}")
        for nproc, tests in SESSIONS:
            result = run_session(directory, nproc, tests)
            per = result["per_test"]
            head, tail = statistics.median(per[1:51]), statistics.median(per[-50:])
            print(f"\n--nproc {nproc}, {tests} tests: {result['total']:.1f} s in all; per test (median) "
                  f"tests 2-51 {1000 * head:.0f} ms, last 50 {1000 * tail:.0f} ms (ratio {tail / head:.2f})")
            print(f"  {'rank':>4} {'RSS t10 MiB':>12} {'RSS last':>9} {'RSS max':>8} {'growth':>7} "
                  f"{'fds t10':>8} {'fds last':>9} {'fds max':>8} {'threads t10/last':>17}  within bound")
            for rank, rows in sorted(result["rows"].items()):
                ten, last = rows[min(9, len(rows) - 1)], rows[-1]
                rss_growth = (max(r["rss_kib"] for r in rows[9:]) - ten["rss_kib"]) / 1024
                fd_growth = max(r["fds"] for r in rows[9:]) - ten["fds"]
                ok = rss_growth <= RSS_BOUND_MIB and fd_growth <= FD_BOUND
                print(f"  {rank:>4} {ten['rss_kib'] / 1024:>12.1f} {last['rss_kib'] / 1024:>9.1f} "
                      f"{max(r['rss_kib'] for r in rows) / 1024:>8.1f} {rss_growth:>+7.1f} {ten['fds']:>8} {last['fds']:>9} "
                      f"{max(r['fds'] for r in rows):>8} {ten['os_threads']:>8}/{last['os_threads']:<8}  {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
