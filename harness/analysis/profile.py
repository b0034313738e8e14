"""The profile of a correct run, from each rank's exported ``torch.profiler`` trace (torch-free:
plain trace events in, plain figures out).

Per rank and per profiled step (the ``harness.step#k`` annotation of
:mod:`harness.tracing.profiler`):

- compute: the union of the main thread's ATen operator events (``aten::*``; on CUDA, kernels
  that are not collectives), less collective calls and waits (``c10d::*``,
  ``_c10d_functional::*`` with its ``wait_tensor``): an enclosing event that is not an operator
  (an autograd node, a tensor subclass's dispatch, a user's autograd Function) may spend its
  own time waiting for a collective it issued, so only the operators inside it count;
- communication: the union of the backend's collective events - gloo runs each on a worker
  thread (``gloo:*``), NCCL as kernels (``nccl*``) - so a collective's time includes its wait for
  the peers: what a GPU utilisation figure misreads as work;
- overlap: compute and communication at once; exposed communication: communication less the
  overlap; busy: their union; idle = step - busy (so busy + idle = step by construction).

Collective counts and bytes are read from the backend's events (gloo: the tensor each
worker moved, its dims and element type) and checked against what the harness's own hooks
recorded for the same steps (:class:`~harness.tracing.tracer.Tracer`); a disagreement is
reported, never hidden. Peak memory: the largest ``Total Allocated`` of the profiler's
``[memory]`` events in the window (what the profiled steps allocated above what was held
before; CUDA ranks use ``torch.cuda.max_memory_allocated`` instead).

Pipelines: each stage's busy time is the union of its forward and backward chunks as the
schedule ran them (``harness.stage#<i>.forward`` / ``.backward``, annotated by the harness: the
schedules do not), else its compute; the rest of the step is its bubble, measured against GPipe's and 1F1B's ``(p - 1) / (m + p - 1)``. Timings on CPU are informational:
they move with the machine's load; the counts, bytes and the identities between figures do not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["ELEMENT_BYTES", "bubble_theory", "build_profile", "check_thresholds", "op_key", "rank_profile", "summarize_rank"]

from harness.record.custom import RECORDING_MARK
from harness.tracing.profiler import STAGE_MARK, STEP_MARK

# The profiler's element type names (its ``Input type`` args, C++ spellings), in bytes; the
# hooks' torch dtype names are counted by harness.tracing.records.record_bytes.
ELEMENT_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4, "short int": 2,
    "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}


def op_key(name: str) -> str:
    """One name for a collective however a layer spells it: ``c10d::_allgather_base_``,
    ``gloo:all_gather`` and the hooks' ``all_gather`` are all ``allgather``."""
    key = re.sub("[^a-z]", "", name.split(":")[-1].lower())
    for suffix in ("coalesced", "base", "tensor", "into"):
        key = key.removesuffix(suffix)
    return key


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _minus(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for a, b in x:
        cur = a
        for c, d in y:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _numel(dims: Any) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


# Collective calls on the main thread: issuing one, or waiting for its result (a functional
# collective's wait_tensor), is not compute, whatever op encloses it.
_COLLECTIVE_CALLS = ("c10d::", "_c10d_functional::", "_c10d_functional_autograd::", "c10d_functional::", "record_param_comms")


def _is_comm(event: dict[str, Any]) -> bool:
    name = event.get("name", "")
    return name.startswith("gloo:") or (event.get("cat") == "kernel" and "nccl" in name.lower())


def summarize_rank(events: list[dict[str, Any]], *, rank: int, hooks_saw: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank's figures from its trace ``events`` (module docstring); times in seconds."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in spans if str(e.get("name", "")).startswith(STEP_MARK)), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"rank {rank}: the trace has no {STEP_MARK}<k> annotation (no profiled step)")
    main = steps[0].get("tid")
    calls = _union((e["ts"], e["ts"] + e["dur"]) for e in spans
                   if e.get("tid") == main and str(e.get("name", "")).startswith(_COLLECTIVE_CALLS))
    compute_events = [e for e in spans if (e.get("cat") == "cpu_op" and e.get("tid") == main
                                           and str(e.get("name", "")).startswith("aten::"))
                      or (e.get("cat") == "kernel" and not _is_comm(e))]
    comm_events = [e for e in spans if _is_comm(e)]
    # A profiled loop's own recording by the harness (a custom loop's run.before_step /
    # after_step): not the loop's time, left out of every figure and of the step itself.
    recording = _union((e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("name") == RECORDING_MARK)
    compute_all = _minus(_minus(_union((e["ts"], e["ts"] + e["dur"]) for e in compute_events), calls), recording)
    comm_events = [e for e in comm_events if not any(a <= e["ts"] < b for a, b in recording)]
    comm_all = _minus(_union((e["ts"], e["ts"] + e["dur"]) for e in comm_events), recording)
    # A pipeline stage's forward and backward chunks as the schedule ran them (harness.tracing.profiler annotates them).
    stage_all = _union((e["ts"], e["ts"] + e["dur"]) for e in spans if str(e.get("name", "")).startswith(STAGE_MARK))
    per_step = []
    for s in steps:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        compute, comm = _clip(compute_all, lo, hi), _clip(comm_all, lo, hi)
        overlap = _length(_intersect(compute, comm))
        busy = _length(_union(compute + comm))
        length = s["dur"] - _length(_clip(recording, lo, hi))
        stage_work = _length(_clip(stage_all, lo, hi))
        per_step.append({"step": int(str(s["name"])[len(STEP_MARK):]), "step_s": length / 1e6,
                         "compute_s": _length(compute) / 1e6, "comm_s": _length(comm) / 1e6, "overlap_s": overlap / 1e6,
                         "busy_s": busy / 1e6, "idle_s": (length - busy) / 1e6,
                         "recording_s": (s["dur"] - length) / 1e6, "stage_busy_s": stage_work / 1e6 if stage_all else None})
    # The last profiled step's intervals relative to its start (ms), for the report's timeline:
    # what the rank computed, communicated and, in a pipeline, worked on as a stage.
    last = steps[-1]
    lo_last, hi_last = last["ts"], last["ts"] + last["dur"]

    def lane(intervals: list[tuple[float, float]]) -> list[list[float]]:
        return [[round((a - lo_last) / 1e3, 3), round((b - lo_last) / 1e3, 3)] for a, b in _clip(intervals, lo_last, hi_last)][:500]

    timeline = {"step": per_step[-1]["step"], "length_ms": last["dur"] / 1e3, "compute": lane(compute_all),
                "comm": lane(comm_all), "stage": lane(stage_all), "recording": lane(recording)}
    n = len(per_step)
    mean = {k: sum(p[k] for p in per_step) / n for k in ("step_s", "compute_s", "comm_s", "overlap_s", "busy_s", "idle_s")}
    mean["stage_busy_s"] = sum(p["stage_busy_s"] for p in per_step) / n if stage_all else None
    lo, hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    # What the backend moved, per collective kind: count and bytes.
    collectives: dict[str, dict[str, Any]] = {}
    for e in comm_events:
        if not lo <= e["ts"] <= hi:
            continue
        args = e.get("args") or {}
        dims, types = args.get("Input Dims") or [], args.get("Input type") or []
        size = sum(_numel(d) * ELEMENT_BYTES.get(t, 0) for d, t in zip(dims, types) if isinstance(d, list))
        c = collectives.setdefault(op_key(e["name"]), {"count": 0, "bytes": 0})
        c["count"] += 1
        c["bytes"] += size
    hooks: dict[str, dict[str, Any]] = {}
    by_group: dict[str, dict[str, Any]] = {}
    for h in hooks_saw:  # each with its bytes as harness.tracing.records.record_bytes counts them
        for totals, key in ((hooks, op_key(h["op"])), (by_group, f"{h['group']} {h['group_ranks']}")):
            c = totals.setdefault(key, {"count": 0, "bytes": 0})
            c["count"] += 1
            c["bytes"] += h["bytes"]
    disagree = {k: {"profiler": collectives.get(k), "hooks": hooks.get(k)} for k in sorted(set(collectives) | set(hooks))
                if collectives.get(k) != hooks.get(k)}
    peaks = [float((e.get("args") or {}).get("Total Allocated", 0)) for e in events
             if e.get("name") == "[memory]" and lo <= e.get("ts", lo - 1) <= hi]
    return {
        "rank": rank, "steps": per_step, **mean, "exposed_comm_s": mean["comm_s"] - mean["overlap_s"], "timeline": timeline,
        "collectives": collectives, "collectives_by_group": by_group, "hooks_collectives": hooks,
        "collectives_agree": not disagree, "collectives_disagree": disagree,
        "peak_bytes": int(max(peaks)) if peaks else None,
        "peak_source": "largest Total Allocated of the profiler's [memory] events in the profiled steps "
                       "(allocated above what was held before them)" if peaks else "no [memory] events",
    }


def rank_profile(recorded: dict[str, Any]) -> dict[str, Any]:
    """A rank's figures from what :func:`harness.tracing.profiler.profile_strategy` returned
    (its trace file read here, on the rank that wrote it)."""
    with open(recorded["trace"]) as fh:
        events = json.load(fh).get("traceEvents", [])
    out = summarize_rank(events, rank=recorded["rank"], hooks_saw=recorded["hooks_saw"])
    out.update({k: recorded[k] for k in ("trace", "tokens", "state_bytes", "state_arithmetic", "stages", "mesh")})
    if recorded.get("cuda_peak_bytes") is not None:
        out["peak_bytes"] = recorded["cuda_peak_bytes"]
        out["peak_source"] = "torch.cuda.max_memory_allocated over the profiled steps"
    return out


def bubble_theory(stages: int, micro_batches: int) -> float:
    """GPipe's and 1F1B's bubble fraction ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)


def build_profile(result: dict[str, Any], *, steps: int, warmup: int) -> dict[str, Any]:
    """The run's profile from every rank's summary (``result`` as
    :func:`harness.pipeline.profile_on_rank` returns it)."""
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    slowest = max(ranks, key=lambda r: r["step_s"])
    fastest = min(ranks, key=lambda r: r["step_s"])
    step_s = slowest["step_s"]  # a step ends when its slowest rank's does
    # Tokens: each data-parallel replica's first rank (mesh coordinate 0 on every other dim) reads its own.
    readers = [r for r in ranks if all(v == 0 for k, v in (r.get("mesh") or {}).items() if k not in ("dp", "dp_shard", "dp_replicate"))]
    tokens = sum(r["tokens"] for r in readers) / steps if readers else 0
    out: dict[str, Any] = {
        "steps": steps, "warmup": warmup, "ranks": {r["rank"]: r for r in ranks},
        "slowest_rank": slowest["rank"], "step_s": step_s,
        "spread": (slowest["step_s"] - fastest["step_s"]) / slowest["step_s"] if slowest["step_s"] else 0.0,
        "samples_per_s": result["global_batch_size"] / step_s if step_s else None,
        "tokens_per_s": tokens / step_s if tokens and step_s else None,
        "collectives_agree": all(r["collectives_agree"] for r in ranks),
        "informational": "timings on CPU move with the machine's load; counts, bytes and the identities between figures do not",
    }
    staged = [r for r in ranks if r.get("stages")]
    if staged:
        p = 1 + max(max(r["stages"]) for r in staged)
        m = int(result["micro_batches"])
        per_stage = {}
        for r in staged:
            # busy: the stage's forward and backward chunks as the schedule ran them; without
            # those annotations, its compute
            busy = r["stage_busy_s"] if r.get("stage_busy_s") is not None else r["compute_s"]
            idle = r["step_s"] - busy
            per_stage[str(r["stages"])] = {"rank": r["rank"], "busy_s": busy, "idle_s": idle,
                                           "fraction": idle / r["step_s"] if r["step_s"] else 0.0,
                                           "busy_from": "stage forward/backward chunks" if r.get("stage_busy_s") is not None
                                           else "compute"}
        fractions = [s["fraction"] for s in per_stage.values()]
        busy = [s["busy_s"] for s in per_stage.values()]
        out["bubble"] = {"stages": p, "micro_batches": m, "theory": bubble_theory(p, m),
                         "measured": {"per_stage": per_stage, "mean": sum(fractions) / len(fractions)},
                         "imbalance": max(busy) / min(busy) if min(busy) > 0 else None}
    return out


def check_thresholds(profile: dict[str, Any], *, max_exposed_comm: float | None = None,
                     max_bubble_over: float | None = None) -> list[str]:
    """Opt-in limits, for runners whose timings mean something (GPUs, not a shared CPU):
    ``max_exposed_comm``, the largest fraction of a rank's step spent in communication that no
    compute overlaps; ``max_bubble_over``, how far the mean pipeline bubble may sit above
    (p-1)/(m+p-1). Returns one sentence per limit exceeded (none: within)."""
    out = []
    if max_exposed_comm is not None:
        for r in profile["ranks"].values():
            share = r["exposed_comm_s"] / r["step_s"] if r["step_s"] else 0.0
            if share > max_exposed_comm:
                out.append(f"rank {r['rank']}: exposed communication is {share:.0%} of its step, above the "
                           f"--max-exposed-comm {max_exposed_comm:.0%}")
    bubble = profile.get("bubble")
    if max_bubble_over is not None and bubble is not None:
        over = bubble["measured"]["mean"] - bubble["theory"]
        if over > max_bubble_over:
            out.append(f"the pipeline bubble {bubble['measured']['mean']:.2f} is {over:.2f} above (p-1)/(m+p-1) = "
                       f"{bubble['theory']:.2f}, more than --max-bubble-over {max_bubble_over:.2f}")
    return out
