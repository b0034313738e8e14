"""pytest plugin: ``@pytest.mark.distributed`` tests run on ``--nproc`` real ranks;
``@pytest.mark.simulate`` tests get ``sim_ranks``, N simulated ranks in the pytest process
(``--simulate N`` or the marker's ``nproc``), for ``assert_matches_reference``.

Registered through the ``pytest11`` entry point. Two modes:

* spawn (default): the pytest process keeps warm pools of rank workers
  (``harness.launch.pool``) and ships each distributed test body to them;
* in place (under ``torchrun``: RANK, WORLD_SIZE and LOCAL_RANK set): nothing is spawned; every
  torchrun process runs the distributed tests itself as its rank.

torch is imported only when a distributed test runs, so projects that merely have the
plugin installed pay nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import pytest

from harness import settings
from harness.launch.runners import DistRunner, DistSpec, InPlaceRunner, SpawnRunner, under_torchrun

MARKER = "distributed"
SIM_MARKER = "simulate"
DEFAULT_NPROC = 2
_MARKER_KWARGS = ("nproc", "timeout")
_SPEC_KEY = pytest.StashKey[DistSpec]()
_RUNNER_KEY = pytest.StashKey[DistRunner]()  # the session's runner: spawned ranks, or torchrun in place


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a world size >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a valid world size; it must be >= 1")
    from harness.launch.pool import check_world_size

    try:
        check_world_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _seconds(minimum_allowed: str) -> Any:
    """An argparse type for a finite number of seconds, ``> 0`` or ``>= 0`` (0: off)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        ok = value > 0 if minimum_allowed == "> 0" else value >= 0
        if not (ok and math.isfinite(value)):
            raise argparse.ArgumentTypeError(
                f"{text} s is not allowed; give a finite number of seconds {minimum_allowed}"
                + (" (0: off)" if minimum_allowed == ">= 0" else "")
            )
        return value

    return parse


_positive_float = _seconds("> 0")
_non_negative_float = _seconds(">= 0")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("distributed", "multi-rank tests (parallel-harness)")
    group.addoption(
        "--nproc", type=_positive_int, default=DEFAULT_NPROC, metavar="N",
        help=f"world size for @pytest.mark.distributed tests that do not fix their own (default {DEFAULT_NPROC})",
    )
    group.addoption(
        "--simulate", type=_positive_int, default=None, metavar="N",
        help="world size for @pytest.mark.simulate tests that do not fix their own: N ranks simulated "
             "in the pytest process (DTensor strategies; see README). Without it such tests default to 8",
    )
    group.addoption(
        "--dist-backend", choices=settings.BACKENDS, default="auto",
        help="process-group backend: auto = nccl on CUDA, gloo on CPU (default auto)",
    )
    group.addoption(
        "--dist-device", choices=settings.DEVICES, default="auto",
        help="device per rank: auto = one GPU per rank when CUDA has at least N GPUs, else CPU",
    )
    group.addoption(
        "--dist-timeout", type=_positive_float, default=settings.RUN_TIMEOUT_S, metavar="SECONDS",
        help=f"per-test deadline for distributed tests (default {settings.RUN_TIMEOUT_S:g}); "
        "on expiry each rank's stack and last collectives are reported and the ranks are killed",
    )
    group.addoption(
        "--dist-startup-timeout", type=_positive_float, default=settings.STARTUP_TIMEOUT_S, metavar="SECONDS",
        help=f"deadline for starting ranks and joining the process group (default {settings.STARTUP_TIMEOUT_S:g})",
    )
    group.addoption(
        "--dist-failure-grace", type=_positive_float, default=settings.FAILURE_GRACE_S, metavar="SECONDS",
        help="once one rank failed, how long the others may take to finish before they are "
        f"reported as aborted and killed (default {settings.FAILURE_GRACE_S:g})",
    )
    group.addoption(
        "--dist-stall-window", type=_non_negative_float, default=settings.STALL_WINDOW_S, metavar="S",
        help="a test whose running ranks all make no progress (use no CPU: blocked in a collective, "
             f"sleeping, waiting) for S seconds is reported as hung then, before its deadline; 0: off (default {settings.STALL_WINDOW_S:g})",
    )
    group.addoption(
        "--dist-start-method", choices=settings.START_METHODS, default="forkserver",
        help="how ranks are started: forkserver = forked from one process that imported torch "
        "once (fast restarts); spawn = a fresh interpreter per rank (default forkserver)",
    )
    group.addoption(
        "--dist-fresh-pool", action="store_true", default=False,
        help="start fresh ranks for every test instead of reusing a warm pool (slow; for isolation)",
    )
    group.addoption(
        "--harness-report-dir", default=None, metavar="DIR",
        help="where failing harness checks write HTML diagnosis reports (default: next to --junitxml, else <rootdir>/harness-reports)",
    )


