"""A rank worker: one process of a warm pool, started by ``harness.launch.pool``.

It joins the default process group once, then runs test bodies the launcher sends, one at
a time, resetting leaked state between them. A second connection, served by a thread,
answers "where are you?" even while the main thread is stuck in a collective.

Run as ``python -m harness.launch.worker``; configuration comes in HARNESS_* environment variables.
"""

from __future__ import annotations

import ast
import json
import faulthandler
import importlib
import importlib.util
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any, Callable

from harness import settings
from harness.frames import is_harness_file, is_library_frame
from harness.launch import procs
from harness.launch.protocol import HANDSHAKE_CONTROL, HANDSHAKE_TASK, RankDump, RankResult, ResetResult, TestTask
from harness.tracing.entries import CollectiveEntry

_DIST_FUNCTIONS_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


def _connect(port: int, token: bytes, role: bytes, rank: int, timeout: float) -> Connection:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    conn.send_bytes(token + role + str(rank).encode())
    return conn


class _FdCapture:
    """Capture fds 1 and 2 (prints, C++ warnings, subprocess output) into a file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file = open(path, "w+b")
        self._saved: list[int] = []

    def __enter__(self) -> "_FdCapture":
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = [os.dup(1), os.dup(2)]
        os.dup2(self.file.fileno(), 1)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)

    def read(self) -> str:
        self.file.seek(0)
        return self.file.read().decode(errors="replace")

    def close(self) -> None:
        self.file.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def capture_path(workdir: str, rank: int) -> str:
    """Where a rank's test output goes; the launcher reads it when the rank dies mid-test."""
    return os.path.join(workdir, f"rank{rank}-test-output.txt")


def journal_path(workdir: str, rank: int) -> str:
    """Where a rank journals its collectives during a test (:func:`harness.tracing.hooks.open_journal`);
    the launcher reads it when the rank dies or fails and so cannot be asked."""
    return os.path.join(workdir, f"rank{rank}-collectives.jsonl")


def exit_note_path(workdir: str, rank: int) -> str:
    """Where a rank notes the line that called ``os._exit`` during a test body (read by the
    launcher when the rank dies: an exit status alone does not say where)."""
    return os.path.join(workdir, f"rank{rank}-exit-note.txt")


