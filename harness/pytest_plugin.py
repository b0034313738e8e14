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
import pickle
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import pytest

MARKER = "distributed"
SIM_MARKER = "simulate"
DEFAULT_NPROC = 2
DEFAULT_TIMEOUT = 120.0
_MARKER_KWARGS = ("nproc", "timeout")
_SPEC_KEY = pytest.StashKey["DistSpec"]()


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
        "--dist-backend", choices=("auto", "gloo", "nccl"), default="auto",
        help="process-group backend: auto = nccl on CUDA, gloo on CPU (default auto)",
    )
    group.addoption(
        "--dist-device", choices=("auto", "cpu", "cuda"), default="auto",
        help="device per rank: auto = one GPU per rank when CUDA has at least N GPUs, else CPU",
    )
    group.addoption(
        "--dist-timeout", type=_positive_float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
        help=f"per-test deadline for distributed tests (default {DEFAULT_TIMEOUT:g}); "
        "on expiry each rank's stack and last collectives are reported and the ranks are killed",
    )
    group.addoption(
        "--dist-startup-timeout", type=_positive_float, default=90.0, metavar="SECONDS",
        help="deadline for starting ranks and joining the process group (default 90)",
    )
    group.addoption(
        "--dist-failure-grace", type=_positive_float, default=3.0, metavar="SECONDS",
        help="once one rank failed, how long the others may take to finish before they are "
        "reported as aborted and killed (default 3)",
    )
    group.addoption(
        "--dist-stall-window", type=_non_negative_float, default=10.0, metavar="S",
        help="a test whose running ranks all make no progress (use no CPU: blocked in a collective, "
             "sleeping, waiting) for S seconds is reported as hung then, before its deadline; 0: off (default 10)",
    )
    group.addoption(
        "--dist-start-method", choices=("forkserver", "spawn"), default="forkserver",
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
_INTERRUPTED_KEY = pytest.StashKey[str]()  # what an interrupted test had recorded


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
    runner = InPlaceRunner(config) if _under_torchrun() else SpawnRunner(config)
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
    message = session.config.stash.get(_INTERRUPTED_KEY, "")
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


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) and not os.environ.get(
        "HARNESS_WORKER"
    )


@dataclass(frozen=True)
class DistSpec:
    nproc: int
    timeout: float
    backend: str
    device: str


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
            and _NO_GROUP in str(call.excinfo.value) and not _under_torchrun()):
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


# -- spawn mode ------------------------------------------------------------------------------
class _RankContextPlaceholder:
    """Stands for dist_ctx in the pytest process; each rank substitutes its own context."""

    def __repr__(self) -> str:
        return "<dist_ctx: filled in on each rank>"


