"""Messages exchanged between the launcher (pytest process) and its rank workers.

Plain picklable dataclasses, imported by both sides; nothing here imports torch so the
pytest process stays light until a distributed test actually runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.tracing.entries import CollectiveEntry

# The first bytes a worker sends on a fresh connection: a per-pool secret, so that nothing
# else on the machine can talk to the launcher's loopback socket.
HANDSHAKE_TASK = b"task"
HANDSHAKE_CONTROL = b"ctrl"


@dataclass(frozen=True)
class CurrentTest:
    """What a rank body is told of the test it runs (harness.testing names its reports and
    keeps its records by it); on the ranks: :func:`harness.launch.rank_state.current_test`."""

    nodeid: str
    run_dir: str = ""  # where this test's records go: kept and named when it fails, else removed
    report_dir: str = ""  # where a failing check writes its HTML report ("" : $HARNESS_REPORT_DIR)


@dataclass
class TestTask:
    """One test body to run on every rank."""

    nodeid: str
    module_name: str
    module_file: str
    qualname: str  # "test_fn" or "TestClass.test_method"
    kwargs_pickle: bytes  # pickled dict of fixture values, dist_ctx excluded
    ctx_argnames: tuple[str, ...]  # parameters that receive the rank's DistContext
    sys_path: list[str]
    cwd: str
    seed: int = 0
    plain_import: bool = False  # import module_name normally (library code), not as a test file
    run_dir: str = ""  # where harness.testing writes this test's records (CurrentTest.run_dir on the ranks)
    report_dir: str = ""  # where failing checks write HTML reports (CurrentTest.report_dir)
    # A test method's state as pytest set it up (setup_method, fixtures that set self.x or
    # cls.x): pickled {"instance": vars(self), "class": plain class attributes}; b"" for a function.
    state_pickle: bytes = b""


@dataclass
class RankResult:
    rank: int
    outcome: str  # "passed" | "failed" | "skipped"
    duration_s: float
    finished_at: float  # time.monotonic(): system-wide on Linux, so comparable across ranks
    exc_type: str = ""
    message: str = ""
    longrepr: str = ""  # pytest-style traceback text, assertion rewriting included
    stdout: str = ""
    stderr: str = ""
    value_pickle: bytes = b""  # the body's return value, pickled (run_on_ranks); b"" for None


@dataclass
class ResetResult:
    """Reply to the between-tests reset: enough to tell whether the ranks are still in step."""

    rank: int
    ok: bool
    group_count: int
    detail: str = ""


@dataclass
class RankDump:
    """What a rank says about itself when the launcher asks (hang, abort)."""

    rank: int
    pid: int
    state: str  # "idle" | "running <nodeid>"
    stack: str  # Python stack of the thread running the test
    waiting_in: str  # innermost torch.distributed function on the stack, "" if none
    user_site: str  # innermost frame outside torch / the harness
    collectives: list[CollectiveEntry] = field(default_factory=list)
    stdout_tail: str = ""