_REPORT_ENV_KEY = pytest.StashKey["str | None"]()
_SIGTERM_KEY = pytest.StashKey[Any]()  # restores SIGTERM's default action


def _report_dir(config: pytest.Config) -> str:
    """Where failing harness checks write their HTML reports: --harness-report-dir, else next
    to --junitxml, else <rootdir>/harness-reports."""
    chosen = config.getoption("harness_report_dir")
    if chosen:
        return os.path.abspath(chosen)
    junit = config.getoption("xmlpath", None)
    if junit:
        return os.path.join(os.path.dirname(os.path.abspath(junit)), "harness-reports")
    return str(config.rootpath / "harness-reports")


def pytest_configure(config: pytest.Config) -> None:
    # Ranks inherit the environment (the fork server starts after this), so checks running on
    # them know where to write reports.
    config.stash[_REPORT_ENV_KEY] = os.environ.get("HARNESS_REPORT_DIR")
    os.environ["HARNESS_REPORT_DIR"] = _report_dir(config)
    config.addinivalue_line(
        "markers",
        f"{MARKER}(nproc=None, timeout=None): run the test body on nproc real ranks "
        "(default --nproc) with the default process group initialised; timeout in seconds "
        "overrides --dist-timeout",
    )
    config.addinivalue_line(
        "markers",
        f"{SIM_MARKER}(nproc=None): the test runs in the pytest process and its sim_ranks fixture is nproc "
        "simulated ranks (default --simulate, else 8) for harness.testing.assert_matches_reference",
    )
    if config.getoption("dist_backend") == "nccl" and config.getoption("dist_device") == "cpu":
        raise pytest.UsageError(
            "--dist-backend nccl needs --dist-device cuda (or auto); gloo is the CPU backend"
        )
    from harness.analysis.failed_run import RunFolderReport

    report_dir = _report_dir(config)
    runner: DistRunner = (InPlaceRunner if under_torchrun() else SpawnRunner)(config, report_dir, RunFolderReport(report_dir))
    config.stash[_RUNNER_KEY] = runner
    # SIGTERM (a CI runner cancelling the job) ends the session as Ctrl-C does: the test's
    # ranks are killed, the session's hooks run, what the test had recorded is named.
    from harness.launch.procs import terminate_as_interrupt

    config.stash[_SIGTERM_KEY] = terminate_as_interrupt()
    if isinstance(runner, SpawnRunner) and _asked_for_ranks(config):
        runner.prestart()


