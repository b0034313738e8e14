"""Run a command while busy processes load the CPU, as on a CI runner shared with other jobs.

    python tests/under_load.py [--busy N] -- COMMAND...

starts N processes that spin at 100% of a core each (default: one per core, so the machine is
at twice its load), runs COMMAND, stops them, and exits with COMMAND's status. Verdicts must
not change under it: ``python tests/under_load.py -- python -m harness diagnose`` (the main
job) and ``python tests/under_load.py -- python tests/fault_matrix.py`` (the scored fault
matrix) are the checks README names.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys


def _spin() -> None:
    os.nice(0)  # an ordinary competitor: the same priority as the job under test
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="spinning processes (default: one per core)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.busy < 0:
        parser.error(f"--busy must be >= 0, got {args.busy}")
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    print(f"under_load: {args.busy} busy processes on {os.cpu_count()} cores; running {' '.join(command)}", file=sys.stderr, flush=True)
    try:
        return subprocess.call(command)
    finally:
        for p in spinners:
            p.terminate()
        for p in spinners:
            p.join(5)


if __name__ == "__main__":
    sys.exit(main())
