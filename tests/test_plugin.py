"""The pytest plugin on real gloo ranks, driven through pytester in fresh pytest processes.

Each scenario is a small test file run by a child pytest; we assert on its outcomes and on
the report text a user would read. Child runs carry a unique marker in their environment so
that leftover rank processes can be found afterwards.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests._procs import processes_with_env

CHILD_DEADLINE = 240  # a hung child session fails this test instead of hanging CI

PASSING = """
import os
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


@pytest.mark.distributed
def test_sum(dist_ctx):
    t = torch.ones(1) * dist_ctx.rank
    dist.all_reduce(t)
    assert t.item() == sum(range(dist_ctx.world_size))
    assert dist_ctx.world_size == dist.get_world_size() == int(os.environ["EXPECT_WORLD"])
    assert dist_ctx.backend == "gloo" and str(dist_ctx.device) == "cpu"


@pytest.mark.distributed(nproc=4)
def test_mesh(dist_ctx):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert mesh["tp"].size() == 2 and dist.get_world_size() == 4


class Payload:
    def __init__(self, value):
        self.value = value


@pytest.fixture
def payload():
    return Payload(41)


@pytest.mark.parametrize("x", [1, 2])
@pytest.mark.distributed
def test_fixtures_reach_ranks(dist_ctx, x, payload, tmp_path):
    (tmp_path / f"rank{dist_ctx.rank}").write_text(str(x + payload.value))
    dist.barrier()
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == [str(x + 41)] * dist_ctx.world_size


class TestMethods:
    @classmethod
    def setup_class(cls):
        cls.base = 10

    @pytest.fixture(autouse=True)
    def _offset(self, request):
        request.cls.offset = 5

    def setup_method(self, method):
        self.scale = 3
        self.where = method.__name__

    @pytest.mark.distributed
    def test_method(self, dist_ctx):
        t = torch.ones(1)
        dist.all_reduce(t)
        # What pytest set up for the method reaches every rank's instance.
        assert (self.scale, self.base, self.offset, self.where) == (3, 10, 5, "test_method")
        assert t.item() * self.scale == 3 * dist_ctx.world_size


@pytest.mark.distributed
def test_leaks_state(dist_ctx):
    import resource
    import warnings

    assert torch.get_num_threads() == 1  # OMP_NUM_THREADS=1 holds in forked ranks too
    os.environ["LEAKED_BY_TEST"] = "1"
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(1000 + dist_ctx.rank)
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=group)
    torch.set_default_device("meta")
    torch.set_float32_matmul_precision("medium")
    torch.set_anomaly_enabled(True)
    warnings.simplefilter("error")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))


@pytest.mark.distributed
def test_state_was_reset(dist_ctx):
    import resource
    import warnings

    assert torch.ones(1).device.type == "cpu"
    assert torch.get_float32_matmul_precision() == "highest" and not torch.is_anomaly_enabled()
    assert not any(f[0] == "error" and f[2] is Warning for f in warnings.filters)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 256
    assert "LEAKED_BY_TEST" not in os.environ
    assert not torch.are_deterministic_algorithms_enabled()
    assert len(c10d._world.pg_map) == 1  # only the default group is left
    draws = [torch.zeros(1) for _ in range(dist_ctx.world_size)]
    dist.all_gather(draws, torch.rand(1))
    assert all(torch.equal(draws[0], d) for d in draws)  # same seed on every rank


def test_plain_tests_still_run_in_the_pytest_process():
    assert "RANK" not in os.environ or os.environ.get("LOCAL_RANK") is not None
"""


def _child_env(monkeypatch: pytest.MonkeyPatch) -> str:
    tag = f"HARNESS_TEST_TAG={uuid.uuid4().hex}"
    key, value = tag.split("=")
    monkeypatch.setenv(key, value)
    return tag


def _assert_no_leftovers(tag: str) -> None:
    deadline = time.monotonic() + 10
    while processes_with_env(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_env(tag) == [], "rank processes outlived the pytest session"


# nproc 4 repeats nproc 2's checks at twice the ranks; 4-rank runs stay in the default suite
# through the fault matrix and the 2-D strategies.
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_passing_tests_at_nproc(pytester, monkeypatch, nproc):
    tag = _child_env(monkeypatch)
    monkeypatch.setenv("EXPECT_WORLD", str(nproc))
    pytester.makepyfile(test_passing=PASSING)
    result = pytester.runpytest_subprocess("--nproc", str(nproc), "-p", "no:cacheprovider", timeout=CHILD_DEADLINE)
    result.assert_outcomes(passed=8)
    _assert_no_leftovers(tag)


FAILING = """
import os
import signal
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed
def test_rank1_asserts(dist_ctx):
    values = [1, 2, 3]
    if dist_ctx.rank == 1:
        assert values == [1, 2, 4]
    dist.barrier()