class SpawnRunner:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._manager: Any = None

    @property
    def manager(self) -> Any:
        if self._manager is None:
            from harness.launch.pool import PoolConfig, PoolManager

            self._manager = PoolManager(
                PoolConfig(
                    startup_timeout=self.config.getoption("dist_startup_timeout"),
                    failure_grace=self.config.getoption("dist_failure_grace"),
                    stall_window=self.config.getoption("dist_stall_window"),
                ),
                fresh_per_test=self.config.getoption("dist_fresh_pool"),
                start_method=self.config.getoption("dist_start_method"),
            )
        return self._manager

    def prestart(self) -> None:
        """Start the rank fork server now, so its torch import overlaps collection."""
        try:
            self.manager.start_fork_server()
        except Exception:  # noqa: BLE001 - the first distributed test starts it and reports why
            pass

    def setup(self, item: pytest.Item, spec: DistSpec) -> None:
        pass

    def context(self, spec: DistSpec) -> Any:
        return _RankContextPlaceholder()

    def call(self, item: pytest.Function, spec: DistSpec) -> bool:
        from harness.launch.pool import PoolKey, PoolStartError
        from harness.launch.protocol import TestTask

        if item.cls is not None:
            qualname = f"{item.cls.__qualname__}.{item.originalname}"
        else:
            qualname = getattr(item.obj, "__qualname__", item.originalname)
        argnames = item._fixtureinfo.argnames
        ctx_names = tuple(n for n in argnames if isinstance(item.funcargs[n], _RankContextPlaceholder))
        kwargs = {n: item.funcargs[n] for n in argnames if n not in ctx_names}
        for name, value in kwargs.items():
            try:
                pickle.dumps(value)
            except Exception as exc:  # noqa: BLE001
                pytest.fail(
                    f"fixture or parameter {name!r} (a {type(value).__name__}) cannot be sent to "
                    f"the ranks: {type(exc).__name__}: {exc}. Distributed test bodies receive "
                    "only picklable values; build what you need inside the body, or return "
                    "plain data from the fixture.",
                    pytrace=False,
                )
        state_pickle = _method_state(item)
        run_dir = tempfile.mkdtemp(prefix="harness-test-")
        task = TestTask(
            nodeid=item.nodeid,
            module_name=item.module.__name__,
            module_file=str(item.path),
            qualname=qualname,
            kwargs_pickle=pickle.dumps(kwargs),
            ctx_argnames=ctx_names,
            sys_path=list(sys.path),
            cwd=os.getcwd(),
            run_dir=run_dir,
            state_pickle=state_pickle,
        )
        key = PoolKey(spec.nproc, spec.backend, spec.device)
        try:
            outcome = self.manager.run(key, task, spec.timeout)
        except KeyboardInterrupt:
            # Ctrl-C / SIGTERM: the pool killed the ranks; name what the test had recorded.
            from harness.record.left_behind import left_behind, recorded_lines

            left = recorded_lines(left_behind(run_dir)[2])
            if left:
                item.config.stash[_INTERRUPTED_KEY] = f"harness: {item.nodeid} was interrupted; kept{left}"
            else:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        except PoolStartError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            pytest.fail(f"could not start {spec.nproc} {spec.backend} ranks: {exc}", pytrace=False)
        for rank in sorted(outcome.results):
            text = outcome.results[rank].stdout
            if text:
                item.add_report_section("call", f"output rank {rank}", text)
        if outcome.failed:
            from harness.launch.failure_text import format_failure

            text = format_failure(outcome)
            pytest.fail(text + _left_behind_lines(run_dir, item.nodeid, text, outcome), pytrace=False)
        shutil.rmtree(run_dir, ignore_errors=True)
        if outcome.all_skipped:
            raise pytest.skip.Exception(outcome.results[0].message, _use_item_location=True)
        return True

    def teardown(self, item: pytest.Item, spec: DistSpec) -> None:
        pass

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()


def _method_state(item: pytest.Item) -> bytes:
    """A test method's instance and class state as pytest's setup left them (setup_method,
    setup_class, fixtures that set ``self.x`` / ``request.cls.x``), pickled for the ranks,
    which build their own instance; b"" for a test function. State that cannot be pickled
    fails the test saying which attribute, rather than reaching the body as missing."""
    instance, cls = getattr(item, "instance", None), getattr(item, "cls", None)
    if instance is None or cls is None:
        return b""
    classy = (classmethod, staticmethod, property)
    state: dict[str, dict[str, Any]] = {
        "instance": dict(vars(instance)),
        # Plain class attributes (what setup_class or a class fixture may have set); methods and
        # descriptors come from the rank's own import of the class.
        "class": {n: v for n, v in vars(cls).items() if not n.startswith("__") and not callable(v) and not isinstance(v, classy)},
    }
    for name, value in list(state["class"].items()):
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - the rank's import of the class has its own
            del state["class"][name]
    try:
        return pickle.dumps(state)
    except Exception:  # noqa: BLE001 - find the attribute that cannot travel, and say so
        for name, value in vars(instance).items():
            try:
                pickle.dumps(value)
            except Exception as exc:  # noqa: BLE001
                pytest.fail(
                    f"self.{name} (a {type(value).__name__}), set up for {item.nodeid} in the pytest process, cannot be sent "
                    f"to the ranks: {type(exc).__name__}: {exc}. A distributed test method's instance state must be "
                    "picklable; build it inside the body instead.",
                    pytrace=False,
                )
        raise


