"""Benchmark (not a test): the pipeline bubble of GPipe against 1F1B for m = 2, 4, 8 micro-
batches on 2 stages, measured by ``python -m harness profile``'s figures and set beside the
formula (p - 1) / (m + p - 1), in one run.

The pipeline's compute must dominate each micro-batch's fixed costs (the schedule's Python, the
p2p handshakes) for the bubble to mean anything: the transformer here is widened (``--dim``,
hidden 4x) and each micro-batch holds ``--per-micro`` sequences of 16 tokens, so that a
micro-batch costs milliseconds of matmuls. Each stage's bubble is its step time less its
compute, over its step time; the mean over stages is printed. Figures move with the machine's
load (CPU timings are informational); nothing is asserted.

    python tests/bench/bench_bubble.py [--dim 256] [--per-micro 16] [--steps 3]
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
from pathlib import Path

from harness.analysis.profile import bubble_theory
from harness.launch.remote import RankRunner
from harness.pipeline import profile_target

TARGET = '''
from cases.catalog import transformer_case
from cases.strategies.pipeline import PipelineStrategy

CASE = transformer_case(micro_batches={m}, global_batch_size={batch}, num_samples={samples}, seq_len=16,
                        dim={dim}, hidden={hidden}, heads=4, layers=4, name="wide-pp-m{m}")
STRATEGY = PipelineStrategy("{schedule}")
NPROC = 2
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--per-micro", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-bubble-"))
    rows = []
    runner = RankRunner()
    try:
        for m in (2, 4, 8):
            for schedule in ("gpipe", "1f1b"):
                path = work / f"{schedule}_m{m}.py"
                batch = m * args.per_micro
                path.write_text(textwrap.dedent(TARGET.format(m=m, batch=batch, samples=batch * (args.steps + 1), dim=args.dim,
                                                              hidden=4 * args.dim, schedule=schedule)))
                p = profile_target(str(path), steps=args.steps, warmup=1, runner=runner, trace_dir=work / path.stem)
                b = p["bubble"]
                per = b["measured"]["per_stage"]
                rows.append((schedule, m, p["step_s"], per["[0]"]["fraction"], per["[1]"]["fraction"], b["measured"]["mean"],
                             bubble_theory(2, m), p["collectives_agree"]))
    finally:
        runner.close()
    print(f"2 stages, dim {args.dim}, {args.per_micro} sequences of 16 tokens per micro-batch, {args.steps} profiled steps")
    print(f"{'schedule':>8} {'m':>3} {'step ms':>8} {'stage 0':>8} {'stage 1':>8} {'mean':>6} {'theory':>7} {'ratio':>6}  bytes agree")
    for schedule, m, step, s0, s1, mean, theory, agree in rows:
        print(f"{schedule:>8} {m:>3} {step * 1e3:>8.1f} {s0:>8.2f} {s1:>8.2f} {mean:>6.2f} {theory:>7.2f} {mean / theory:>6.2f}  {agree}")


if __name__ == "__main__":
    main()