@pytest.mark.distributed
def test_segfault(dist_ctx):
    if dist_ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


@pytest.mark.distributed
def test_exit_code(dist_ctx):
    if dist_ctx.rank == 0:
        os._exit(7)
    dist.barrier()


@pytest.mark.distributed(timeout=6)
def test_mismatched_collectives(dist_ctx):
    t = torch.ones(1)
    if dist_ctx.rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, 0)
    dist.barrier()


@pytest.mark.distributed(timeout=6)
def test_rank_skips_collective(dist_ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist_ctx.rank == 0:
        dist.all_reduce(t)


@pytest.mark.distributed
def test_next_test_runs_on_a_fresh_pool(dist_ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist_ctx.world_size


@pytest.mark.distributed
def test_skipped_on_ranks(dist_ctx):
    pytest.skip("not on this machine")
"""


def _section(text: str, title: str) -> str:
    """The failure section of one test in pytest's output."""
    start = text.index(f" {title} ")
    end = text.find("\n_____", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_failures_crashes_and_hangs_are_reported_per_rank(pytester, monkeypatch):
    tag = _child_env(monkeypatch)
    pytester.makepyfile(test_failing=FAILING)
    result = pytester.runpytest_subprocess("--nproc", "2", "-p", "no:cacheprovider", "-rA", timeout=CHILD_DEADLINE)
    result.assert_outcomes(passed=1, failed=5, skipped=1)
    out = result.stdout.str()

    asserted = _section(out, "test_rank1_asserts")
    assert asserted.index("rank 1 failed first, of 2 ranks") < asserted.index("other ranks:")
    assert "assert [1, 2, 3] == [1, 2, 4]" in asserted  # pytest's assertion rewriting on the rank
    assert "test_failing.py:12: AssertionError" in asserted
    assert "harness" not in asserted.split("other ranks:")[0]  # starts at the test body
    assert "rank 0: aborted while waiting: in barrier" in asserted

    segv = _section(out, "test_segfault")
    assert "rank 1 died first (killed by signal 11 (SIGSEGV)), of 2 ranks" in segv
    assert "Fatal Python error: Segmentation fault" in segv  # the rank's own last words
    assert "rank 0: " in segv

    exited = _section(out, "test_exit_code")
    assert "rank 0 died first (exit code 7: the test body called os._exit(7) at " in exited  # the line that exited
    assert re.search(r"test_failing\.py:\d+ in test_exit_code\), of 2 ranks", exited), exited

    hang = _section(out, "test_mismatched_collectives")
    assert "TIMEOUT: the test did not finish on all 2 ranks within 6 s" in hang
    assert "rank 0: in all_reduce" in hang and "test_failing.py:34 in test_mismatched_collectives" in hang
    assert "rank 1: in broadcast" in hang and "test_failing.py:36 in test_mismatched_collectives" in hang
    assert "---- rank 0 Python stack ----" in hang and "---- rank 1 Python stack ----" in hang
    assert "all_reduce #" in hang and "broadcast #" in hang  # last collectives of each rank

    skipped = _section(out, "test_rank_skips_collective")
    assert "rank 0: in all_reduce" in skipped and "test_failing.py:45" in skipped
    assert "rank 1: passed, finished its test body; its last collective was all_reduce" in skipped

    assert "SKIPPED [1] test_failing.py:" in out and "not on this machine" in out
    _assert_no_leftovers(tag)


BAD_INPUT = """
import os
import threading
import pytest
import torch.distributed as dist

if os.environ.get("HARNESS_WORKER"):
    raise ImportError("this module only imports in the pytest process")


@pytest.mark.distributed(nproc=0)
def test_bad_nproc(dist_ctx):
    pass


@pytest.mark.distributed(timeout=-1)
def test_bad_timeout(dist_ctx):
    pass


@pytest.mark.distributed(nproc=10000)
def test_too_many_ranks(dist_ctx):
    pass


@pytest.mark.distributed(nprocs=2)
def test_misspelt_argument(dist_ctx):
    pass


def test_ctx_without_marker(dist_ctx):
    pass


@pytest.fixture
def lock():
    return threading.Lock()


@pytest.mark.distributed
def test_unpicklable_fixture(dist_ctx, lock):
    pass


@pytest.mark.distributed
def test_body_not_importable_on_ranks(dist_ctx):
    pass


class TestLockedState:
    def setup_method(self, method):
        self.lock = threading.Lock()

    @pytest.mark.distributed
    def test_method_with_unpicklable_state(self, dist_ctx):
        pass
"""


def test_bad_markers_and_bodies_get_clear_errors(pytester, monkeypatch):
    tag = _child_env(monkeypatch)
    pytester.makepyfile(test_bad=BAD_INPUT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=CHILD_DEADLINE)
    result.assert_outcomes(errors=5, failed=3)
    out = result.stdout.str()
    assert "nproc=0 is not allowed; it must be an integer >= 1" in out
    # Refused before any rank forks, with the bound's arithmetic and the override.
    assert "10000 ranks exceed this machine's bound of" in out and "set HARNESS_MAX_RANKS=N to allow more" in out
    assert "timeout=-1 is not allowed; give seconds > 0" in out
    assert "unknown argument(s) ['nprocs']; allowed: ['nproc', 'timeout']" in out
    assert "asks for dist_ctx but is not marked @pytest.mark.distributed" in out
    assert "fixture or parameter 'lock' (a lock) cannot be sent to the ranks" in out
    assert "could not load the test body test_body_not_importable_on_ranks" in out
    assert "ImportError: this module only imports in the pytest process" in out
    assert "self.lock (a lock), set up for test_bad.py::TestLockedState::test_method_with_unpicklable_state in the pytest " \
           "process, cannot be sent to the ranks" in out
    _assert_no_leftovers(tag)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "0"], "argument --nproc: 0 is not a valid world size; it must be >= 1"),
        (["--nproc", "abc"], "argument --nproc: 'abc' is not an integer; give a world size >= 1"),
        (["--dist-timeout", "-5"], "argument --dist-timeout: -5 s is not allowed"),
        (["--dist-timeout", "nan"], "argument --dist-timeout: nan s is not allowed"),
        (["--nproc", "10000"], "argument --nproc: 10000 ranks exceed this machine's bound of"),
        (["--dist-backend", "nccl", "--dist-device", "cpu"], "--dist-backend nccl needs --dist-device cuda"),
    ],
)
def test_bad_options_are_usage_errors(pytester, args, message):
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess(*args, timeout=CHILD_DEADLINE)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