def _asked_for_ranks(config: pytest.Config) -> bool:
    """The session was started with ``--nproc`` (it will run distributed tests) and runs
    tests in this process (not an xdist controller, whose workers start their own ranks)."""
    args = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    named = any(str(a) == "--nproc" or str(a).startswith("--nproc=") for a in args)
    xdist_controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
    return named and not xdist_controller


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    runner = session.config.stash.get(_RUNNER_KEY, None)
    message = runner.interrupted if runner is not None else ""
    if message:
        print("\n" + message, file=sys.stderr, flush=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    restore = config.stash.get(_SIGTERM_KEY, None)
    if restore is not None:
        restore()
    previous = config.stash.get(_REPORT_ENV_KEY, None)
    if previous is None:
        os.environ.pop("HARNESS_REPORT_DIR", None)
    else:
        os.environ["HARNESS_REPORT_DIR"] = previous
    runner = config.stash.get(_RUNNER_KEY, None)
    if runner is not None:
        runner.close()


def _spec_for(item: pytest.Item) -> DistSpec | None:
    """Read and validate the distributed marker; raise a usage message for bad values."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return None
    config = item.config
    where = f"@pytest.mark.{MARKER} on {item.nodeid}"
    if marker.args:
        raise ValueError(f"{where}: positional arguments {marker.args!r} are not allowed; use nproc=N, timeout=S")
    unknown = sorted(set(marker.kwargs) - set(_MARKER_KWARGS))
    if unknown:
        raise ValueError(f"{where}: unknown argument(s) {unknown}; allowed: {list(_MARKER_KWARGS)}")
    nproc = marker.kwargs.get("nproc")
    if nproc is None:
        nproc = config.getoption("nproc")
    elif isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"{where}: nproc={nproc!r} is not allowed; it must be an integer >= 1")
    from harness.launch.pool import check_world_size

    try:
        check_world_size(nproc)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    timeout = marker.kwargs.get("timeout")
    if timeout is None:
        timeout = config.getoption("dist_timeout")
    elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{where}: timeout={timeout!r} is not allowed; give seconds > 0")
    from harness.launch.devices import resolve

    backend, device = resolve(config.getoption("dist_backend"), config.getoption("dist_device"), nproc)
    return DistSpec(nproc=nproc, timeout=float(timeout), backend=backend, device=device)


def pytest_runtest_setup(item: pytest.Item) -> None:
    try:
        spec = _spec_for(item)
    except ValueError as exc:
        problem = str(exc)
    else:
        problem = ""
    if problem:
        pytest.fail(problem, pytrace=False)
    if spec is None:
        return
    item.stash[_SPEC_KEY] = spec
    from harness.launch.devices import cuda_count

    if spec.device == "cuda" and cuda_count() < spec.nproc:
        pytest.skip(f"needs {spec.nproc} CUDA devices (one per rank), found {cuda_count()}")
    item.config.stash[_RUNNER_KEY].setup(item, spec)


@pytest.fixture
def dist_ctx(request: pytest.FixtureRequest) -> Any:
    """This rank's DistContext (rank, world_size, local_rank, device, backend)."""
    spec = request.node.stash.get(_SPEC_KEY, None)
    if spec is None:
        pytest.fail(
            f"{request.node.nodeid} asks for dist_ctx but is not marked @pytest.mark.{MARKER}; "
            "mark it to run on ranks",
            pytrace=False,
        )
    return request.config.stash[_RUNNER_KEY].context(spec)


@pytest.fixture
def sim_ranks(request: pytest.FixtureRequest) -> Any:
    """:class:`harness.simulate.SimulatedRanks` of the test's ``@pytest.mark.simulate(nproc=N)``
    (default ``--simulate``, else 8): pass it to ``assert_matches_reference`` as the context."""
    marker = request.node.get_closest_marker(SIM_MARKER)
    where = f"@pytest.mark.{SIM_MARKER} on {request.node.nodeid}"
    if marker is None:
        pytest.fail(f"{request.node.nodeid} asks for sim_ranks but is not marked @pytest.mark.{SIM_MARKER}", pytrace=False)
    unknown = sorted(set(marker.kwargs) - {"nproc"})
    if marker.args or unknown:
        pytest.fail(f"{where}: only nproc=N is allowed, got {marker.args!r} {unknown}", pytrace=False)
    nproc = marker.kwargs.get("nproc") or request.config.getoption("simulate") or 8
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        pytest.fail(f"{where}: nproc={nproc!r} is not allowed; it must be an integer >= 1", pytrace=False)
    from harness.simulate.run import SimulatedRanks

    return SimulatedRanks(nproc)


@pytest.fixture(scope="session")
def rank_runner(request: pytest.FixtureRequest) -> Any:
    """A :class:`harness.launch.remote.RankRunner` on this session's warm pools, for tests that drive
    ranks from the pytest process (one call per Hypothesis example, no spawn). Not marked
    distributed itself; honours --dist-backend / --dist-device."""
    runner = request.config.stash[_RUNNER_KEY]
    if not isinstance(runner, SpawnRunner):
        pytest.skip("rank_runner drives its own ranks; not available under torchrun")
    from harness.launch.remote import RankRunner

    config = request.config
    return RankRunner(runner.manager, backend=config.getoption("dist_backend"), device=config.getoption("dist_device"))


_NO_GROUP = "Default process group has not been initialized"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A fixture of a distributed test that calls a collective fails in the pytest process,
    with torch's bare message: say where fixtures run and what to do instead."""
    outcome = yield
    report = outcome.get_result()
    if (call.when == "setup" and report.failed and call.excinfo is not None and item.get_closest_marker(MARKER)
            and _NO_GROUP in str(call.excinfo.value) and not under_torchrun()):
        report.longrepr = (
            f"{report.longrepr}\n\nharness: fixtures of a distributed test run once, in the pytest process, "
            "not on the ranks: there is no process group there. Call collectives inside the test body "
            "(or a helper it calls); a fixture may build plain, picklable data that the ranks receive."
        )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = pyfuncitem.stash.get(_SPEC_KEY, None)
    if spec is None:
        return None
    return pyfuncitem.config.stash[_RUNNER_KEY].call(pyfuncitem, spec)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    spec = item.stash.get(_SPEC_KEY, None)
    if spec is not None:
        item.config.stash[_RUNNER_KEY].teardown(item, spec)
