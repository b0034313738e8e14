"""Messages exchanged between the launcher (pytest process) and its rank workers.

Plain picklable dataclasses, imported by both sides; nothing here imports torch so the
pytest process stays light until a distributed test actually runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The first bytes a worker sends on a fresh connection: a per-pool secret, so that nothing
# else on the machine can talk to the launcher's loopback socket.
HANDSHAKE_TASK = b"task"
HANDSHAKE_CONTROL = b"ctrl"


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
    run_dir: str = ""  # where harness.testing writes this test's records ($HARNESS_RUN_DIR on the ranks)
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
class CollectiveEntry:
    """One collective as Flight Recorder saw it on a rank."""

    record_id: int
    op: str
    process_group: str
    group_ranks: list[int] | None
    seq_id: int
    p2p_seq_id: int
    input_sizes: list
    state: str
    call_site: str  # first frame outside torch / the harness, "file:line in fn"
    # Added by harness.tracing (Python-side hooks): what Flight Recorder does not record.
    dtypes: list = field(default_factory=list)
    reduce_op: str = ""  # "sum", "avg", ... ("" unknown / not a reduction)
    is_p2p: bool = False
    peer: int | None = None  # global rank of a p2p op's peer (None: any source)
    tag: int = 0
    time_ns: int = 0  # wall clock when issued
    phase: str = ""  # the tracer's phase when issued: "harness" for the harness's own collectives
    step: int | None = None  # the tracer's training step when issued


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