def test_more_gpus_than_exist_is_a_skip(pytester):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the skip path is for machines short of GPUs")
    pytester.makepyfile(test_gpu="import pytest\n\n@pytest.mark.distributed\ndef test_x(dist_ctx):\n    pass\n")
    result = pytester.runpytest("--dist-device", "cuda", "-rs")  # in process: no rank ever starts
    result.assert_outcomes(skipped=1)
    assert "needs 2 CUDA devices (one per rank), found 0" in result.stdout.str()


XDIST = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.parametrize("i", range(6))
@pytest.mark.distributed
def test_allreduce(dist_ctx, i):
    t = torch.full((4,), float(i + dist_ctx.rank))
    dist.all_reduce(t)
    assert t[0].item() == dist_ctx.world_size * i + sum(range(dist_ctx.world_size))
"""


def test_under_xdist(pytester, monkeypatch):
    tag = _child_env(monkeypatch)
    pytester.makepyfile(test_xdist=XDIST)
    result = pytester.runpytest_subprocess("-n", "2", "--nproc", "2", "-p", "no:cacheprovider", timeout=CHILD_DEADLINE)
    result.assert_outcomes(passed=6)
    _assert_no_leftovers(tag)


HANG_FOREVER = """
import os
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed
def test_hangs(dist_ctx):
    open(os.path.join(os.environ["STARTED_DIR"], f"rank{dist_ctx.rank}"), "w").close()
    if dist_ctx.rank == 0:
        dist.all_reduce(torch.ones(1))
