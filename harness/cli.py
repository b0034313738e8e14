"""``python -m harness``: diagnose a parallel training target, or the bundled catalogue.

    python -m harness diagnose TARGET [--nproc N] [--steps K] [--json PATH] [--html PATH] [--trace PATH]
    python -m harness diagnose TARGET --simulate N   # N simulated ranks in one process (DTensor targets)
    python -m harness diagnose            # no TARGET: the bundled demo (every bug case + correct strategies)
    python -m harness diagnose --simulate 8   # the 8-rank mesh demo on simulated ranks
    python -m harness list                # bundled targets and the code each must be diagnosed with

Exit status: 0 PASS, 1 a diagnosis (or a run that failed before it could be compared), 2 usage
error, 3 hang. In the demo: 0 when every bug case is named with its expected code and every
correct strategy passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from harness import settings

__all__ = ["main"]

EXIT_PASS, EXIT_DIAGNOSIS, EXIT_USAGE, EXIT_HANG = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description="Correctness and debugging harness for parallel training.")
    sub = parser.add_subparsers(dest="command")
    d = sub.add_parser("diagnose", help="run a target on N ranks against the single-device reference and name what is wrong")
    d.add_argument("target", nargs="?", help="bundled name, path/to/file.py or path/to/file.py:NAME (omit for the bundled demo)")
    d.add_argument("--nproc", type=int, default=None, help="ranks to run (default: the target's NPROC, else 2)")
    d.add_argument("--simulate", type=int, default=None, metavar="N",
                   help="run on N simulated ranks in this process (DTensor targets: tensor parallelism, replicate, "
                        "their meshes) instead of N real ones; without TARGET: the 8-rank mesh demo")
    d.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the case's)")
    d.add_argument("--repeat", type=int, default=None, metavar="N",
                   help="determinism gate: run N times, each on fresh ranks, and compare the runs bitwise per step, rank "
                        "and tensor (default: the target's REPEAT, else 1)")
    d.add_argument("--resume-at", type=int, default=None, metavar="K",
                   help="resume check: save a checkpoint after step K-1, load it on fresh ranks, train K..end; the load "
                        "is compared bitwise with what was saved, the continuation with the uninterrupted run "
                        "(default: the target's RESUME_AT)")
    d.add_argument("--resume-into", default=None, metavar="TARGET2",
                   help="with --resume-at: load the checkpoint into TARGET2 (another strategy or world size) instead")
    d.add_argument("--resume-nproc", type=int, default=None, metavar="N",
                   help="with --resume-at: ranks of the resumed run (default: TARGET2's NPROC, else --nproc)")
    d.add_argument("--json", metavar="PATH", help="write the JSON report here")
    d.add_argument("--html", metavar="PATH", help="write the self-contained HTML report here")
    d.add_argument("--trace", metavar="PATH", help="write the collective timeline as Chrome-trace JSON here")
    d.add_argument("--out", metavar="DIR", default="harness-reports", help="directory for the reports: every target's in the demo, a TARGET's when no --json/--html/--trace is given (default harness-reports)")
    d.add_argument("--timeout", type=float, default=None, help=f"seconds before a run counts as hung (default: the target's TIMEOUT, else {settings.RUN_TIMEOUT_S:g})")
    d.add_argument("--stall-window", type=float, default=None, metavar="S",
                   help="seconds without progress on every running rank before a run counts as hung (default: the target's STALL_WINDOW, "
                        f"else {settings.STALL_WINDOW_S:g}; 0: only --timeout)")
    d.add_argument("--backend", choices=settings.BACKENDS, default="auto", help="process-group backend (default auto)")
    d.add_argument("--device", choices=settings.DEVICES, default="auto", help="rank device (default auto)")
    d.add_argument("--tolerance", choices=settings.TOLERANCE_MODES, default="auto",
                   help="auto/calibrated: from the reference's own measured noise (default); default: fixed per-dtype tolerances")
    d.add_argument("--comparison", choices=settings.COMPARISON_MODES, default="stepwise",
                   help="stepwise: each step from the run's own state (default); trajectory: whole trajectories")
    d.add_argument("--cache", metavar="DIR", default=None, help="reference cache (default $HARNESS_CACHE_DIR or ./.harness_cache)")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    d.add_argument("-v", "--verbose", action="store_true", help="full comparison and launcher report")
    lay = sub.add_parser("layout", help="check a (dp, tp, pp) layout on simulated ranks: mesh, groups, samples, "
                                           "memory and collectives per rank (any size, 64 ranks and beyond)")
    for dim in ("dp", "tp", "pp"):
        lay.add_argument(f"--{dim}", type=int, default=1, help=f"{dim} degree (default 1)")
    lay.add_argument("--global-batch", type=int, default=None, help="global batch (default 4 samples per replica micro-batch)")
    lay.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default 2*pp, 1 without a pipeline)")
    lay.add_argument("--heads", type=int, default=None,
                     help="the model's attention heads (default: the fewest >= 4 that tp divides)")
    lay.add_argument("--layers", type=int, default=None, help="the model's layers (default: the fewest >= 4 that pp divides)")
    lay.add_argument("--json", metavar="PATH", help="write the layout report as JSON here")
    lay.add_argument("--all-ranks", action="store_true", help="list every rank (default: one row per distinct figures)")
    lay.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    sub.add_parser("list", help="list bundled targets")
    prof = sub.add_parser("profile", help="step 5 of the method: diagnose TARGET, then profile K steps on every rank "
                                          "(compute, communication, overlap, collectives, memory, pipeline bubble)")
    prof.add_argument("target", help="bundled name, path/to/file.py or path/to/file.py:NAME (a strategy or a train(ctx, run) loop)")
    prof.add_argument("--nproc", type=int, default=None, help="ranks to run (default: the target's NPROC, else 2)")
    prof.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    prof.add_argument("--warmup", type=int, default=1, help="unprofiled steps before them (default 1)")
    prof.add_argument("--json", metavar="PATH", help="write the verdict and the profile as JSON here")
    prof.add_argument("--html", metavar="PATH", help="write the profile as a self-contained HTML page here")
    prof.add_argument("--out", metavar="DIR", default="harness-reports",
                      help="each rank's Chrome trace goes to DIR/profile-TARGET/rank<r>.json (default harness-reports)")
    prof.add_argument("--max-exposed-comm", type=float, default=None, metavar="FRACTION",
                      help="opt-in, for GPU runners: fail (exit 1) when a rank's exposed communication exceeds this "
                           "fraction of its step (CPU timings are informational: no limit by default)")
    prof.add_argument("--max-bubble-over", type=float, default=None, metavar="X",
                      help="opt-in, for GPU runners: fail (exit 1) when the mean pipeline bubble exceeds (p-1)/(m+p-1) by more than X")
    prof.add_argument("--timeout", type=float, default=None, help=f"seconds before a run counts as hung (default {settings.RUN_TIMEOUT_S:g})")
    prof.add_argument("--cache", metavar="DIR", default=None, help="reference cache (default $HARNESS_CACHE_DIR or ./.harness_cache)")
    prof.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return parser


def _profile(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``profile``: the verdict first (a profile of a wrong run is a profile of the wrong
    program), then the profiled steps on the same warm ranks."""
    import json

    from harness.launch.remote import RankRunner
    from harness.pipeline import check_profilable, diagnose_target, profile_target
    from harness.report import format_terminal
    from harness.analysis.profile import check_thresholds
    from harness.report.profile import format_profile, render_profile_html
    from reference.files import write_atomic
    from harness.targets.bundled import load_target
    from harness.targets.target import TargetError

    if args.steps < 1 or args.warmup < 0:
        return _usage(parser, f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.nproc is not None and args.nproc < 1:
        return _usage(parser, f"--nproc must be >= 1, got {args.nproc}")
    try:
        target = check_profilable(load_target(args.target))
    except TargetError as exc:
        return _usage(parser, str(exc))
    runner = RankRunner()
    try:
        report = diagnose_target(args.target, nproc=args.nproc, runner=runner, timeout=args.timeout, cache=args.cache,
                                 echo=_echo(args.quiet))
        print(format_terminal(report))
        _echo(args.quiet)(f"profile: {args.warmup} warm-up and {args.steps} profiled steps on every rank")
        profile = profile_target(args.target, nproc=args.nproc, steps=args.steps, warmup=args.warmup, runner=runner,
                                 timeout=args.timeout, trace_dir=os.path.join(args.out, f"profile-{target.name}"))
    finally:
        runner.close()
    print(format_profile(profile))
    exceeded = check_thresholds(profile, max_exposed_comm=args.max_exposed_comm, max_bubble_over=args.max_bubble_over)
    profile["thresholds_exceeded"] = exceeded
    for line in exceeded:
        print(f"  LIMIT  {line}")
    if args.json:
        write_atomic(args.json, json.dumps({"verdict": report.verdict.to_dict(), "profile": profile}, indent=2, default=str))
        print(f"  wrote {args.json}")
    if args.html:
        write_atomic(args.html, render_profile_html(profile, verdict=report.verdict.to_dict(), page=args.html))
        print(f"  wrote {args.html}")
    return report.exit_code if report.exit_code or not exceeded else EXIT_DIAGNOSIS


def _interrupted(exc: KeyboardInterrupt) -> int:
    """Ctrl-C or SIGTERM: say so, and what the run had recorded (kept on disk); 130 / 143."""
    from harness.launch.procs import Terminated

    print(f"interrupted{' (SIGTERM)' if isinstance(exc, Terminated) else ''}{getattr(exc, 'left_behind', '')}",
          file=sys.stderr, flush=True)
    return exc.exit_code if isinstance(exc, Terminated) else 130


def _usage(parser: argparse.ArgumentParser, message: str) -> int:
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _echo(quiet: bool):
    def echo(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    return echo


def _write_reports(report: Any, json_path: str | None, html_path: str | None, trace_path: str | None) -> list[str]:
    from harness.report import write_chrome_trace, write_html

    written = []
    if json_path:
        written.append(f"json {report.write_json(json_path)}")
    if trace_path:  # before the page that links it
        written.append(f"trace {write_chrome_trace(report, trace_path)}")
    if html_path:
        written.append(f"html {write_html(report, html_path, trace=trace_path)}")
    return written


def _run_layout(plan: Any, json_path: str | None, echo: Any, *, all_ranks: bool = False) -> Any:
    """Check ``plan``, print the report and write its JSON to ``json_path`` (if given)."""
    from harness.simulate.layout import check_layout, format_layout

    report = check_layout(plan, echo=echo)
    print(format_layout(report, all_ranks=all_ranks), flush=True)
    if json_path:
        from reference.files import write_atomic

        write_atomic(json_path, json.dumps(report.to_json(), indent=2, default=str))
    return report


def _check_layout(plan: Any, json_path: str | None, all_ranks: bool, quiet: bool) -> int:
    report = _run_layout(plan, json_path, _echo(quiet), all_ranks=all_ranks)
    if json_path:
        print(f"  wrote json {json_path}")
    return report.exit_code


def _layout(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cases.layouts import layout_plan
    from harness.parallel_dims import ParallelConfigError

    for flag in ("dp", "tp", "pp", "global_batch", "micro_batches", "heads", "layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            return _usage(parser, f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    try:
        plan = layout_plan(args.dp, args.tp, args.pp, global_batch=args.global_batch, micro_batches=args.micro_batches,
                           heads=args.heads, layers=args.layers)
    except ParallelConfigError as exc:
        return _usage(parser, str(exc))
    return _check_layout(plan, args.json, args.all_ranks, args.quiet)


def _diagnose_one(args: argparse.Namespace, runner: Any) -> int:
    from harness.report import format_terminal
    from harness.pipeline import diagnose_target

    report = diagnose_target(
        args.target, nproc=args.nproc, steps=args.steps, runner=runner, timeout=args.timeout,
        cache=args.cache, echo=_echo(args.quiet), tolerance=args.tolerance, comparison=args.comparison,
        stall_window=args.stall_window, repeat=args.repeat,
        resume_at=args.resume_at, resume_into=args.resume_into, resume_nproc=args.resume_nproc,
    )
    print(format_terminal(report, verbose=args.verbose))
    _write_one(args, report)
    return report.exit_code


def _write_one(args: argparse.Namespace, report: Any) -> None:
    """One target's reports: where --json/--html/--trace say, else all three under --out
    (harness-reports/NAME.*), ending with the line to open."""
    from harness.report.html import report_path

    json_path, html_path, trace_path = args.json, args.html, args.trace
    if not (json_path or html_path or trace_path):
        html = report_path(args.out, None, report.target.get("name") or "report")
        html.parent.mkdir(parents=True, exist_ok=True)
        json_path, html_path, trace_path = str(html.with_suffix(".json")), str(html), str(html.with_suffix(".trace.json"))
    for line in _write_reports(report, json_path, html_path, trace_path):
        print(f"  wrote {line}")
    if html_path:
        print(f"open {html_path}")


def _simulate(args: argparse.Namespace, name: str) -> Any:
    """The report of ``name`` on ``args.simulate`` simulated ranks (raises SimulationError or
    ParallelConfigError when it cannot be simulated at that size)."""
    from harness.pipeline import simulate_target
    from harness.targets.bundled import load_target

    return simulate_target(load_target(name), args.simulate, steps=args.steps, cache=args.cache, tolerance=args.tolerance,
                           comparison=args.comparison, echo=_echo(args.quiet))


def _simulate_one(args: argparse.Namespace) -> int:
    from harness.parallel_dims import ParallelConfigError
    from harness.report import format_terminal
    from harness.simulate.world import SimulationError

    try:
        report = _simulate(args, args.target)
    except SimulationError as exc:
        print(f"python -m harness: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ParallelConfigError as exc:
        print(f"python -m harness: error: {args.target} does not fit {args.simulate} simulated ranks: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(format_terminal(report, verbose=args.verbose))
    _write_one(args, report)
    return report.exit_code


def _demo(args: argparse.Namespace, runner: Any) -> int:
    from harness.report import format_terminal
    from harness.report.html import render_index
    from harness.report.summary import summarize
    from harness.pipeline import diagnose_target

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    echo = _echo(args.quiet)
    rows = []
    started = time.monotonic()
    from harness.targets.bundled import demo_targets, load_target

    if args.simulate is not None:
        from cases.mesh_targets import SIMULATION_DEMO

        targets = SIMULATION_DEMO
    else:
        targets = demo_targets()
    for i, (name, expected) in enumerate(targets, 1):
        echo(f"[{i}/{len(targets)}] {name}")
        plan = load_target(name).layout
        where = ""
        if plan is not None:
            layout = _run_layout(plan, str(out / f"{name}.json"), echo)
            verdict, codes = ("fail" if layout.diagnoses else "pass"), list(dict.fromkeys(layout.codes))
        else:
            if args.simulate is not None:
                report = _simulate(args, name)
            else:
                report = diagnose_target(name, nproc=args.nproc, steps=args.steps, runner=runner, timeout=args.timeout,
                                         cache=args.cache, echo=echo, tolerance=args.tolerance, comparison=args.comparison,
                                         stall_window=args.stall_window, repeat=args.repeat)
            print(format_terminal(report, verbose=args.verbose), flush=True)
            _write_reports(report, str(out / f"{name}.json"), str(out / f"{name}.html"), str(out / f"{name}.trace.json"))
            verdict, codes = report.verdict.verdict, report.codes
            where = summarize(report).where
        ok = (expected in codes) if expected else verdict == "pass"
        rows.append({"target": name, "expected": expected or "PASS", "verdict": verdict, "codes": codes, "ok": ok,
                     "where": where})
    width = max(len(r["target"]) for r in rows)
    print(f"\nbundled {'simulated ' if args.simulate is not None else ''}demo: {len(rows)} targets in {time.monotonic() - started:.0f} s; reports in {out}/")
    for r in rows:
        print(f"  {'ok ' if r['ok'] else 'BAD'} {r['target']:<{width}}  expected {r['expected']:<28} got {r['verdict'].upper()} {' '.join(r['codes'])}")
    from reference.files import write_atomic

    write_atomic(out / "index.json", json.dumps(rows, indent=2))
    write_atomic(out / "index.html", render_index(rows, out))
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} named as expected" + (f"; wrong: {', '.join(r['target'] for r in bad)}" if bad else ""))
    print(f"open {out / 'index.html'}")
    return EXIT_PASS if not bad else EXIT_DIAGNOSIS


def _list() -> int:
    from harness.targets.bundled import bug_codes, bundled_targets, load_target

    codes = bug_codes()
    for name, module in sorted(bundled_targets().items()):
        kind = codes.get(name, "") or ("(alias)" if module.rsplit(".", 1)[-1] in codes else "")
        where = ""
        if not kind:  # a cases.targets entry: its own expected code, and how it runs
            target = load_target(name)
            kind = target.expected_code or "correct"
            if target.layout is not None:
                where = f"layout check, {target.layout.dims.world_size} simulated ranks"
            elif (target.nproc or 2) > 4:
                where = f"{target.nproc} ranks: --simulate {target.nproc} on a small machine"
        print(f"{name:<32} {kind:<28} {where}".rstrip())
    return EXIT_PASS


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command == "layout":
        sys.path.insert(0, os.getcwd())
        return _layout(args, parser)
    if args.command == "profile":
        sys.path.insert(0, os.getcwd())
        return _profile(args, parser)
    if args.command == "list":
        try:
            return _list()
        except BrokenPipeError:  # `python -m harness list | head`: the reader left, nothing is wrong
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_PASS
    if args.nproc is not None and args.nproc < 1:
        return _usage(parser, f"--nproc must be >= 1, got {args.nproc}")
    if args.simulate is not None:
        if args.nproc is not None:
            return _usage(parser, "give --nproc N (real ranks) or --simulate N (simulated ranks), not both")
        if not 1 <= args.simulate <= 1024:
            return _usage(parser, f"--simulate must be between 1 and 1024 ranks, got {args.simulate}")
        if args.target is None and args.simulate != 8:
            return _usage(parser, f"the simulated demo runs the 8-rank mesh targets: --simulate 8 (got {args.simulate})")
    if args.nproc is not None:
        from harness.launch.pool import check_world_size

        try:
            check_world_size(args.nproc)
        except ValueError as exc:
            return _usage(parser, f"--nproc: {exc}")
    if args.timeout is not None and not (args.timeout > 0 and math.isfinite(args.timeout)):
        return _usage(parser, f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    if args.steps is not None and args.steps < 1:
        return _usage(parser, f"--steps must be >= 1, got {args.steps}")
    if args.repeat is not None and args.repeat < 1:
        return _usage(parser, f"--repeat must be >= 1 (the runs compared bitwise), got {args.repeat}")
    if args.repeat is not None and args.simulate is not None:
        return _usage(parser, "--repeat runs real ranks afresh each time; it does not apply to --simulate")
    if args.resume_at is not None and args.resume_at < 1:
        return _usage(parser, f"--resume-at must be >= 1 (the checkpoint is saved after step K-1), got {args.resume_at}")
    if (args.resume_into is not None or args.resume_nproc is not None) and args.resume_at is None:
        return _usage(parser, "--resume-into / --resume-nproc need --resume-at K")
    if args.resume_at is not None and (args.simulate is not None or args.repeat is not None or args.target is None):
        return _usage(parser, "--resume-at checks one TARGET on real ranks; it does not combine with --simulate, --repeat or the demo")
    if args.resume_nproc is not None:
        from harness.launch.pool import check_world_size

        try:
            check_world_size(args.resume_nproc)
        except ValueError as exc:
            return _usage(parser, f"--resume-nproc: {exc}")
    if args.target is None and (args.json or args.html or args.trace):
        return _usage(parser, "--json/--html/--trace need a TARGET; the demo writes every report under --out")
    for flag, path in (("--json", args.json), ("--html", args.html), ("--trace", args.trace)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            return _usage(parser, f"{flag} {path}: the folder {folder} does not exist or is not writable")
    if args.target is not None and not (args.json or args.html or args.trace):
        # The reports go under --out: refused now, not after the run, where it cannot be made.
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as exc:
            return _usage(parser, f"--out {args.out}: cannot make the folder for the reports ({exc.strerror})")
        if not os.access(args.out, os.W_OK):
            return _usage(parser, f"--out {args.out}: the folder is not writable")
    sys.path.insert(0, os.getcwd())  # bundled `cases` and the user's own modules resolve from here
    from harness.launch.procs import terminate_as_interrupt
    from harness.launch.remote import RankRunner
    from harness.targets.bundled import load_target
    from harness.targets.target import TargetError

    if args.target is not None:
        try:
            resolved = load_target(args.target)
        except TargetError as exc:
            return _usage(parser, str(exc))
        if resolved.layout is not None:  # a layout check: always on simulated ranks, at the plan's size
            world = resolved.layout.dims.world_size
            if (args.nproc or args.simulate or world) != world:
                return _usage(parser, f"{args.target} is a layout check of {world} ranks; give no --nproc/--simulate (or {world})")
            if args.html or args.trace:
                return _usage(parser, f"{args.target} is a layout check: it writes --json only")
            return _check_layout(resolved.layout, args.json, False, args.quiet)
    if args.stall_window is not None and not (args.stall_window >= 0 and math.isfinite(args.stall_window)):
        return _usage(parser, f"--stall-window must be a finite number of seconds >= 0, got {args.stall_window}")
    if args.simulate is not None:
        restore = terminate_as_interrupt()
        try:
            return _simulate_one(args) if args.target is not None else _demo(args, None)
        except KeyboardInterrupt as exc:
            return _interrupted(exc)
        finally:
            restore()
    runner = RankRunner(backend=args.backend, device=args.device)
    restore = terminate_as_interrupt()
    try:
        return _diagnose_one(args, runner) if args.target is not None else _demo(args, runner)
    except TargetError as exc:  # arguments the target cannot honour (--resume-at out of range, ...)
        return _usage(parser, str(exc))
    except KeyboardInterrupt as exc:
        return _interrupted(exc)
    finally:
        runner.close()
        restore()
