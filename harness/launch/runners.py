"""Where a distributed test runs, apart from what it runs: the two pytest runners behind one
declared interface (:class:`DistRunner`). :class:`SpawnRunner` sends each test body to ranks the
harness starts (warm pools, :mod:`harness.launch.pool`); :class:`InPlaceRunner` is one rank of a
torchrun job and runs the body in this process. Both give the body the same per-test preamble
(:func:`harness.launch.rank_state.begin_test`: the test's facts, the collective-record mark, the
seed) and the same reset after it (:class:`harness.launch.rank_state.RankState`).
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Protocol

import pytest

__all__ = ["DistRunner", "DistSpec", "InPlaceRunner", "RunFolderLines", "SpawnRunner", "under_torchrun"]


class RunFolderLines(Protocol):
    """What a failed or interrupted test left in its run folder, said in its failure message:
    the folders named and an HTML report built from them (""; the folder is removed when the
    test recorded nothing). :class:`harness.analysis.failed_run.RunFolderReport` is the one."""

    def failed(self, run_dir: str, nodeid: str, text: str, outcome: Any) -> str: ...

    def interrupted(self, run_dir: str) -> str: ...


class DistRunner(Protocol):
    """What the plugin asks of a runner, per distributed test: ``setup`` before the fixtures,
    ``context`` for ``dist_ctx``, ``call`` instead of pytest's own call (True: the body ran
    elsewhere; None: pytest calls it here), ``teardown`` after; ``close`` at session end.
    ``interrupted`` names what an interrupted test had recorded ("" when nothing)."""

    interrupted: str

    def setup(self, item: pytest.Item, spec: DistSpec) -> None: ...

    def context(self, spec: DistSpec) -> Any: ...

    def call(self, item: pytest.Function, spec: DistSpec) -> bool | None: ...

    def teardown(self, item: pytest.Item, spec: DistSpec) -> None: ...

    def close(self) -> None: ...


def under_torchrun() -> bool:
    """This pytest process is one rank of a torchrun job (not a rank the harness started)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) and not os.environ.get(
        "HARNESS_WORKER"
    )


@dataclass(frozen=True)
class DistSpec:
    """A distributed test's marker, validated: its world size, deadline, backend and device."""

    nproc: int
    timeout: float
    backend: str
    device: str




class _RankContextPlaceholder:
    """Stands for dist_ctx in the pytest process; each rank substitutes its own context."""

    def __repr__(self) -> str:
        return "<dist_ctx: filled in on each rank>"


class SpawnRunner:
    """Ranks the harness starts: warm pools (one per world size, backend and device) that run
    each test body sent as a :class:`~harness.launch.protocol.TestTask`."""

    def __init__(self, config: pytest.Config, report_dir: str, run_folder: RunFolderLines) -> None:
        self.config = config
        self.report_dir = report_dir
        self.run_folder = run_folder
        self.interrupted = ""  # what an interrupted test had recorded, said at session end
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
        _fail_unless_picklable(kwargs, lambda name, value, exc: (
            f"fixture or parameter {name!r} (a {type(value).__name__}) cannot be sent to "
            f"the ranks: {type(exc).__name__}: {exc}. Distributed test bodies receive "
            "only picklable values; build what you need inside the body, or return "
            "plain data from the fixture."))
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
            report_dir=self.report_dir,
            state_pickle=state_pickle,
        )
        key = PoolKey(spec.nproc, spec.backend, spec.device)
        try:
            outcome = self.manager.run(key, task, spec.timeout)
        except KeyboardInterrupt:
            # Ctrl-C / SIGTERM: the pool killed the ranks; name what the test had recorded.
            left = self.run_folder.interrupted(run_dir)
            if left:
                self.interrupted = f"harness: {item.nodeid} was interrupted; kept{left}"
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
            pytest.fail(text + self.run_folder.failed(run_dir, item.nodeid, text, outcome), pytrace=False)
        shutil.rmtree(run_dir, ignore_errors=True)
        if outcome.all_skipped:
            raise pytest.skip.Exception(outcome.results[0].message, _use_item_location=True)
        return True

    def teardown(self, item: pytest.Item, spec: DistSpec) -> None:
        pass

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()


def _fail_unless_picklable(values: dict[str, Any], problem: Callable[[str, Any, Exception], str]) -> None:
    """Fail the test, saying ``problem(name, value, error)``, at the first value that cannot
    be sent to the ranks."""
    for name, value in values.items():
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001
            pytest.fail(problem(name, value, exc), pytrace=False)


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
        _fail_unless_picklable(vars(instance), lambda name, value, exc: (
            f"self.{name} (a {type(value).__name__}), set up for {item.nodeid} in the pytest process, cannot be sent "
            f"to the ranks: {type(exc).__name__}: {exc}. A distributed test method's instance state must be "
            "picklable; build it inside the body instead."))
        raise


class InPlaceRunner:
    """Each torchrun process is one rank: run distributed tests here, spawn nothing."""

    def __init__(self, config: pytest.Config, report_dir: str, run_folder: RunFolderLines) -> None:
        self.config = config
        self.report_dir = report_dir
        self.interrupted = ""  # in place, torchrun ends the job on Ctrl-C: nothing to name
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

        from harness.launch.protocol import CurrentTest
        from harness.launch.rank_state import RankState, begin_test, seed_everything
        from harness.tracing import fr

        if not dist.is_initialized():
            os.environ.setdefault(fr.FR_BUFFER_ENV, fr.RANK_FR_BUFFER)
            if spec.device == "cuda":
                import torch

                torch.cuda.set_device(self.local_rank)
            dist.init_process_group(spec.backend, init_method="env://")
            self.baseline = RankState.capture()
        self.test_mark = begin_test(CurrentTest(item.nodeid, report_dir=self.report_dir))
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
        from harness.launch.rank_state import end_test, release_test_groups

        end_test()
        release_test_groups()
        if self.baseline is not None:
            self.baseline.restore()

    def close(self) -> None:
        import sys as _sys

        if "torch.distributed" in _sys.modules:
            dist = _sys.modules["torch.distributed"]
            if dist.is_initialized():
                dist.destroy_process_group()