"""


# Both signals reach the same handler (terminate_as_interrupt); the default suite sends SIGTERM.
@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_and_sigterm_leave_no_rank_behind(pytester, monkeypatch, signum):
    """Ctrl-C, or SIGTERM (a CI runner cancelling the job), mid-test: the session ends at
    once as interrupted, and no rank outlives it."""
    tag = _child_env(monkeypatch)
    started = pytester.mkdir("started")
    monkeypatch.setenv("STARTED_DIR", str(started))
    path = pytester.makepyfile(test_hang=HANG_FOREVER)
    child = subprocess.Popen(
        # Stall detection off: rank 0 blocks for good once rank 1 is done, and on a loaded
        # machine the stall verdict (a failed test, exit 1) could come before the Ctrl-C.
        [sys.executable, "-m", "pytest", str(path), "-p", "no:cacheprovider", "--dist-stall-window", "0"],
        cwd=str(pytester.path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # A suite started from a background job (`cmd &` in a CI script) ignores SIGINT, and
        # its children inherit that: give the child the default, as a terminal's pytest has.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + CHILD_DEADLINE
        while len(list(started.iterdir())) < 2 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.1)  # until both ranks are inside the test body
        assert len(list(started.iterdir())) == 2
        assert processes_with_env(tag), "the ranks should be running now"
        child.send_signal(signum)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == pytest.ExitCode.INTERRUPTED
    _assert_no_leftovers(tag)


TORCHRUN = """
import os
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed
def test_in_place(dist_ctx):
    assert dist_ctx.rank == int(os.environ["RANK"])
    assert "HARNESS_WORKER" not in os.environ  # nothing was spawned: we are the torchrun rank
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


@pytest.mark.distributed(nproc=4)
def test_needs_four(dist_ctx):
    pass
"""


def test_under_torchrun_runs_in_place(pytester, monkeypatch):
    tag = _child_env(monkeypatch)
    path = pytester.makepyfile(test_torchrun=TORCHRUN)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "pytest", str(path), "-p", "no:cacheprovider", "-rs",
        ],
        cwd=str(pytester.path),
        capture_output=True,
        text=True,
        timeout=CHILD_DEADLINE,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("1 passed, 1 skipped") == 2, out  # one pytest session per torchrun rank
    assert "needs nproc=4 ranks but torchrun started WORLD_SIZE=2" in out
    _assert_no_leftovers(tag)


def test_plugin_is_registered_by_entry_point(pytester):
    result = pytester.runpytest_subprocess("--help")
    text = result.stdout.str()
    for option in ("--nproc=N", "--dist-backend", "--dist-device", "--dist-timeout", "--dist-fresh-pool"):
        assert option in text
    assert "distributed(nproc=None, timeout=None)" in pytester.runpytest_subprocess("--markers").stdout.str()


STALLS = """
import time
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(nproc=2, timeout=120)
def test_rank1_skips_the_barrier(dist_ctx):
    if dist_ctx.rank == 0:
        dist.barrier()


@pytest.mark.distributed(nproc=2, timeout=120)
def test_slow_but_computing(dist_ctx):
    end = time.monotonic() + 4  # twice the stall window, busy all along
    x = torch.randn(64, 64)
    while time.monotonic() < end:
        x = torch.tanh(x @ x)
    dist.barrier()
"""


def test_a_stall_is_named_in_seconds_and_a_slow_run_is_not(pytester, monkeypatch):
    """Every running rank without progress (no CPU: blocked in a collective) for the stall window
    is a hang, reported then - not at the 120 s deadline; ranks that compute for longer than the
    window are never called hung."""
    tag = _child_env(monkeypatch)
    pytester.makepyfile(test_stalls=STALLS)
    result = pytester.runpytest_subprocess("--dist-stall-window", "2", "-p", "no:cacheprovider", "-rA", timeout=CHILD_DEADLINE)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    hung = _section(out, "test_rank1_skips_the_barrier")
    assert "HANG: no rank still running made progress for 2 s" in hung and "before its 120 s deadline" in hung
    assert "rank 0: in barrier" in hung
    _assert_no_leftovers(tag)


ORPHANS = """
import os
import subprocess
import sys
import pytest
import torch.distributed as dist


def _sleeper():
    # Its own session: outside the rank's process group, and re-parented when the rank dies.
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)


@pytest.mark.distributed
def test_leaves_a_sleeper_and_passes(dist_ctx):
    _sleeper()
    dist.barrier()


@pytest.mark.distributed
def test_leaves_a_sleeper_and_crashes(dist_ctx):
    _sleeper()
    dist.barrier()
    if dist_ctx.rank == 1:
        os._exit(3)
    dist.barrier()