def read_exit_note(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return ""


class _ExitNote:
    """While a test body runs: ``os._exit(n)`` called from this process's main thread first
    writes ``"os._exit(n) at file:line in fn"`` to the rank's note file. Forked children
    (DataLoader workers end through ``os._exit``) and other threads write nothing."""

    def __init__(self, path: str):
        self.path = path
        self._real = os._exit

    def __enter__(self) -> "_ExitNote":
        try:
            os.unlink(self.path)
        except OSError:
            pass
        pid, main, real, path = os.getpid(), threading.get_ident(), self._real, self.path

        def noted_exit(status: int) -> None:
            if os.getpid() == pid and threading.get_ident() == main:
                caller = sys._getframe(1)
                try:
                    with open(path, "w", encoding="utf-8") as fh:
                        fh.write(f"os._exit({status}) at {caller.f_code.co_filename}:{caller.f_lineno} in {caller.f_code.co_name}")
                except OSError:
                    pass
            real(status)

        os._exit = noted_exit  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        os._exit = self._real  # type: ignore[assignment]


def read_journal(path: str) -> list[Any]:
    """A journal's calls as ``CollectiveEntry`` rows, oldest first (p2p ops numbered per
    channel); [] when there is none. A last line cut short by the rank's death is skipped."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    out: list[Any] = []
    p2p: dict[tuple, int] = {}
    for index, line in enumerate(lines):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if data.get("is_p2p"):
            key = (data["process_group"], data["op"], data.get("peer"), data.get("tag", 0))
            data["p2p_seq_id"] = p2p[key] = p2p.get(key, 0) + 1
        out.append(CollectiveEntry(record_id=index, seq_id=data.pop("seq_id", 0), p2p_seq_id=data.pop("p2p_seq_id", 0), **data))
    return out


def _import_test_module(task: TestTask) -> ModuleType:
    """Import the test module under the name pytest gave it, with pytest's assertion rewriting,
    so that pickled fixture values referring to its classes resolve and `assert a == b` in a
    rank body explains itself like it does in pytest."""
    from _pytest.assertion.rewrite import rewrite_asserts

    path = os.path.abspath(task.module_file)
    existing = sys.modules.get(task.module_name)
    mtime = os.stat(path).st_mtime_ns
    if (
        existing is not None
        and os.path.abspath(getattr(existing, "__file__", "") or "") == path
        and getattr(existing, "__harness_mtime__", None) == mtime
    ):
        return existing
    if "." in task.module_name:
        try:  # packages of the test module (tests/__init__.py); optional under importlib mode
            importlib.import_module(task.module_name.rsplit(".", 1)[0])
        except ImportError:
            pass
    spec = importlib.util.spec_from_file_location(task.module_name, path)
    if spec is None:
        raise ImportError(f"cannot build an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    with open(path, "rb") as fh:
        source = fh.read()
    tree = ast.parse(source, filename=path)
    rewrite_asserts(tree, source, path, None)
    code = compile(tree, path, "exec", dont_inherit=True)
    module.__harness_mtime__ = mtime  # type: ignore[attr-defined]
    sys.modules[task.module_name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(task.module_name, None)
        raise
    return module


def _resolve(module: ModuleType, qualname: str) -> tuple[Callable[..., Any], type | None]:
    if "<locals>" in qualname:
        raise LookupError(
            f"{qualname} is defined inside another function; a distributed test body must be "
            "a module-level function or a method of a module-level class"
        )
    owner: Any = module
    parts = qualname.split(".")
    cls = None
    for part in parts[:-1]:
        owner = getattr(owner, part)
        cls = owner
    return getattr(owner, parts[-1]), cls


def _call_test(fn: Callable[..., Any], cls: type | None, kwargs: dict[str, Any], state_pickle: bytes = b"") -> Any:
    __tracebackhide__ = True
    if cls is not None:
        instance = cls()
        # The state pytest's setup gave the instance and the class in the pytest process
        # (setup_method / setup_class, fixtures setting self.x or cls.x): not run again here.
        state = pickle.loads(state_pickle) if state_pickle else {}
        for name, value in state.get("class", {}).items():
            setattr(cls, name, value)
        vars(instance).update(state.get("instance", {}))
        fn = getattr(instance, fn.__name__)
    result = fn(**kwargs)
    if hasattr(result, "__await__"):
        raise TypeError("async distributed tests are not supported: make the test body synchronous")
    return result


class RankSetupError(RuntimeError):
    """The harness could not run the test body on this rank, or not send back what it
    returned: the message says why. Its traceback is the worker's own, not the user's."""


def _setup_error_text(exc: RankSetupError) -> str:
    """The message first; then, when the cause was raised in the user's code (an import error
    in the test module), only those frames of its traceback - never the worker's."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    if cause is None:
        return text
    frames = [f for f in traceback.extract_tb(cause.__traceback__)
              if not is_harness_file(f.filename) and not f.filename.startswith("<frozen")]
    if not frames:
        return text
    shown = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(cause))
    return f"{text}\n\nwhere it was raised:\n{shown}".rstrip()


def _pytest_longrepr(exc: BaseException, fn: Callable[..., Any] | None) -> str:
    """The traceback as pytest would print it under --tb=auto: starting at the test function,
    first and last entry long, the rest short."""
    try:
        from _pytest._code import Code, ExceptionInfo

        excinfo = ExceptionInfo.from_exception(exc)
        tb = excinfo.traceback
        if fn is not None:
            code = Code.from_function(fn)
            tb = tb.cut(path=code.path, firstlineno=code.firstlineno)
        tb = tb.filter(excinfo)
        if len(tb) > 2:  # pytest >= 8: entries are immutable, with_repr_style returns a copy
            tb = type(tb)([tb[0], *(entry.with_repr_style("short") for entry in tb[1:-1]), tb[-1]])
        # Library entries short (one line each: the harness's rank body under the CLI, torch's
        # internals, where a library raised): the user's own frames are the source a person reads.
        tb = type(tb)([entry.with_repr_style("short") if is_library_frame(str(entry.path)) else entry for entry in tb])
        excinfo.traceback = tb
        return str(excinfo.getrepr(style="long", tbfilter=False, truncate_locals=True))
    except Exception:  # noqa: BLE001 - fall back to the plain traceback
        return "".join(traceback.format_exception(exc))