def _left_behind_lines(run_dir: str, nodeid: str, text: str, outcome: Any) -> str:
    """A test that failed or hung inside ``assert_matches_reference`` (which records in the
    test's run folder): the HTML report built from what it recorded before the failure, and
    the folders that hold it. The folder is kept; empty when the test recorded nothing."""
    from harness.record.left_behind import failure_report
    from harness.report import write_html
    from harness.targets.drive import failure_diagnoses, hang_diagnoses
    from harness.testing import report_path_for

    hang = bool(outcome.timed_out)
    try:
        diagnoses = hang_diagnoses(outcome) if hang else failure_diagnoses(outcome)
        report = failure_report(run_dir, name=nodeid, error=text, hang=hang, diagnoses=diagnoses, outcome=outcome)
    except Exception as exc:  # noqa: BLE001 - the failure itself must still be reported
        return f"\n\n(could not build a report from {run_dir}: {type(exc).__name__}: {exc})"
    if report is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        return ""
    recorded = report.recorded
    if recorded.get("records") and all(r["complete"] and r["path"] in text for r in recorded["records"]) \
            and not recorded.get("unfinished"):
        return ""  # the run finished and its own failure message names its report and records
    path = write_html(report, report_path_for(nodeid, "report"))
    lines = ["recorded before the failure:"]
    for r in report.recorded.get("records", []):
        lines.append(f"  parallel record: {r['path']} ({r['steps']} steps, {'complete' if r['complete'] else 'incomplete'})")
    lines += [f"  trace parts of the ranks: {p}" for p in report.recorded.get("trace_parts", [])]
    done = len(report.losses.get("parallel", []))
    lines += [f"  unfinished record, {done} step{'s' if done != 1 else ''} done before the ranks were stopped: {p}"
              for p in report.recorded.get("unfinished", [])]
    lines.append(f"  html report: {path}")
    return "\n\n" + "\n".join(lines)


# -- in-place mode (torchrun) ----------------------------------------------------------------
class InPlaceRunner:
    """Each torchrun process is one rank: run distributed tests here, spawn nothing."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.baseline: Any = None
        self.watchdog: threading.Timer | None = None
        self.test_mark = -1

    def setup(self, item: pytest.Item, spec: DistSpec) -> None:
        if spec.nproc != self.world_size:
            pytest.skip(
                f"needs nproc={spec.nproc} ranks but torchrun started WORLD_SIZE={self.world_size}"
            )
        import torch.distributed as dist

        from harness.launch.rank_state import RankState, seed_everything
        from harness.tracing import dump, fr

        if not dist.is_initialized():
            os.environ.setdefault(fr.FR_BUFFER_ENV, fr.RANK_FR_BUFFER)
            if spec.device == "cuda":
                import torch

                torch.cuda.set_device(self.local_rank)
            dist.init_process_group(spec.backend, init_method="env://")
            self.baseline = RankState.capture()
        self.test_mark = dump.mark_test_start()
        seed_everything(0)
        self.watchdog = threading.Timer(spec.timeout, self._on_timeout, args=(item.nodeid, spec.timeout))
        self.watchdog.daemon = True
        self.watchdog.start()

    def _on_timeout(self, nodeid: str, timeout: float) -> None:
        """No launcher above us to kill the ranks: report where this rank is, then exit so
        torchrun tears the job down instead of letting CI hang."""
        import faulthandler

        from harness.tracing import dump, fr

        out = sys.__stderr__
        print(f"\n[rank {self.rank}] TIMEOUT after {timeout:g} s in {nodeid}; last collectives:", file=out)
        for entry in dump.read_entries(self.test_mark)[-8:]:
            print(f"    {fr.format_entry(entry)}", file=out)
        print(f"[rank {self.rank}] Python stacks:", file=out)
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()
        os._exit(3)

    def context(self, spec: DistSpec) -> Any:
        from harness.context import DistContext

        return DistContext(self.rank, self.world_size, self.local_rank, spec.backend, spec.device)

    def call(self, item: pytest.Function, spec: DistSpec) -> None:
        return None  # pytest calls the function itself, here, on this rank

    def teardown(self, item: pytest.Item, spec: DistSpec) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        from harness.launch.rank_state import release_test_groups

        release_test_groups()
        if self.baseline is not None:
            self.baseline.restore()

    def close(self) -> None:
        import sys as _sys

        if "torch.distributed" in _sys.modules:
            dist = _sys.modules["torch.distributed"]
            if dist.is_initialized():
                dist.destroy_process_group()


_RUNNER_KEY = pytest.StashKey[Any]()
