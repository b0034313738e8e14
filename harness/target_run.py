"""Run a target on N ranks and diagnose it: the engine behind ``python -m harness diagnose``.

The launching process resolves the target, starts (or reuses) warm ranks through
:class:`~harness.remote.RankRunner` and waits; every rank trains the strategy (or the custom
loop) with recording, tracing and the activation probe on; the destination rank compares with
the reference, runs the diagnosis engine and returns a :class:`~harness.report.DiagnosisReport`.
A hang comes back as the launcher's timeout dumps and is diagnosed from the collective traces.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .codes import Diagnosis
from .remote import RankRunner, RanksFailed, RanksHung
from .report.model import DiagnosisReport, build_report
from .target import Target, load_target

__all__ = ["diagnose_on_rank", "diagnose_target"]


class _ProgressStrategy:
    """Delegates to a strategy; appends "step k/K" to a file after each optimizer step so the
    launching process can show progress while the ranks run."""

    def __init__(self, inner: Any, path: str | None, steps: int):
        self.inner = inner
        self.name = inner.name
        self.path = path
        self.steps = steps
        self.done = 0

    def setup(self, case: Any, ctx: Any) -> Any:
        return self.inner.setup(case, ctx)

    def local_batches(self, case: Any, setup: Any, step: int) -> Any:
        return self.inner.local_batches(case, setup, step)

    def forward_backward(self, case: Any, setup: Any, micro_batches: Any) -> Any:
        return self.inner.forward_backward(case, setup, micro_batches)

    def optimizer_step(self, case: Any, setup: Any) -> None:
        self.inner.optimizer_step(case, setup)
        self.done += 1
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(f"step {self.done}/{self.steps} trained\n")
                if self.done == self.steps:  # run_and_diagnose compares and diagnoses next
                    fh.write("diagnose: comparing and naming causes\n")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _progress(path: str | None, message: str) -> None:
    if path:
        with open(path, "a") as fh:
            fh.write(message + "\n")


def diagnose_on_rank(
    ctx: Any,
    target_spec: str,
    steps: int | None,
    workdir: str,
    cache: str | None,
    progress_path: str | None = None,
    dst: int = 0,
    tolerance: str = "auto",
    comparison: str = "stepwise",
) -> DiagnosisReport | None:
    """Rank body (collective): train the target, compare and diagnose on ``dst``; returns the
    report there and None on the other ranks. ``tolerance`` / ``comparison``: see
    :func:`harness.run.compare_to_reference`."""
    import torch
    import torch.distributed as dist

    from reference.cache import cached_reference

    from .custom import CustomRun
    from .rank_diagnosis import diagnosis_report, run_and_diagnose
    from .probe import collect_probe
    from .run import compare_to_reference, trace_parts_dir

    started = time.monotonic()
    target = load_target(target_spec)
    case = target.case if steps is None else target.case.replace(steps=steps)
    is_dst = ctx.rank == dst
    if is_dst:
        _progress(progress_path, f"reference: training {case.name!r} on one device ({case.steps} steps)")
        cached_reference(case, cache=cache)  # before the ranks start, so its time shows as its own phase
        _progress(progress_path, f"ranks: training {target.strategy.name if target.strategy else 'custom loop'} on {ctx.world_size} ranks")
    dist.barrier()
    if target.strategy is not None:
        progress = _ProgressStrategy(target.strategy, progress_path if is_dst else None, case.steps)
        run = run_and_diagnose(case, progress, ctx, target=target, workdir=workdir, cache=cache, dst=dst,
                               tolerance=tolerance, comparison=comparison)
        return run.report
    assert target.train is not None
    record_dir = Path(workdir) / f"custom-{case.name}-w{ctx.world_size}"
    try:
        from .tracing import Tracer
        from .tracing.trace import TRACE_FILE

        tracer = Tracer(name=f"custom-{case.name}")
    except ImportError:
        tracer = None
    run = CustomRun(case, ctx, record_dir if is_dst else None, dst=dst, tracer=tracer)
    torch.manual_seed(case.seed)  # the training RNG starts where the reference's does
    try:
        # Active while the loop runs, so a hang dump can tell the harness's collectives apart.
        with tracer if tracer is not None else contextlib.nullcontext():
            target.train(ctx, run)
    except BaseException:
        if run.recorder is not None:
            run.finish(complete=False)
        if tracer is not None:
            try:  # the ranks may no longer be in step: each writes its own trace part
                tracer.save_part(trace_parts_dir(record_dir))
            except Exception:  # noqa: BLE001 - the loop's own error is what the user must see
                pass
        raise
    record = run.finish()
    run_trace = tracer.gather(dst, meta={"case": case.name, "strategy": "custom"}) if tracer is not None else None
    probe = collect_probe(run, dst) if run.probe is not None else None  # collective
    if not is_dst:
        return None
    assert record is not None
    _progress(progress_path, "diagnose: comparing and naming causes")
    compared = compare_to_reference(case, record, cache=cache, label=f"{target.name} on {ctx.world_size} ranks vs reference",
                                    tolerance=tolerance, comparison=comparison)
    trace_path = str(run_trace.save(Path(record.path) / TRACE_FILE)) if run_trace is not None else None
    return diagnosis_report(
        target, case, ctx.world_size, comparison=compared, record_path=str(record.path), trace_path=trace_path,
        cache=cache, probe=probe, elapsed_s=time.monotonic() - started,
    )


def _tail(path: str, stop: threading.Event, echo: Callable[[str], None]) -> None:
    pos = 0
    while not stop.is_set():
        try:
            with open(path) as fh:
                fh.seek(pos)
                chunk = fh.read()
                pos = fh.tell()
        except FileNotFoundError:
            chunk = ""
        for line in chunk.splitlines():
            echo(f"  {line}")
        stop.wait(0.2)


def diagnose_target(
    target: str,
    *,
    nproc: int | None = None,
    steps: int | None = None,
    runner: RankRunner | None = None,
    timeout: float | None = None,
    workdir: str | os.PathLike[str] | None = None,
    cache: str | os.PathLike[str] | None = None,
    echo: Callable[[str], None] | None = None,
    tolerance: str = "auto",
    comparison: str = "stepwise",
) -> DiagnosisReport:
    """Diagnose ``target`` (see :mod:`harness.target`) on ``nproc`` ranks (default: the
    target's NPROC, else 2) and return the report. ``timeout`` defaults to the target's
    TIMEOUT, else 300 s. ``echo`` receives progress lines. ``tolerance`` and ``comparison``
    as :func:`harness.run.compare_to_reference` takes them."""
    say = echo or (lambda line: None)
    resolved: Target = load_target(target)  # fail fast, in this process, on a bad target
    world = nproc or resolved.nproc or 2
    work = str(workdir) if workdir is not None else tempfile.mkdtemp(prefix="harness-diagnose-")
    os.makedirs(work, exist_ok=True)
    progress_path = os.path.join(work, f"progress-{os.getpid()}-{time.monotonic_ns()}.log")
    say(f"target {resolved.name}: case {resolved.case.name!r}, {world} ranks, {steps or resolved.case.steps} steps")
    own = runner is None
    runner = runner or RankRunner()
    stop = threading.Event()
    tail = threading.Thread(target=_tail, args=(progress_path, stop, say), daemon=True)
    tail.start()
    started = time.monotonic()
    try:
        result = runner.run(
            diagnose_on_rank, nproc=world, timeout=timeout or resolved.timeout or 300.0,
            kwargs={"target_spec": target, "steps": steps, "workdir": work, "tolerance": tolerance, "comparison": comparison,
                    "cache": str(cache) if cache is not None else None, "progress_path": progress_path},
        )
        report = result.values.get(0)
        if not isinstance(report, DiagnosisReport):
            raise RanksFailed(f"rank 0 returned {type(report).__name__}, not a report", result.outcome)  # type: ignore[arg-type]
    except RanksHung as exc:
        report = _hang_report(resolved, world, steps, exc, work)
    except RanksFailed as exc:
        case = resolved.case if steps is None else resolved.case.replace(steps=steps)
        record, trace, recorded = _left_behind(work)
        raised = _own_exception(exc.outcome)
        # A rank's own exception (the user's code, or a check of the case) is the cause: the
        # others waiting in a collective are its consequence, not a missing collective.
        diagnoses = [] if raised else _failure_diagnoses(exc)
        error = f"{raised}\n\n{exc.report}" if raised else exc.report
        report = build_report(target=resolved, case=case, nproc=world, diagnoses=diagnoses, actual=record, trace=trace,
                              error=error + _recorded_lines(recorded), elapsed_s=time.monotonic() - started, recorded=recorded)
    finally:
        stop.set()
        tail.join(timeout=1)
        if own:
            runner.close()
    report.workdir = work
    return report


_BACKEND_MISMATCH = ("collective mismatch", "doesn't match expected size", "does not match expected size")
# Exceptions raised by the process group itself: consequences of another rank's failure or a
# collective bug, never the user's own error.
_BACKEND_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
_BACKEND_TEXT = (*_BACKEND_MISMATCH, "Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
                 "NCCL error", "Gloo", "gloo")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_PYTEST_FRAME = re.compile(r"^\s*(\S+\.py):(\d+): \w+", re.MULTILINE)


def _own_exception(outcome: Any) -> str:
    """When the first failure is a rank raising an exception of its own (not a death, not the
    backend aborting a collective), one line naming it: rank, type, message and the innermost
    frame outside the harness (file:line in function). Empty otherwise."""
    from .rank_report import _root_cause

    root = _root_cause(outcome)
    if root is None or root[1] != "failed":
        return ""
    result = outcome.results[root[0]]
    text = f"{result.exc_type} {result.message}"
    if result.exc_type in _BACKEND_ERRORS or any(m in text for m in _BACKEND_TEXT):
        return ""
    # Python tracebacks ('File "x.py", line 3, in f') and pytest's ("x.py:3: RuntimeError").
    frames = _FRAME.findall(result.longrepr or "") + [(f, ln, "") for f, ln in _PYTEST_FRAME.findall(result.longrepr or "")]
    harness_dir = os.path.dirname(os.path.abspath(__file__))
    own = [f for f in frames if not os.path.abspath(f[0]).startswith(harness_dir + os.sep)]
    where = f" at {own[-1][0]}:{own[-1][1]}" + (f" in {own[-1][2]}" if own[-1][2] else "") if own else ""
    message = (result.message or "").strip().splitlines()
    return f"rank {root[0]} raised {result.exc_type or 'an exception'}{where}: {message[0] if message else ''}".rstrip(": ")


def _failure_diagnoses(exc: RanksFailed) -> list[Diagnosis]:
    """A rank died or raised: name a collective mismatch when the surviving ranks' traces or
    the backend's own abort message show one (gloo aborts on a size mismatch)."""
    found = _hang_diagnoses(exc.outcome)
    if found:
        return found
    outcome = exc.outcome
    texts = {r: log for r, log in getattr(outcome, "death_logs", {}).items()}
    texts.update({r: res.longrepr or res.message for r, res in getattr(outcome, "results", {}).items() if res.outcome == "failed"})
    for rank, text in sorted(texts.items()):
        line = next((ln.strip() for ln in (text or "").splitlines() if any(m in ln for m in _BACKEND_MISMATCH)), "")
        if line:
            return [Diagnosis(
                "collective-mismatch",
                f"rank {rank} aborted in the backend on a collective whose size differs between ranks: {line[-200:]}",
                {"rank": rank, "backend_message": line[-500:], "death": getattr(outcome, "deaths", {}).get(rank, ""),
                 "likely_source": "ranks issued collectives in different orders or with different shapes at the same position"},
            )]
    return []


def _hang_diagnoses(outcome: Any) -> list[Diagnosis]:
    try:
        from .tracing import diagnose_hang

        found = list(diagnose_hang(outcome))
    except ImportError:
        return []
    except Exception as err:  # noqa: BLE001 - the report itself must still come out
        print(f"harness: hang diagnosis failed: {type(err).__name__}: {err}", file=sys.stderr)
        return []
    # One finding per code: later ones are consequences of the first (the rank that never
    # came is blocked elsewhere); keep them as related evidence.
    out: list[Diagnosis] = []
    for d in found:
        first = next((o for o in out if o.code == d.code), None)
        if first is None:
            out.append(d)
        else:
            first.evidence.setdefault("related", []).append(d.summary)
    return out


def _hang_report(target: Target, world: int, steps: int | None, exc: RanksHung, work: str) -> DiagnosisReport:
    case = target.case if steps is None else target.case.replace(steps=steps)
    record, trace, recorded = _left_behind(work)
    return build_report(target=target, case=case, nproc=world, diagnoses=_hang_diagnoses(exc.outcome), hang=True,
                        actual=record, trace=trace, error=exc.report + _recorded_lines(recorded), recorded=recorded)


def _left_behind(work: str) -> tuple[Any, Any, dict[str, Any]]:
    """What a failed or hung run left in ``work``: the parallel record it published incomplete
    (steps done before the failure), the ranks' trace parts, and record folders still being
    written when the ranks were killed (their steps never published). Returns (record or None,
    trace or None, a JSON-able summary naming each folder)."""
    from reference.record import Record, RecordError

    from .diagnose import load_trace

    records, parts, unfinished = [], [], []
    chosen = trace = None
    for entry in sorted(Path(work).iterdir()) if os.path.isdir(work) else []:
        if not entry.is_dir():
            continue
        if ".partial-" in entry.name:
            unfinished.append(str(entry))
            if (entry / "meta.json").is_file() and chosen is None:  # checkpointed steps of a killed run
                try:
                    chosen = Record.load(entry)
                except RecordError:
                    pass
        elif entry.name.endswith(".trace"):
            parts.append(str(entry))
        elif (entry / "meta.json").is_file() and not entry.name.endswith(".replay"):
            try:
                record = Record.load(entry)
            except RecordError:
                continue
            records.append({"path": str(entry), "complete": record.complete, "steps": record.num_steps})
            chosen = chosen or record
    if chosen is not None and ".partial-" not in Path(chosen.path).name:
        trace = load_trace(str(Path(str(chosen.path) + ".trace"))) or load_trace(str(Path(chosen.path) / "trace.json"))
    if trace is None and parts:
        trace = load_trace(parts[0])
    recorded = {"records": records, "trace_parts": parts, "unfinished": unfinished} if (records or parts or unfinished) else {}
    return chosen, trace, recorded


def _recorded_lines(recorded: dict[str, Any]) -> str:
    lines = [f"recorded before the failure: {r['path']} ({r['steps']} steps, {'complete' if r['complete'] else 'incomplete'})"
             for r in recorded.get("records", [])]
    lines += [f"trace parts of the ranks: {p}" for p in recorded.get("trace_parts", [])]
    lines += [f"unfinished record (the ranks were stopped while writing; steps done so far are in it): {p}"
              for p in recorded.get("unfinished", [])]
    return ("\n\n" + "\n".join(lines)) if lines else ""
