"""Sample-id checks: did the data-parallel replicas split the data as the reference consumed it?

The ids come from the run's record (``StepRecord.rank_sample_ids``, recorded per rank, step
and micro-batch by :class:`~harness.record.recorder.RankRecorder` for the harness's cases) or from
a trace (``RankTrace.samples``, recorded by ``trace_samples`` for a user's own loader); the
replica of each rank from its layout (``dp_rank``). With the mesh known:

- ``inconsistent-replica-inputs``: ranks of one data-parallel replica (a tensor-parallel group,
  the stages of one pipeline) must consume the same ids in the same micro-batch;
- ``duplicate-samples``: within an epoch no sample may be consumed twice, neither by two
  replicas nor twice by one (the id, the ranks and the steps are named);
- ``dropped-samples``: together the replicas must consume every sample the reference consumed
  in the steps both ran.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from functools import reduce
from typing import Any

from harness.codes import Diagnosis

__all__ = ["check_sample_ids", "check_samples"]

MAX_IDS = 50


def _steps_per_epoch(*metas: Mapping[str, Any] | None) -> int | None:
    for meta in metas:
        case = (meta or {}).get("case") or {}
        n, b = case.get("dataset_len"), case.get("global_batch_size")
        if isinstance(n, int) and isinstance(b, int) and b > 0 and n >= b:
            return n // b
    return None


def check_samples(record: Any, reference: Any = None, trace: Any = None) -> list[Diagnosis]:
    """Sample-id diagnoses for a parallel run.

    ``record`` is the run's :class:`~reference.record.Record` (or None to use ``trace``'s
    samples); ``reference`` the reference record (needed for ``dropped-samples``)."""
    per_rank: dict[int, dict[int, list[list[int]]]] = defaultdict(dict)
    replica: dict[int, int] = {}
    meta: Mapping[str, Any] = {}
    if record is not None:
        meta = record.meta
        for step in record.steps:
            for rank, micro in step.rank_sample_ids.items():
                per_rank[int(rank)][step.step] = [list(m) for m in micro]
        for layout in record.meta.get("ranks", []) or []:
            replica[int(layout["rank"])] = int(layout.get("dp_rank", layout["rank"]))
    if not per_rank and trace is not None:
        for rank, rt in trace.ranks.items():
            per_rank[rank] = {int(s): [list(m) for m in micro] for s, micro in rt.samples.items()}
            if "dp_rank" in rt.layout:
                replica[rank] = int(rt.layout["dp_rank"])
    if not per_rank:
        return []
    for rank in per_rank:
        replica.setdefault(rank, rank)
    expected: dict[int, list[int]] | None = None
    if reference is not None:
        expected = {s.step: list(s.sample_ids) for s in reference.steps}
    spe = _steps_per_epoch(getattr(reference, "meta", None), meta)
    return check_sample_ids(per_rank, replica, expected, steps_per_epoch=spe)


def _step_batch_sizes(
    per_rank: Mapping[int, Mapping[int, Sequence[Sequence[int]]]],
    members: Mapping[int, list[int]],
    expected: Mapping[int, Sequence[int]],
    steps: Sequence[int],
) -> list[Diagnosis]:
    """The reference's sample sequence consumed without a sample twice or one skipped, but cut
    into optimizer steps of another size (a framework accumulating 4 micro-batches where the
    case says 2): one finding with what each replica consumed, ahead of the ids and values it
    moves. A sampler that duplicates, drops or mixes samples changes the counts too; that is
    the other checks' finding, never this one."""

    def consumed(step: int) -> dict[int, list[int]] | None:
        """Each replica's ids of the step; None where the ranks of one replica disagree."""
        out: dict[int, list[int]] = {}
        for rep, ranks in members.items():
            per = {tuple(i for m in per_rank[r].get(step) or [] for i in m) for r in ranks}
            if len(per) > 1:
                return None
            out[rep] = list(next(iter(per)))
        return out

    for step in steps:
        by_replica = consumed(step)
        if by_replica is None:
            continue
        want, ids = list(expected[step]), [i for rep_ids in by_replica.values() for i in rep_ids]
        if not ids or len(ids) == len(want):
            continue
        here, got = set(want), set(ids)
        earlier = {i for s, e in expected.items() if s < step for i in e}
        later = {i for s, e in expected.items() if s > step for i in e}
        if len(got) != len(ids) or got & earlier:
            return []
        if len(ids) > len(want):  # the surplus is the reference's next steps (as far as it recorded them)
            cut = here <= got and (not later or got - here <= later)
        else:  # the rest of the reference's step comes in the run's next one
            following = consumed(step + 1) or {}
            cut = got <= here and here - got <= {i for rep_ids in following.values() for i in rep_ids}
        if not cut:
            return []
        micros = {rep: max((len(per_rank[r].get(step) or []) for r in ranks), default=0) for rep, ranks in members.items()}
        per_replica = {rep: len(rep_ids) for rep, rep_ids in by_replica.items()}
        replicas = len(members)
        return [Diagnosis(
            "batch-size-mismatch",
            f"step {step} consumed {len(ids)} samples but the case's global batch is {len(want)}: the {replicas} replicas "
            f"consumed {'/'.join(str(v) for v in sorted(set(per_replica.values())))} samples each in "
            f"{'/'.join(str(v) for v in sorted(set(micros.values())))} micro-batch(es) before their optimizer step, where "
            f"the case's step is {len(want) / replicas:g} per replica; the loop's accumulation or batch size (e.g. a "
            "framework's gradient_accumulation_steps) differs from the case's",
            {"step": step, "consumed": len(ids), "global_batch": len(want), "replicas": replicas,
             "samples_per_replica": {str(k): v for k, v in sorted(per_replica.items())},
             "micro_batches_per_replica": {str(k): v for k, v in sorted(micros.items())}},
        )]
    return []