"""


# spawn (the non-default start method) under -m slow: the subreaper and the tag sweep are the
# same code for both.
@pytest.mark.parametrize("start_method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
def test_no_descendant_of_a_rank_outlives_the_session(pytester, monkeypatch, start_method):
    """Processes a test body starts in their own session (after a pass, and after its rank
    crashed) are killed with the pool: the fork server reaps the orphans of crashed ranks, and
    every process the ranks start carries the pool's tag, swept when the pool closes."""
    tag = _child_env(monkeypatch)
    pytester.makepyfile(test_orphans=ORPHANS)
    result = pytester.runpytest_subprocess("--nproc", "2", "-p", "no:cacheprovider", "--dist-start-method", start_method,
                                           timeout=CHILD_DEADLINE)
    result.assert_outcomes(passed=1, failed=1)
    _assert_no_leftovers(tag)


CLARITY = """
import os
import signal
import threading
import pytest
import torch
import torch.distributed as dist

if os.environ.get("HARNESS_WORKER"):
    from no_such_module_on_ranks import thing  # noqa: F401  (imports only in the pytest process)


@pytest.mark.distributed
def test_not_importable_on_ranks(dist_ctx):
    pass
"""

CLARITY_RANKS = """
import os
import signal
import threading
import time
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed
def test_returns_a_lock(dist_ctx):
    return threading.Lock()


@pytest.mark.distributed
def test_kills_the_fork_server(dist_ctx):
    dist.barrier()
    if dist_ctx.rank == 0:
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)  # the kernel ends the ranks once the fork server is gone
    dist.barrier()


@pytest.fixture
def summed():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t


@pytest.mark.distributed
def test_fixture_calls_a_collective(dist_ctx, summed):
    pass


@pytest.mark.distributed
def test_after_the_fork_server_died(dist_ctx):
    dist.barrier()
"""


def test_failure_reports_lead_with_the_cause(pytester, monkeypatch):
    """What the harness could not do leads its report, in its words: no worker source before
    a load failure or an unpicklable return value; a fork server killed from a rank is named
    as the cause of the ranks' deaths (and the next test gets a new one); a fixture calling a
    collective is told that fixtures run in the pytest process."""
    tag = _child_env(monkeypatch)
    pytester.makepyfile(test_clarity=CLARITY, test_clarity_ranks=CLARITY_RANKS)
    result = pytester.runpytest_subprocess("--nproc", "2", "-p", "no:cacheprovider", timeout=CHILD_DEADLINE)
    result.assert_outcomes(passed=1, failed=3, errors=1)
    out = result.stdout.str()

    load = _section(out, "test_not_importable_on_ranks")
    assert "RankSetupError: rank 1 could not load the test body test_not_importable_on_ranks" in load or \
        "RankSetupError: rank 0 could not load the test body test_not_importable_on_ranks" in load, load
    assert "worker.py" not in load and "ModuleNotFoundError: No module named 'no_such_module_on_ranks'" in load
    assert "test_clarity.py" in load.split("where it was raised:")[1]  # the user's frame, not ours

    returned = _section(out, "test_returns_a_lock")
    assert "returned a lock that cannot be pickled back to the launcher" in returned and "worker.py" not in returned

    killed = _section(out, "test_kills_the_fork_server")
    assert "the rank fork server (pid " in killed and "died during the test (killed by signal 9 (SIGKILL))" in killed
    assert killed.index("the rank fork server") < killed.index("died first")

    fixture = _section(out, "test_fixture_calls_a_collective")
    assert "Default process group has not been initialized" in fixture
    assert "fixtures of a distributed test run once, in the pytest process, not on the ranks" in fixture
    _assert_no_leftovers(tag)



PRESTART = """
from harness.pytest_plugin import _RUNNER_KEY


def test_fork_server_started_at_configure(request):
    manager = request.config.stash[_RUNNER_KEY]._manager
    started = manager is not None and manager.zygote is not None
    assert started == (request.config.getoption("nproc") == 3)
"""


@pytest.mark.parametrize("args", [["--nproc", "3"], []])
def test_the_fork_server_starts_at_configure_only_when_ranks_are_asked_for(pytester, monkeypatch, args):
    """With --nproc on the command line the fork server starts before collection (its torch
    import overlaps it); a session that never names --nproc starts none until a distributed
    test needs one."""
    tag = _child_env(monkeypatch)
    pytester.makepyfile(test_prestart=PRESTART)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=CHILD_DEADLINE)
    result.assert_outcomes(passed=1)
    _assert_no_leftovers(tag)