class RankWorker:
    def __init__(self) -> None:
        env = os.environ
        self.rank = int(env["RANK"])
        self.world_size = int(env["WORLD_SIZE"])
        self.local_rank = int(env["LOCAL_RANK"])
        self.backend = env["HARNESS_BACKEND"]
        self.device_type = env["HARNESS_DEVICE"]
        self.workdir = env["HARNESS_WORKDIR"]
        self.state = "starting"
        self.capture_path = ""
        self.main_ident = threading.get_ident()
        self.test_mark = -1
        self.baseline: Any = None

    # -- control channel (runs in a thread) -------------------------------------------------
    def serve_control(self, conn: Connection) -> None:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                # The launcher is gone: take our own tree down rather than linger as an orphan.
                procs.kill_tree(os.getpid())
                os._exit(1)
            if request == "dump":
                try:
                    conn.send(self.dump())
                except (OSError, EOFError):
                    pass

    def dump(self) -> RankDump:
        from harness.tracing import dump, fr

        frame = sys._current_frames().get(self.main_ident)
        summary = traceback.extract_stack(frame) if frame is not None else []
        # Start at the test body: the worker's own frames above it say nothing to the user.
        for i, fs in enumerate(summary):
            if fs.name == "_call_test" and fs.filename.endswith(os.path.join("harness", "launch", "worker.py")):
                summary = traceback.StackSummary.from_list(summary[i + 1 :])
                stack = "".join(summary.format())
                break
        else:
            summary = traceback.StackSummary.from_list([])
            stack = f"    ({self.state}: not inside a test body)\n"
        waiting_in, user_site = "", ""
        for fs in reversed(summary):
            if not waiting_in and fs.filename.endswith(_DIST_FUNCTIONS_FILE):
                waiting_in = fs.name
            if not user_site and not fr.is_library_frame(fs.filename):
                user_site = f"{fs.filename}:{fs.lineno} in {fs.name}"
        return RankDump(
            rank=self.rank,
            pid=os.getpid(),
            state=self.state,
            stack=stack,
            waiting_in=waiting_in,
            user_site=user_site,
            collectives=dump.read_entries(self.test_mark)[-20:],
            stdout_tail=procs.tail_of(self.capture_path) if self.capture_path else "",
        )

    # -- main loop --------------------------------------------------------------------------
    def init_process_group(self) -> None:
        import torch
        import torch.distributed as dist

        from harness.launch.rank_state import RankState

        if self.device_type == "cuda":
            torch.cuda.set_device(self.local_rank)
        store = dist.FileStore(os.environ["HARNESS_STORE_PATH"], self.world_size)
        timeout = timedelta(seconds=float(os.environ.get("HARNESS_PG_TIMEOUT", "1800")))
        kwargs: dict[str, Any] = {}
        if self.device_type == "cuda":
            kwargs["device_id"] = torch.device("cuda", self.local_rank)
        dist.init_process_group(
            self.backend,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
            **kwargs,
        )
        # A forked rank inherits the fork server's intra-op pool, sized before OMP_NUM_THREADS
        # was set for the ranks: apply it, so nproc ranks on few cores do not oversubscribe.
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))
        self.baseline = RankState.capture()

    def run(self, task: TestTask) -> RankResult:
        from harness.context import DistContext
        from harness.launch.protocol import CurrentTest
        from harness.launch.rank_state import begin_test, end_test, seed_everything
        from harness.tracing import dump, hooks

        started = time.monotonic()
        self.state = f"running {task.nodeid}"
        self.test_mark = begin_test(CurrentTest(task.nodeid, task.run_dir, task.report_dir))
        hooks.open_journal(journal_path(self.workdir, self.rank), dump.seq_ids_at_last_mark())
        capture = _FdCapture(capture_path(self.workdir, self.rank))
        self.capture_path = capture.path
        outcome, exc_type, message, longrepr = "passed", "", "", ""
        value_pickle = b""
        fn: Callable[..., Any] | None = None
        try:
            sys.path[:] = task.sys_path + [p for p in sys.path if p not in task.sys_path]
            os.chdir(task.cwd)
            try:
                module = importlib.import_module(task.module_name) if task.plain_import else _import_test_module(task)
                fn, cls = _resolve(module, task.qualname)
                kwargs = pickle.loads(task.kwargs_pickle)
            except BaseException as exc:  # noqa: BLE001 - reported to the user, with cause
                raise RankSetupError(
                    f"rank {self.rank} could not load the test body {task.qualname} from "
                    f"{task.module_file} (module {task.module_name}): "
                    f"{type(exc).__name__}: {exc}. Distributed test bodies, and the classes of "
                    "their fixture values, must be importable from the test file in a fresh "
                    "process."
                ) from exc
            ctx = DistContext(
                rank=self.rank,
                world_size=self.world_size,
                local_rank=self.local_rank,
                backend=self.backend,
                device_type=self.device_type,
            )
            for name in task.ctx_argnames:
                kwargs[name] = ctx
            seed_everything(task.seed)
            with capture, _ExitNote(exit_note_path(self.workdir, self.rank)):
                value = _call_test(fn, cls, kwargs, task.state_pickle)
            if value is not None:
                try:
                    value_pickle = pickle.dumps(value)
                except Exception as exc:  # noqa: BLE001
                    raise RankSetupError(
                        f"rank {self.rank}: {task.qualname} returned a {type(value).__name__} that "
                        f"cannot be pickled back to the launcher ({exc}); return plain data"
                    ) from exc
        except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the launcher
            from _pytest.outcomes import Skipped

            exc_type = type(exc).__name__
            message = str(exc)
            if isinstance(exc, Skipped):
                outcome = "skipped"
                message = exc.msg or "skipped"
            else:
                outcome = "failed"
                longrepr = _setup_error_text(exc) if isinstance(exc, RankSetupError) else _pytest_longrepr(exc, fn)
        finally:
            self.state = "idle"
            end_test()
            hooks.close_journal()
        captured = capture.read()
        capture.close()
        self.capture_path = ""
        return RankResult(
            rank=self.rank,
            outcome=outcome,
            duration_s=time.monotonic() - started,
            finished_at=time.monotonic(),
            exc_type=exc_type,
            message=message,
            longrepr=longrepr,
            stdout=captured,
            value_pickle=value_pickle,
        )

    def reset(self) -> ResetResult:
        import torch.distributed as dist

        from harness.launch.rank_state import group_count, release_test_groups

        try:
            if not dist.is_initialized():
                return ResetResult(self.rank, False, -1, "the test destroyed the default process group")
            release_test_groups()
            self.baseline.restore()
            # In step with the others? A rank that skipped a collective would block here and
            # the launcher's deadline replaces the pool.
            dist.barrier()
            return ResetResult(self.rank, True, group_count())
        except BaseException as exc:  # noqa: BLE001
            return ResetResult(self.rank, False, -1, f"{type(exc).__name__}: {exc}")

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    procs.die_with_parent()
    # faulthandler writes to a copy of the rank's log as it is now: during a test fd 2 is the
    # test's capture file, where a stack dumped on the launcher's request would be lost.
    log_fd = os.dup(2)
    faulthandler.enable(file=log_fd)
    # Fallback for a rank whose control thread cannot answer (GIL held in C code).
    faulthandler.register(signal.SIGUSR1, file=log_fd, all_threads=True)
    port = int(os.environ["HARNESS_LAUNCHER_PORT"])
    token = bytes.fromhex(os.environ["HARNESS_TOKEN"])
    rank = int(os.environ["RANK"])
    connect_timeout = float(os.environ.get("HARNESS_STARTUP_TIMEOUT", settings.STARTUP_TIMEOUT_S))
    task_conn = _connect(port, token, HANDSHAKE_TASK, rank, connect_timeout)
    control_conn = _connect(port, token, HANDSHAKE_CONTROL, rank, connect_timeout)
    worker = RankWorker()
    threading.Thread(target=worker.serve_control, args=(control_conn,), daemon=True).start()
    try:
        worker.init_process_group()
    except BaseException as exc:  # noqa: BLE001
        task_conn.send(("error", "".join(traceback.format_exception(exc))))
        sys.exit(1)
    worker.state = "idle"
    task_conn.send(("ready", os.getpid()))
    while True:
        try:
            kind, payload = task_conn.recv()
        except (EOFError, OSError):
            break
        if kind == "run":
            task_conn.send(worker.run(payload))
        elif kind == "reset":
            task_conn.send(worker.reset())
        elif kind == "shutdown":
            worker.shutdown()
            task_conn.send(("bye", os.getpid()))
            break
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