def check_sample_ids(
    per_rank: Mapping[int, Mapping[int, Sequence[Sequence[int]]]],
    replica: Mapping[int, int],
    expected: Mapping[int, Sequence[int]] | None = None,
    *,
    steps_per_epoch: int | None = None,
) -> list[Diagnosis]:
    """The checks on plain data: ``per_rank[rank][step]`` = ids per micro-batch; ``replica``
    maps a rank to its data-parallel replica; ``expected[step]`` = the reference's ids."""
    findings: list[Diagnosis] = []
    members: dict[int, list[int]] = defaultdict(list)
    for rank in sorted(per_rank):
        members[replica.get(rank, rank)].append(rank)
    steps = sorted({s for r in per_rank.values() for s in r})
    if expected is not None:
        steps = [s for s in steps if s in expected]

    def epoch_of(step: int) -> int:
        return step // steps_per_epoch if steps_per_epoch else 0

    if expected is not None:
        findings += _step_batch_sizes(per_rank, members, expected, steps)

    # -- inconsistent inputs within a replica -----------------------------------------------
    for rep, ranks in sorted(members.items()):
        if len(ranks) < 2:
            continue
        bad: list[dict[str, Any]] = []
        for step in steps:
            lists = {r: per_rank[r].get(step) for r in ranks if per_rank[r].get(step)}
            if len(lists) < 2:
                continue
            micros = max(len(v) for v in lists.values())
            for m in range(micros):
                ids = {r: list(v[m]) if m < len(v) else None for r, v in lists.items()}
                if len({tuple(x) if x is not None else None for x in ids.values()}) > 1:
                    bad.append({"step": step, "micro": m, "ids_per_rank": {str(r): x for r, x in ids.items()}})
        if bad:
            first = bad[0]
            differing = sorted(int(r) for r in first["ids_per_rank"])
            findings.append(Diagnosis(
                "inconsistent-replica-inputs",
                f"ranks {differing} belong to data-parallel replica {rep} (one tensor-parallel group / pipeline) and must "
                f"consume the same batch, but at step {first['step']} micro-batch {first['micro']} they consumed different "
                f"samples ({_brief(first['ids_per_rank'])}); {len(bad)} micro-batch(es) differ in all",
                {
                    "replica": rep, "ranks": differing, "step": first["step"], "micro": first["micro"],
                    "steps": sorted({b["step"] for b in bad}), "ids_per_rank": first["ids_per_rank"],
                    "count": len(bad),
                },
            ))

    # -- what each replica consumed, per epoch ---------------------------------------------
    occurrences: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    consumed: dict[int, set[int]] = defaultdict(set)
    for rep, ranks in sorted(members.items()):
        for step in steps:
            lists = [per_rank[r].get(step) or [] for r in ranks]
            micros = max((len(v) for v in lists), default=0)
            for m in range(micros):
                counters = [Counter(v[m]) for v in lists if m < len(v)]
                merged = reduce(lambda a, b: a | b, counters, Counter())
                holders = [r for r, v in zip(ranks, lists) if m < len(v) and v[m]]
                for sid, n in merged.items():
                    for _ in range(n):
                        occurrences[epoch_of(step)][sid].append({"replica": rep, "ranks": holders, "step": step, "micro": m})
                    consumed[epoch_of(step)].add(sid)
    for epoch in sorted(occurrences):
        dups = {sid: occ for sid, occ in occurrences[epoch].items() if len(occ) > 1}
        if not dups:
            continue
        sid = min(dups, key=lambda i: (min(o["step"] for o in dups[i]), i))
        occ = dups[sid]
        ranks = sorted({r for o in occ for r in o["ranks"]})
        where = " and ".join(f"replica {o['replica']} (ranks {o['ranks']}) at step {o['step']}" for o in occ[:4])
        findings.append(Diagnosis(
            "duplicate-samples",
            f"sample {sid} was consumed {len(occ)} times in epoch {epoch}: by {where}; "
            f"{len(dups)} sample id(s) were consumed more than once",
            {
                "epoch": epoch, "id": sid, "ranks": ranks, "steps": sorted({o["step"] for o in occ}),
                "replicas": sorted({o["replica"] for o in occ}), "count": len(dups),
                "ids": sorted(dups)[:MAX_IDS],
                "occurrences": {str(i): dups[i] for i in sorted(dups)[:20]},
            },
        ))

    # -- coverage of what the reference consumed -------------------------------------------
    if expected is not None:
        wanted: dict[int, dict[int, int]] = defaultdict(dict)  # epoch -> id -> reference step
        for step in steps:
            for sid in expected[step]:
                wanted[epoch_of(step)].setdefault(sid, step)
        for epoch in sorted(wanted):
            missing = sorted(set(wanted[epoch]) - consumed.get(epoch, set()))
            if not missing:
                continue
            extra = sorted(consumed.get(epoch, set()) - set(wanted[epoch]))
            ref_steps = sorted({wanted[epoch][i] for i in missing})
            findings.append(Diagnosis(
                "dropped-samples",
                f"{len(missing)} of the {len(wanted[epoch])} samples the reference consumed in epoch {epoch} "
                f"(steps {ref_steps}) were consumed by no replica, e.g. {missing[:8]}",
                {
                    "epoch": epoch, "ids": missing[:MAX_IDS], "count": len(missing), "expected": len(wanted[epoch]),
                    "steps": ref_steps, "missing_by_step": {str(s): [i for i in missing if wanted[epoch][i] == s][:MAX_IDS] for s in ref_steps},
                    "unexpected_ids": extra[:MAX_IDS],
                },
            ))
    if any(d.code == "batch-size-mismatch" for d in findings):
        # Steps of another size move where the reference's steps end: the samples of its later
        # steps the run had not reached are not dropped (the cut check saw none skipped).
        findings = [d for d in findings if d.code != "dropped-samples"]
    return findings


def _brief(ids_per_rank: Mapping[str, Any]) -> str:
    parts = []
    for r, ids in ids_per_rank.items():
        shown = ids[:6] if ids else ids
        more = "..." if ids and len(ids) > 6 else ""
        parts.append(f"rank {r}: {shown}{more}")
    return ", ".join(parts)