PYTEST_TIMEOUT = """
import os
import time
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed
def test_warms_the_pool(dist_ctx):
    dist.barrier()


@pytest.mark.timeout(4, method=os.environ["TIMEOUT_METHOD"])
@pytest.mark.distributed(timeout=120)
def test_outlives_its_timeout(dist_ctx):
    open(os.path.join(os.environ["LATE_DIR"], f"started{dist_ctx.rank}"), "w").close()
    time.sleep(12)  # long past pytest-timeout's 4 s
    open(os.path.join(os.environ["LATE_DIR"], f"finished{dist_ctx.rank}"), "w").close()


@pytest.mark.distributed
def test_next_gets_its_own_result(dist_ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist_ctx.world_size
"""


# The thread method ends the whole session (the simpler case); the default suite keeps signal's.
@pytest.mark.parametrize("method", ["signal", pytest.param("thread", marks=pytest.mark.slow)])
def test_pytest_timeout_leaves_no_pool_running_the_old_body(pytester, monkeypatch, method):
    """pytest-timeout fails a distributed test from the pytest process. signal: the harness
    kills the ranks running that body (they never finish it), and the next test runs on a
    fresh pool with its own result. thread: pytest-timeout ends the whole session, and the
    ranks go with it."""
    pytest.importorskip("pytest_timeout")
    tag = _child_env(monkeypatch)
    late = pytester.mkdir("late")
    monkeypatch.setenv("LATE_DIR", str(late))
    monkeypatch.setenv("TIMEOUT_METHOD", method)
    pytester.makepyfile(test_timeouts=PYTEST_TIMEOUT)
    result = pytester.runpytest_subprocess("--nproc", "2", "-p", "no:cacheprovider", timeout=CHILD_DEADLINE)
    out = result.stdout.str() + result.stderr.str()
    assert "Timeout" in out, out
    if method == "signal":
        result.assert_outcomes(failed=1, passed=2)
    else:
        assert result.ret != 0
    _assert_no_leftovers(tag)
    assert sorted(p.name for p in late.iterdir()) == ["started0", "started1"]  # the body was running
    started_at = max(p.stat().st_mtime for p in late.iterdir())
    time.sleep(max(0.0, started_at + 13 - time.time()))  # past when the old body would have finished, had its ranks lived
    assert sorted(p.name for p in late.iterdir()) == ["started0", "started1"], "a rank went on with the timed-out body"


SELECTION = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed
def test_alpha(dist_ctx):
    dist.barrier()


@pytest.mark.distributed
def test_beta(dist_ctx):
    assert dist_ctx.rank == 0, "beta fails on rank 1"


@pytest.mark.distributed
def test_gamma(dist_ctx):
    dist.barrier()


@pytest.mark.parametrize("i", range(3))
@pytest.mark.distributed
def test_repeat(dist_ctx, i):
    t = torch.full((1,), float(i))
    dist.all_reduce(t)
    assert t.item() == i * dist_ctx.world_size
"""


def test_x_lf_k_and_repeats_select_as_without_the_harness(pytester, monkeypatch):
    """-x stops at the first failure, --lf reruns only it, -k selects, a test repeated by
    parametrize runs each time with its own result; no rank outlives any of the sessions."""
    tag = _child_env(monkeypatch)
    pytester.makepyfile(test_select=SELECTION)
    stop = pytester.runpytest_subprocess("--nproc", "2", "-x", timeout=CHILD_DEADLINE)
    stop.assert_outcomes(passed=1, failed=1)
    assert "beta fails on rank 1" in stop.stdout.str()
    _assert_no_leftovers(tag)
    last = pytester.runpytest_subprocess("--nproc", "2", "--lf", timeout=CHILD_DEADLINE)
    last.assert_outcomes(failed=1)
    assert "rerun previous 1 failure" in last.stdout.str()
    _assert_no_leftovers(tag)
    chosen = pytester.runpytest_subprocess("--nproc", "2", "-k", "repeat or gamma", "-p", "no:cacheprovider", timeout=CHILD_DEADLINE)
    chosen.assert_outcomes(passed=4, deselected=2)
    _assert_no_leftovers(tag)
