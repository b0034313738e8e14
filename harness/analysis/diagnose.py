"""The diagnosis engine: from a comparison and the run's traces to named causes.

Input is what a run leaves behind - the reference record, the parallel record, the
:class:`~harness.analysis.compare.CompareResult`, the run trace (:mod:`harness.tracing`: samples, mesh,
collectives), the activation probe (:mod:`harness.record.probe`) and any structured failure (a
pipeline stage split that lost a layer, a hang). Output is a list of
:class:`~harness.codes.Diagnosis`, root causes first. A correct run gives an empty list.

How each pattern is recognised (evidence is measured, never assumed):

- trace checks first (samples, mesh groups, collective order): they name root causes that
  explain any value mismatch downstream;
- structure: shapes that differ -> ``shard-layout``; missing / extra / renamed entries ->
  ``state-structure``;
- gradients at the first step where they differ, each fitted as ``actual = c * reference``:
  one common c on every gradient is a scale bug whose size says which (1/N averaged twice, N
  never averaged, the micro-batch count m in a pipeline, another constant); gradients that
  differ between replicas are an unsynchronized gradient; a gradient one of whose shard
  slices is zero or off while the rest match is a shard that never reached the loss; values
  that are a permutation of the reference are a wrong shard layout;
- parameters that differ between replicas while gradients agree -> ``replica-divergence``;
- what no pattern explains -> ``numeric-mismatch`` with the tensors and errors. Consequences
  of a named cause (parameters after a bad gradient, later steps) are not reported twice.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from reference.record import Record

from harness.analysis.probe_checks import analyze_probe
from harness.tracing.checks import run_checks
from harness.tracing.run_trace import load_trace
from harness.tracing.samples import check_samples
from harness.codes import Diagnosis
from harness.report.model import entry_name
from harness.analysis.compare import CompareResult, TensorComparison

__all__ = ["Analysis", "diagnose", "diagnose_result", "stage_coverage_diagnosis"]

# A fit actual ~= c * expected is "constant" when the residual is this small relative to the
# tensor; per dtype because bf16 runs carry ~1e-2 relative noise.
_FIT_RESIDUAL = {"float64": 1e-6, "float32": 2e-3, "bfloat16": 5e-2, "float16": 2e-2}
_FACTOR_RTOL = 0.03  # two factors are "the same" within 3%

# Root causes that explain value mismatches downstream: with one of these, leftover failing
# tensors are consequences, not a separate numeric-mismatch.
_ROOT_CODES = frozenset(
    {
        "duplicate-samples", "dropped-samples", "batch-size-mismatch", "inconsistent-replica-inputs", "swapped-mesh-dims",
        "collective-mismatch", "collective-missing", "pp-stage-coverage", "tp-partial-sum", "rng-desync",
        "state-structure", "shard-layout", "per-replica-statistic",
    }
)


def _unlocated_because(probe: Any) -> str:
    """What the probe lacked to locate a failed run, in words ("" where it had what it needs:
    the departure is then outside what it replays, e.g. the gradient sync or the update)."""
    if probe is None:
        return "no first forward was probed (a loop's model is probed from run.watch on)"
    entries = probe.ranks or []
    if entries and all(e.get("input") is None for e in entries):
        return ("no rank's first forward of the probed step was seen with its input (a model called outside the module "
                "handed to run.watch)")
    missing = next((e["missing"] for e in entries if e.get("missing")), "")
    if missing:
        return f"{missing}: the reference cannot be replayed on that micro-batch"
    if entries and all(e.get("targets") is None for e in entries):
        return ("the probed micro-batch's targets are unknown (no run.batches, and no sample ids in run.loss for its "
                "first forward): the loss and the backward cannot be replayed")
    return ""


def _root_found(found: Iterable[Diagnosis]) -> bool:
    """A named root cause (samples, mesh, forward, structure) explains the value differences.
    Names that differ only by a renaming the comparison resolved from the shapes are not one:
    the values were compared under the proposed names, so what they show is named too."""
    return any(d.code in _ROOT_CODES and not d.evidence.get("compared_under_proposed_names") for d in found)


def _close(a: float, b: float, rtol: float = _FACTOR_RTOL) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def _fmt(x: float) -> str:
    return f"{x:.4g}"


@dataclass
class _Fit:
    name: str
    scale: float | None  # least-squares c in actual ~= c * expected
    residual: float  # ||a - c e|| / ||a||
    passed: bool

    def constant(self, dtype: str) -> bool:
        return self.scale is not None and self.residual <= _FIT_RESIDUAL.get(dtype, 2e-3)

    def unit(self, dtype: str) -> bool:
        """The factor is 1 within what the dtype's rounding can explain."""
        return self.scale is not None and abs(self.scale - 1.0) <= _FIT_RESIDUAL.get(dtype, 2e-3)


def _fit(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float | None, float]:
    a, e = actual.detach().double().flatten(), expected.detach().double().flatten()
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return None, math.inf
    ee = float(e @ e)
    if ee == 0.0:
        return (None, 0.0) if float(a @ a) == 0.0 else (None, math.inf)
    c = float(a @ e) / ee
    norm = max(float(a.norm()), float((c * e).norm()), 1e-30)
    return c, float((a - c * e).norm()) / norm


class Analysis:
    """One run's evidence; :meth:`run` yields the diagnoses. Kept as a class so each pattern
    is one small method over shared, lazily loaded facts."""

    def __init__(
        self,
        comparison: CompareResult,
        reference: Record,
        actual: Record,
        *,
        trace: Any = None,
        findings: Iterable[Diagnosis] = (),
        probe: Any = None,
        case: Any = None,
    ):
        self.case = case
        self.cmp = comparison
        self.ref = reference
        # Values were compared under the names proposed from the shapes: read them so here too.
        self.act = actual.renamed(comparison.renamed) if comparison.renamed else actual
        self.trace = trace
        self.extra = list(findings)
        self.probe = probe
        self.layouts: list[dict[str, Any]] = list(actual.meta.get("ranks", []))
        self.world = int(actual.meta.get("world_size", len(self.layouts) or 1))
        case = reference.meta.get("case", {})
        self.micro_batches = int(case.get("micro_batches", 1) or 1)
        self.dtype = str(reference.meta.get("dtype", "torch.float32")).removeprefix("torch.")

    # -- layout facts ------------------------------------------------------------------------

    @property
    def dp_size(self) -> int:
        return max((int(r.get("dp_size", 1)) for r in self.layouts), default=1)

    @property
    def num_stages(self) -> int:
        return max((int(r.get("num_stages", 1)) for r in self.layouts), default=1)

    def mesh_size(self, dim: str) -> int:
        coords = {r.get("mesh", {}).get(dim) for r in self.layouts if dim in r.get("mesh", {})}
        return len(coords) if coords else 1

    @functools.cached_property
    def _positions(self) -> dict[int, tuple[int, tuple[Any, ...], tuple[Any, ...]]]:
        """rank -> (data-parallel replica, non-dp mesh coordinates, pipeline stages)."""
        from harness.parallel_dims import is_dp_dim

        return {
            int(r.get("rank", i)): (
                int(r.get("dp_rank", 0)),
                tuple(sorted((k, v) for k, v in (r.get("mesh") or {}).items() if not is_dp_dim(k))),
                tuple(r.get("stages") or ()),
            )
            for i, r in enumerate(self.layouts)
        }

    def _across_replicas(self, mismatched: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        """The entries of ``mismatched`` (name -> groups of ranks that agree) where two ranks in
        different groups are different data-parallel replicas at the same position otherwise
        (same non-dp mesh coordinates and pipeline stages): evidence that replicas, not the
        ranks of one replica, disagree. A rank without a recorded layout counts as a replica."""
        position = self._positions

        def replicas(a: int, b: int) -> bool:
            pa, pb = position.get(a), position.get(b)
            return pa is None or pb is None or (pa[0] != pb[0] and pa[1:] == pb[1:])

        return {
            name: groups for name, groups in mismatched.items()
            if any(replicas(a, b) for gi, gj in itertools.combinations(groups, 2) for a in gi for b in gj)
        }

    def _within_replica(self, mismatched: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        """The entries of ``mismatched`` whose copies differ between ranks of one data-parallel
        replica and one pipeline stage (the tensor-parallel peers holding a replicated tensor)."""
        position = self._positions

        def peers(a: int, b: int) -> bool:
            pa, pb = position.get(a), position.get(b)
            return pa is not None and pb is not None and pa[0] == pb[0] and pa[2] == pb[2] and pa[1] != pb[1]

        return {
            name: groups for name, groups in mismatched.items()
            if any(peers(a, b) for gi, gj in itertools.combinations(groups, 2) for a in gi for b in gj)
        }

    def _peer_copies(self, step: int, kind: str, name: str) -> list[tuple[list[int], dict[int, torch.Tensor]]]:
        """Per data-parallel replica (and stage): its ranks and each rank's own copy of the
        replicated ``name`` (from the differing copies the recorder kept; empty when it kept
        none). Ranks listed in one agreeing group share that group's copy."""
        index = self.act.step(step).extra.get("replica_copies", {}).get(kind, {}).get(name) or []
        copy_of: dict[int, torch.Tensor] = {}
        for piece in index:
            tensor = self.act.aux(step, piece["aux"]).double()
            for rank in piece["ranks"]:
                copy_of[int(rank)] = tensor
        replicas: dict[tuple[Any, ...], list[int]] = {}
        for rank, pos in self._positions.items():
            if rank in copy_of:
                replicas.setdefault((pos[0], pos[2]), []).append(rank)
        return [(sorted(ranks), {r: copy_of[r] for r in ranks}) for _, ranks in sorted(replicas.items()) if len(ranks) > 1]

    # -- entry -------------------------------------------------------------------------------

    def run(self) -> list[Diagnosis]:
        found: list[Diagnosis] = list(self.extra)
        found += self._trace_checks(found)
        found += self._structure()
        found += self._probe_findings(found)
        found += self._random_draws(found)
        found += self._per_replica_statistic(found)
        # Copies of a replicated parameter that went apart before any gradient failed are the
        # root: each rank computed its later gradients with its own weights.
        early = self._replica_divergence(found)
        grad_step = self._first_failing_step("grad")
        if early and (grad_step is None or early[0].evidence.get("step", -1) < grad_step):
            found += early
        else:
            # A gradient cause at or before the divergence explains the copies going apart.
            causes = self._gradients(found)
            found += causes or self._replica_divergence(found)
        if not self.cmp.passed and not found:
            found.append(self._numeric_mismatch())
        found = _dedupe(found)
        self._locate(found)
        return found

    def _locate(self, found: list[Diagnosis]) -> None:
        """Where a failed run departs (harness.analysis.divergence), on every diagnosis as
        ``evidence["first_divergent_op"]``; nothing for a passed run or without evidence."""
        if self.cmp.passed or not found:
            return
        from harness.analysis.divergence import first_divergence_location

        try:
            where = first_divergence_location(self.cmp, self.probe, self.case, self.act, self.ref)
        except Exception as exc:  # noqa: BLE001 - a replay that fails must not hide the diagnosis
            self.cmp.notes.append(f"first divergence not located: {type(exc).__name__}: {exc}")
            return
        if where is not None:
            for d in found:
                d.evidence.setdefault("first_divergent_op", where)
        elif (why := _unlocated_because(self.probe)):
            self.cmp.notes.append(f"where it departs is not located: {why}")

    # -- trace checks (harness.tracing) --------------------------------------------------------

    def _trace_checks(self, found: list[Diagnosis]) -> list[Diagnosis]:
        known = {d.code for d in found}
        try:
            if self.trace is not None:
                out = list(run_checks(self.act, self.ref, self.trace))
            else:
                out = list(check_samples(self.act, self.ref))
        except Exception as exc:  # noqa: BLE001 - a broken check must not hide the others
            out = []
            self.cmp.notes.append(f"trace checks failed: {type(exc).__name__}: {exc}")
        return [d for d in out if d.code not in known]

    def _structure(self) -> list[Diagnosis]:
        out: list[Diagnosis] = []
        shapes = [s for s in self.cmp.structure if s.category == "shape"]
        if shapes:
            by_name: dict[str, dict[str, Any]] = {}
            for s in shapes:
                by_name.setdefault(f"{s.kind} {s.name}", {"kind": s.kind, "name": s.name, "expected": s.expected, "actual": s.actual})
            first = next(iter(by_name.values()))
            out.append(
                Diagnosis(
                    "shard-layout",
                    f"{first['kind']} {first['name']!r} gathers to shape {first['actual']} but the reference's is {first['expected']}"
                    + (f" (+{len(by_name) - 1} more tensors)" if len(by_name) > 1 else ""),
                    {"tensors": list(by_name.values())[:20]},
                )
            )
        other = [s for s in self.cmp.structure if s.category not in ("shape",)]
        if other:
            names = sorted({f"{s.category} {s.kind or ''} {s.name or ''}".strip() for s in other})
            out.append(
                Diagnosis(
                    "state-structure",
                    f"{len(names)} state entries differ from the reference's: " + "; ".join(names[:4]) + ("; ..." if len(names) > 4 else ""),
                    {
                        "entries": [
                            {"category": s.category, "step": s.step, "kind": s.kind, "name": s.name, "expected": _plain(s.expected), "actual": _plain(s.actual)}
                            for s in other[:40]
                        ],
                        "deepdiff": self.cmp.structure_text[:4000],
                        "hints": [n for n in self.cmp.notes if "renamed" in n],
                        **({"compared_under_proposed_names": dict(self.cmp.renamed)} if self.cmp.renamed else {}),
                    },
                )
            )
        return out

    # -- gradients ---------------------------------------------------------------------------

    def _first_failing_step(self, kind: str) -> int | None:
        steps = [t.step for t in self.cmp.tensors if t.kind == kind and not t.passed]
        return min(steps) if steps else None

    def _gradients(self, found: list[Diagnosis]) -> list[Diagnosis]:
        step = self._first_failing_step("grad")
        if step is None:
            return []
        comps = [t for t in self.cmp.tensors if t.kind == "grad" and t.step == step]
        failing = [t for t in comps if not t.passed]
        out: list[Diagnosis] = []
        if _root_found(found):
            return out
        # Data-parallel replicas disagree on a gradient: the sync never happened for it. Copies
        # that differ only inside one replica (the tensor-parallel ranks of a replicated norm)
        # are not replicas: a TP cause (partial sum, RNG) or numeric-mismatch, never this code.
        mismatched = self._across_replicas(self.act.step(step).extra.get("replica_mismatch", {}).get("grad", {}))
        if mismatched:
            names = sorted(mismatched)
            out.append(
                Diagnosis(
                    "missing-grad-sync",
                    f"{len(names)} of {len(comps)} gradients differ between replicas at step {step}: "
                    + ", ".join(names[:4]) + (" ..." if len(names) > 4 else ""),
                    {"step": step, "params": {n: mismatched[n] for n in names}, "groups_note": "ranks listed together agree"},
                )
            )
            return out
        fits = {t.name: _Fit(t.name, *self._fit_tensor(step, "grad", t.name), passed=t.passed) for t in comps}
        # A factor within the dtype's fit noise of 1 is the reference's gradient plus rounding,
        # not a scale bug: such tensors fall through to the layout checks, then numeric-mismatch.
        const = {n: f for n, f in fits.items() if f.constant(self.dtype) and not f.unit(self.dtype)}
        failing_names = [t.name for t in failing]
        # One common factor on every gradient: a scale bug.
        if len(const) == len(fits) and failing:
            scales = [f.scale for f in const.values() if f.scale is not None]
            c = sum(scales) / len(scales)
            if all(_close(s, c) for s in scales):
                out.append(self._scale_diagnosis(c, step, list(fits)))
                return out
        # Every failing gradient is a replicated one whose copies differ inside one replica
        # (the tensor-parallel peers): partial sums nobody all-reduced, or copies gone apart.
        inside = self._inside_replica_grads(step, failing_names)
        if inside:
            out.append(inside)
            return out
        # Some gradients scaled by a common factor, the rest right: a scale on part of the model.
        scaled = [n for n in failing_names if n in const]
        if scaled and len(scaled) == len(failing_names):
            scales = [const[n].scale for n in scaled if const[n].scale is not None]
            c = sum(scales) / len(scales)
            if all(_close(s, c) for s in scales):
                d = self._scale_diagnosis(c, step, scaled, total=len(fits))
                d.evidence["partial"] = True
                d.evidence["unaffected"] = [n for n in fits if n not in scaled][:20]
                out.append(d)
                return out
        # A shard slice that is zero or off while the rest matches.
        shard = self._shard_contribution(step, [n for n in failing_names if n not in const])
        if shard:
            out.append(shard)
            return out
        # Each rank's slices off by a factor of that rank's own: a scaling done per rank.
        per_rank = self._per_rank_scale(step, failing_names)
        if per_rank:
            out.append(per_rank)
            return out
        layout = self._permuted(step, "grad", failing_names)
        if layout:
            out.append(layout)
        return out

    def _peer_dims(self) -> list[str]:
        """The mesh dims along which the ranks of one replica differ (``["tp"]`` under TP)."""
        dims = sorted({k for pos in self._positions.values() for k, _ in pos[1]})
        return dims or ["tp"]

    def _inside_replica_grads(self, step: int, names: list[str]) -> Diagnosis | None:
        """Every failing gradient is of a tensor the layout keeps replicated inside a replica,
        and its copies differ between the replica's ranks. When each rank's copy is off and
        their sum over the replica's ranks is the reference's, the gradient was computed from
        sharded activations and never all-reduced over the tensor-parallel group:
        ``missing-grad-sync`` along that group. Otherwise the copies went apart (something done
        on some ranks only): ``replica-divergence`` inside the group."""
        within = self._within_replica(self.act.step(step).extra.get("replica_mismatch", {}).get("grad", {}))
        if not names or any(n not in within for n in names):
            return None
        dims = "/".join(self._peer_dims())
        summed: dict[str, Any] = {}
        apart: dict[str, Any] = {}
        for name in names:
            replicas = self._peer_copies(step, "grad", name)
            try:
                tol = self.cmp.get(step, "grad", name).tolerance
            except KeyError:
                return None
            if not replicas:
                return None
            e = self.ref.tensor(step, "grad", name).double()
            allowed_one = tol.atol + tol.rtol * e.abs()
            sums, per_replica = True, []
            for ranks, copies in replicas:
                total = torch.stack(list(copies.values())).sum(0)
                # The sum carries the rounding of every copy: n times one tensor's tolerance.
                sum_ok = bool(((total - e).abs() <= len(copies) * allowed_one).all())
                each_off = all(not bool(((c - e).abs() <= allowed_one).all()) for c in copies.values())
                sums &= sum_ok and each_off
                per_replica.append({
                    "ranks": ranks,
                    "factor_per_rank": {str(r): _fit(c, e)[0] for r, c in copies.items()},
                    "matches_reference": [r for r, c in copies.items() if bool(((c - e).abs() <= allowed_one).all())],
                    "sum_max_abs_error": float((total - e).abs().max()) if e.numel() else 0.0,
                })
            (summed if sums else apart)[name] = per_replica
        if summed and not apart:
            listed = sorted(summed)
            ranks = summed[listed[0]][0]["ranks"]
            return Diagnosis(
                "missing-grad-sync",
                f"{len(listed)} of the gradients of parameters the layout keeps replicated differ between the {dims} ranks "
                f"{ranks} of one replica at step {step} and sum over them to the reference's: "
                + ", ".join(listed[:4]) + (" ..." if len(listed) > 4 else "") + f" - never all-reduced over the {dims} group",
                {"step": step, "group": dims, "params": {n: summed[n] for n in listed}, "sums_to_reference": True,
                 "likely_source": f"a parameter replicated over {dims} gets its gradient from activations sharded over {dims} "
                                  "(per-head q/k norms, norms and biases under sequence parallelism): each rank holds a partial "
                                  f"gradient that must be all-reduced over the {dims} group (or the parameter made a DTensor "
                                  "that DTensor reduces)"},
            )
        listed = sorted(apart or summed)
        if not apart:
            return None
        first = apart[listed[0]][0]
        right = first["matches_reference"]
        return Diagnosis(
            "replica-divergence",
            f"the copies of {len(listed)} replicated gradient(s) differ between the {dims} ranks {first['ranks']} of one replica "
            f"at step {step}: " + ", ".join(listed[:4])
            + (f" (rank(s) {right} match the reference; factors per rank {_factors(first['factor_per_rank'])})" if right
               else f" (factors per rank {_factors(first['factor_per_rank'])})"),
            {"step": step, "group": dims, "kind": "grad", "params": {n: apart[n] for n in listed},
             "likely_source": f"a change to gradients of replicated parameters made on some {dims} ranks only (clipping or scaling "
                              "on one rank, an optimizer or hook applied per rank)"},
        )

    def _fit_tensor(self, step: int, kind: str, name: str) -> tuple[float | None, float]:
        return _fit(self.act.tensor(step, kind, name), self.ref.tensor(step, kind, name))

    def _scale_diagnosis(self, c: float, step: int, params: list[str], total: int | None = None) -> Diagnosis:
        n_dp, m, stages = self.dp_size, self.micro_batches, self.num_stages
        tp = self.mesh_size("tp")
        evidence: dict[str, Any] = {"factor": c, "step": step, "params": params[:20], "param_count": len(params),
                                    "dp_size": n_dp, "micro_batches": m, "pipeline_stages": stages}
        which = "every gradient" if total is None or len(params) >= total else f"{len(params)} of {total} gradients"
        if n_dp > 1 and m > 1 and stages == 1 and n_dp == m and (_close(c, m) or _close(c, 1 / m)):
            # Two sizes of this run give the same factor: say both, and how to tell them apart.
            up = _close(c, m)
            sources = [f"{'x' if up else '/'} data-parallel size ({n_dp}): gradients {'summed over replicas and never divided' if up else 'averaged over replicas twice'}",
                       f"{'x' if up else '/'} micro-batches / accumulation steps ({m}): the accumulated loss {'never divided by' if up else 'divided twice by'} {m}"]
            evidence.update(likely_source=" or ".join(sources), candidates=sources,
                            how_to_tell=f"rerun with a micro-batch count other than {m} (or another data-parallel size): the factor follows its cause")
            return Diagnosis("grad-scaled", f"{which} {'is' if which == 'every gradient' else 'are'} {_fmt(c)} x the reference's: "
                             f"{n_dp} replicas and {m} micro-batches both explain it", evidence)
        if stages > 1 and m > 1 and (_close(c, m) or _close(c, 1 / m)):
            direction = "never divided by" if _close(c, m) else "divided twice by"
            evidence["likely_source"] = f"pipeline loss {direction} the {m} micro-batches"
            return Diagnosis("pp-loss-scaling", f"{which} {'is' if which == 'every gradient' else 'are'} {_fmt(c)} x the reference's: the pipeline loss was {direction} the micro-batch count m={m}", evidence)
        if n_dp > 1 and _close(c, 1 / n_dp):
            evidence["likely_source"] = f"loss or gradients divided by the data-parallel size {n_dp} although the all-reduce already averages"
            return Diagnosis("grad-double-averaged", f"{which} {'is' if which == 'every gradient' else 'are'} 1/{n_dp} of the reference's ({_fmt(c)}): averaged over {n_dp} replicas twice", evidence)
        if n_dp > 1 and _close(c, n_dp):
            evidence["likely_source"] = f"gradients summed over {n_dp} replicas and never divided"
            return Diagnosis("grad-not-averaged", f"{which} {'is' if which == 'every gradient' else 'are'} {n_dp} x the reference's ({_fmt(c)}): summed over replicas, never averaged", evidence)
        sharded = set(self.act.step(step).extra.get("sharding", {}))
        if tp > 1 and total is not None and len(params) < total and _close(c, tp) and not sharded & set(params):
            # Only parameters the tensor-parallel layout keeps whole are scaled, by tp: their
            # gradients were complete on every rank and got summed over the group once more.
            evidence["likely_source"] = (f"the gradients of parameters replicated over tp (complete on every tensor-parallel rank) "
                                         f"were all-reduced again over the tensor-parallel group of size {tp}")
            evidence["candidates"] = [evidence["likely_source"]]
            return Diagnosis("grad-scaled", f"{which} are {_fmt(c)} x the reference's: likely summed over the {tp} "
                             "tensor-parallel ranks although already complete", evidence)
        sources = []
        for label, value in (("micro-batches / accumulation steps", m), ("tensor-parallel size", tp), ("pipeline stages", stages),
                             ("world size", self.world), ("data-parallel size", n_dp)):
            if value > 1:
                if _close(c, value):
                    sources.append(f"x {label} ({value})")
                elif _close(c, 1 / value):
                    sources.append(f"/ {label} ({value})")
        evidence["likely_source"] = sources[0] if sources else "no size of this run explains it (a hard-coded constant?)"
        evidence["candidates"] = sources
        return Diagnosis("grad-scaled", f"{which} {'is' if which == 'every gradient' else 'are'} {_fmt(c)} x the reference's" + (f": likely {sources[0]}" if sources else ""), evidence)

    def _shard_splits(self, step: int, name: str, ndim: int) -> list[tuple[int, int]]:
        """``(dim, shards)`` splits of ``name``'s gradient in this run (recorded by the gather):
        one per mesh dim that shards it, plus their product where several split the same dim.
        Empty for a tensor that is whole on every rank - it has no shard to miss."""
        recorded = self.act.step(step).extra.get("sharding", {}).get(name, [])
        splits: list[tuple[int, int]] = []
        per_dim: dict[int, int] = {}
        for dim, k in recorded:
            dim = int(dim) % max(ndim, 1)
            splits.append((dim, int(k)))
            per_dim[dim] = per_dim.get(dim, 1) * int(k)
        splits += [(d, k) for d, k in per_dim.items() if (d, k) not in splits]
        return [(d, k) for d, k in splits if d < ndim and k > 1]

    def _shard_contribution(self, step: int, names: list[str]) -> Diagnosis | None:
        """A gradient sharded in this run one of whose shard slices (as the run split it) is
        zero, or off by a clear factor or pattern, while the other slices match the reference.
        A slice merely beyond tolerance (its fitted factor within rounding of 1) is noise, not
        a missing contribution."""
        for name in names:
            a, e = self.act.tensor(step, "grad", name).double(), self.ref.tensor(step, "grad", name).double()
            try:
                tol = self.cmp.get(step, "grad", name).tolerance
            except KeyError:
                continue
            for dim, k in self._shard_splits(step, name, a.dim()):
                if a.shape[dim] < k:
                    continue
                slices = []
                for i, (sa, se) in enumerate(zip(a.chunk(k, dim), e.chunk(k, dim))):
                    c, resid = _fit(sa, se)
                    ok = bool(((sa - se).abs() <= tol.atol + tol.rtol * se.abs()).all())
                    zero = bool(sa.abs().max() == 0) and bool(se.abs().max() > 0)
                    clear = zero or c is None or not _Fit(name, c, resid, ok).unit(self.dtype) or resid > _FIT_RESIDUAL.get(self.dtype, 2e-3)
                    slices.append({"slice": i, "ok": ok, "scale": c, "zero": zero, "clear": bool(clear)})
                good = [s for s in slices if s["ok"]]
                bad = [s for s in slices if not s["ok"]]
                zeros = [s for s in bad if s["zero"]]
                if zeros and len(zeros) < len(slices):
                    bad = zeros  # a slice that got no gradient at all: the rest differ as a consequence
                if not bad or not (good or zeros) or len(bad) >= len(slices) or not all(s["clear"] for s in bad):
                    continue
                size = math.ceil(a.shape[dim] / k)
                for s in bad:
                    s["range"] = [s["slice"] * size, min((s["slice"] + 1) * size, a.shape[dim])]
                what = "zero: no gradient reached it" if all(s["zero"] for s in bad) else f"off by a factor {_fmt(bad[0]['scale'])}" if bad[0]["scale"] is not None else "wrong"
                first = bad[0]
                rest = "the other slices match" if good else "the other slices differ as a consequence"
                return Diagnosis(
                    "missing-shard-contribution",
                    f"gradient {name!r} at step {step}: shard slice {first['slice']} of {k} along dim {dim} "
                    f"(indices {first['range'][0]}:{first['range'][1]}) is {what}; {rest}",
                    {"param": name, "step": step, "dim": dim, "shards": k, "bad_slices": bad,
                     "good_slices": [s["slice"] for s in good],
                     "sharding": self.act.step(step).extra.get("sharding", {}).get(name),
                     "likely_owner": [f"rank {s['slice']} of the {k}-rank group that shards {name!r} along dim {dim}" for s in bad]},
                )
        return None

    def _per_rank_scale(self, step: int, names: list[str]) -> Diagnosis | None:
        """Every sharded failing gradient's slices are the reference's times a constant, the
        same constant for the same slice of every such gradient, and not the same for all
        slices: each rank scaled what it holds by a factor of its own (gradient clipping on
        some ranks only, or by a norm each rank computed from its own shards). Needs two
        sharded gradients that agree, so that the factors are the ranks', not one tensor's."""
        factors: dict[str, list[float]] = {}
        split_of: dict[str, tuple[int, int]] = {}
        for name in names:
            a, e = self.act.tensor(step, "grad", name), self.ref.tensor(step, "grad", name)
            splits = [(d, k) for d, k in self._shard_splits(step, name, a.dim()) if a.shape[d] >= k]
            if len(splits) != 1:
                continue  # whole on every rank, or split along several dims: not one rank per slice
            dim, k = splits[0]
            fits = [_fit(sa, se) for sa, se in zip(a.chunk(k, dim), e.chunk(k, dim))]
            if any(c is None or resid > _FIT_RESIDUAL.get(self.dtype, 2e-3) for c, resid in fits):
                return None  # a slice that is no constant multiple: another cause
            factors[name], split_of[name] = [float(c) for c, _ in fits], (dim, k)
        if len(factors) < 2 or len({len(f) for f in factors.values()}) != 1:
            return None
        first = next(iter(factors.values()))
        if any(not _close(x, y) for f in factors.values() for x, y in zip(f, first)):
            return None
        if all(_close(x, first[0]) for x in first):
            return None  # one common factor: the scale checks above speak for it
        k = len(first)
        per_slice = {str(i): sum(f[i] for f in factors.values()) / len(factors) for i in range(k)}
        unit = [i for i, c in per_slice.items() if abs(c - 1.0) <= _FIT_RESIDUAL.get(self.dtype, 2e-3)]
        words = ", ".join(f"slice {i} x {_fmt(c)}" for i, c in per_slice.items())
        return Diagnosis(
            "grad-scaled",
            f"at step {step} each rank's share of the sharded gradients is off by a factor of its own ({words}, "
            f"alike in {len(factors)} gradients): a scaling applied per rank, not to the whole gradient",
            {"step": step, "per_rank": True, "shards": k, "factor_per_slice": per_slice,
             "params": sorted(factors)[:20], "param_count": len(factors),
             "splits": {n: list(v) for n, v in split_of.items()}, "unscaled_slices": [int(i) for i in unit],
             "likely_source": "a rescaling of the gradients that only some ranks do, or with a value each rank computes "
                              "from its own shards alone (gradient clipping on one rank, or by a local norm never all-reduced)",
             "likely_owner": [f"rank {i} of the group that shards the gradients (slice {i})" for i in per_slice]},
        )

    def _permuted(self, step: int, kind: str, names: list[str]) -> Diagnosis | None:
        """Same multiset of values, different positions: the shards were laid out along the
        wrong dim or in the wrong order."""
        for name in names:
            a, e = self.act.tensor(step, kind, name).double(), self.ref.tensor(step, kind, name).double()
            if a.numel() < 2:
                continue
            sa, se = a.flatten().sort().values, e.flatten().sort().values
            tol = {"rtol": 1e-4, "atol": 1e-7 * max(float(e.abs().max()), 1e-12)}
            # The same values sorted, but not in place at the same tolerance: moved, not rounded.
            if torch.allclose(sa, se, **tol) and not torch.allclose(a, e, **tol):
                return Diagnosis(
                    "shard-layout",
                    f"{kind} {name!r} at step {step} holds the reference's values in a different order: shards placed along the wrong dim or in the wrong order",
                    {"kind": kind, "name": name, "step": step, "shape": list(a.shape)},
                )
        return None

    # -- replicas ----------------------------------------------------------------------------

    def _replica_divergence(self, found: list[Diagnosis]) -> list[Diagnosis]:
        if any(d.code in ("missing-grad-sync", "replica-divergence") for d in found) or _root_found(found):
            return []
        for s in self.act.steps:
            mismatched = s.extra.get("replica_mismatch", {}).get("param", {})
            params = self._across_replicas(mismatched)
            if params:
                names = sorted(params)
                evidence: dict[str, Any] = {"step": s.step, "params": {n: params[n] for n in names},
                                            "groups_note": "ranks listed together agree"}
                where = self._replica_update_location(s.step, names)
                if where is not None:
                    evidence["first_divergent_op"] = where
                return [
                    Diagnosis(
                        "replica-divergence",
                        f"{len(names)} parameters differ between replicas after step {s.step}: " + ", ".join(names[:4]),
                        evidence,
                    )
                ]
            inside = self._apart_inside_replica(s.step, mismatched)
            if inside is not None:
                return [inside]
        return []

    def _replica_update_location(self, step: int, names: list[str]) -> dict[str, Any] | None:
        """Replicas whose copies of a parameter went apart at ``step`` while its gradient agreed
        across them (no copies of it kept) and matched the reference: the update departs on the
        ranks whose copy is not the reference's - their optimizer step (phase ``optimizer``, the
        first such rank). The comparison reads one copy; this reads each."""
        from harness.analysis.divergence.line import location_line
        from harness.analysis.divergence.steps import optimizer_step_name

        extra = self.act.step(step).extra
        if extra.get("replica_mismatch", {}).get("grad") or any(
                t.step == step and t.kind == "grad" and not t.passed for t in self.cmp.tensors):
            return None
        worst: tuple[float, str, list[int], float, Any] | None = None
        for name in names:
            try:
                expected = self.ref.tensor(step, "param", name).double()
                tol = self.cmp.get(step, "param", name).tolerance
            except KeyError:
                continue
            for piece in extra.get("replica_copies", {}).get("param", {}).get(name) or []:
                copy = self.act.aux(step, piece["aux"]).double()
                if copy.shape != expected.shape:
                    continue
                allowed = tol.atol + tol.rtol * expected.abs()
                excess = float(((copy - expected).abs() - allowed).max()) if copy.numel() else 0.0
                if excess > 0:
                    max_abs = float((copy - expected).abs().max())
                    ranks = sorted(int(r) for r in piece["ranks"])
                    if worst is None or (max_abs > worst[0]):
                        worst = (max_abs, name, ranks, float(expected.abs().max()), tol)
        if worst is None:
            return None
        max_abs, name, ranks, scale, tol = worst
        where = {"phase": "optimizer", "module": name, "module_type": None, "op": optimizer_step_name(self.case), "rank": ranks[0],
                 "ranks": ranks, "step": step, "max_abs": max_abs, "max_rel": max_abs / scale if scale else 0.0,
                 "tolerance": {"rtol": tol.rtol, "atol": tol.atol, "of": "each element"},
                 "compared": f"the gradients of step {step} agree across the replicas and match the reference; the copy "
                             f"of the parameters ranks {ranks} hold after the update does not (the other replicas' does)"}
        where["line"] = location_line(where)
        return where

    def _apart_inside_replica(self, step: int, mismatched: dict[str, list[list[int]]]) -> Diagnosis | None:
        """Parameters the layout keeps replicated inside a replica whose copies on the replica's
        ranks differ after ``step`` by more than an update's rounding (the per-dtype parameter
        tolerance): they drift apart, and each rank then computes with its own weights."""
        from harness.analysis.tolerance import DefaultTolerances

        dims = "/".join(self._peer_dims())
        apart: dict[str, Any] = {}
        for name, groups in sorted(self._within_replica(mismatched).items()):
            for ranks, copies in self._peer_copies(step, "param", name):
                values = list(copies.values())
                scale = max(float(v.abs().max()) for v in values) if values[0].numel() else 0.0
                tol = DefaultTolerances().for_tensor(step, "param", name, _torch_dtype(self.dtype), scale)
                worst = max(float((a - b).abs().max()) for a, b in itertools.combinations(values, 2))
                if worst > tol.atol + tol.rtol * scale:
                    apart[name] = {"ranks": ranks, "groups": groups, "max_abs_difference": worst, "scale": scale}
                    break
        if not apart:
            return None
        names = sorted(apart)
        first = apart[names[0]]
        return Diagnosis(
            "replica-divergence",
            f"{len(names)} parameter(s) the layout keeps replicated differ between the {dims} ranks {first['ranks']} of one "
            f"replica after step {step}: " + ", ".join(names[:4])
            + f" (largest difference {first['max_abs_difference']:.3g} on values up to {first['scale']:.3g})",
            {"step": step, "group": dims, "kind": "param", "params": apart, "groups_note": "ranks listed together agree",
             "likely_source": f"an update applied on some {dims} ranks only (gradient clipping, an optimizer step or a weight "
                              "change on one rank), so the copies each rank computes with drift apart"},
        )

    # -- per-replica statistics ----------------------------------------------------------------

    def _per_replica_statistic(self, found: list[Diagnosis]) -> list[Diagnosis]:
        """``per-replica-statistic``: the run matches the per-replica reference but not the
        one-device one (a batch statistic computed per replica: undeclared), or the case
        declares per-replica statistics that do not cover what depends on the batch."""
        view = self.cmp.per_replica
        if not view or self.case is None or _root_found(found):
            return []
        from harness.analysis import per_replica

        if view.get("contract"):
            if not self.cmp.passed:
                return []  # a bug under the declaration: the other patterns name it
            try:
                dependence = per_replica.batch_dependence(self.case, 0, int(view["replicas"]))
            except Exception as exc:  # noqa: BLE001 - the harness's own probe must not hide the verdict
                self.cmp.notes.append(f"harness: the batch-dependence probe failed ({type(exc).__name__}: {exc})")
                return []
            undeclared = per_replica.names_declared(self.case.per_replica, dependence)
            if not undeclared:
                return []
            return [Diagnosis(
                "per-replica-statistic",
                f"{per_replica.describe(dependence)}; the case declares per-replica statistics for "
                f"{', '.join(self.case.per_replica)} only, not {', '.join(undeclared)}",
                {"declared": list(self.case.per_replica), "undeclared": undeclared, "dependence": dependence,
                 "likely_source": "a batch statistic the declaration does not name: declare it in Case.per_replica if it is "
                                  "meant, else synchronize it over the data-parallel group"},
            )]
        if self.cmp.passed or not view.get("passed"):
            return []
        step = (view.get("first_divergence") or {}).get("step") or self._first_failing_step("grad") or 0
        try:
            dependence = per_replica.batch_dependence(self.case, 0, int(view["replicas"]))
        except Exception as exc:  # noqa: BLE001
            dependence = {"error": f"{type(exc).__name__}: {exc}", "replicas": view["replicas"]}
        terms = per_replica.dependence_terms(dependence) if "error" not in dependence else []
        return [Diagnosis(
            "per-replica-statistic",
            f"the run matches the per-replica reference (each of the {view['replicas']} replicas' micro-batches computed on "
            f"its own), not one device's: {per_replica.describe(dependence) if 'error' not in dependence else 'the dependence could not be probed'}; "
            f"the two references differ by {view['references_differ_by']:.3g} of the largest gradient",
            {"replicas": view["replicas"], "references_differ_by": view["references_differ_by"], "dependence": dependence,
             "first_step": step, "declare": {"per_replica": terms} if terms else None,
             "likely_source": "a statistic of the batch computed on each replica's own samples (a BatchNorm without sync, a "
                              "router's load-balancing loss, a loss normalised by the replica's own token count): synchronize it "
                              "over the data-parallel group (SyncBatchNorm, an all-reduced count), or declare it in "
                              f"Case(per_replica={tuple(terms)!r}) if each replica's statistic is what you mean"},
        )]

    # -- random draws ------------------------------------------------------------------------

    def _random_draws(self, found: list[Diagnosis]) -> list[Diagnosis]:
        """``rng-desync`` from the draws the reference replayed (reference.draws: which tensor
        each random op filled, replicated or sharded over the tensor-parallel peers of a
        replica, and whether the peers drew alike), judged whatever the comparison says; else,
        for a run that failed its comparison, from the ranks' first-step fingerprints
        (harness.tracing.random_ops)."""
        if _root_found(found):
            return []
        self._note_unreadable_draws()
        replays = [(s.step, s.extra["draw_replay"]) for s in self.ref.steps if "draw_replay" in s.extra]
        judged = self._judge_replayed_draws(replays) if replays else []
        if judged:
            return judged
        # Fingerprints where the draws could not all be replayed (ranks out of step: one drew
        # more or other numbers); a fully replayed run's draws have been judged above.
        if self.cmp.passed or self.trace is None or (replays and not any(r.get("failed") for _, r in replays)):
            return []
        from harness.tracing.random_ops import check_random_ops

        draws = {rank: rt.random_ops for rank, rt in self.trace.ranks.items() if rt.random_ops}
        return check_random_ops(draws, self.layouts) if draws else []

    def _note_unreadable_draws(self) -> None:
        """Said plainly: a random op whose draw cannot be read (a fused kernel that returns no
        generator state, reference.draws.random_output) is not judged; no code is named there."""
        from harness.tracing.random_ops import hooks_short

        if self.trace is None:
            return
        unread = {(d.op, hooks_short(d.call_site)) for rt in self.trace.ranks.values() for d in (rt.random_ops or [])
                  if not d.digest}
        for op, site in sorted(unread)[:3]:
            self.cmp.notes.append(f"random op {op} at {site} drew inside a fused kernel that returns no generator state: "
                                  "whether tensor-parallel ranks drew alike there is not judged (no rng-desync can be named "
                                  "at that op); the eager attention, or a kernel that returns its Philox seed and offset "
                                  "(CUDA's flash, memory-efficient, cuDNN), can be judged")

    def _judge_replayed_draws(self, replays: list[tuple[int, dict[str, Any]]]) -> list[Diagnosis]:
        """TP peers of one replica must draw a replicated tensor alike (the same dropout mask on
        the same activation), and a tensor sharded over them each from a generator of its own
        (else every rank's heads or positions repeat the same mask)."""
        from harness.tracing.random_ops import hooks_short

        for step, replay in replays:
            for op in replay.get("ops", []):
                for replica in op.get("replicas", []):
                    layout, alike, ranks = replica["layout"], replica["peers_drew_alike"], replica["ranks"]
                    where = f"random op #{op['index']} of step {step} ({op['op']} {op['shape']}) at {hooks_short(op.get('call_site', ''))}"
                    evidence = {"step": step, "draw": op["index"], "op": op["op"], "shape": op["shape"], "ranks": ranks,
                                "layout": layout, "call_site": op.get("call_site", "")}
                    if layout == "replicated" and not alike:
                        return [Diagnosis(
                            "rng-desync",
                            f"{where}: the tensor-parallel ranks {ranks} of one replica drew a tensor they all hold whole "
                            "with different random numbers - their generators are in different states",
                            {**evidence, "likely_source": "the ranks of a tensor-parallel group seed or advance their RNG "
                                                          "differently (e.g. seeding with the rank) where the activation is replicated"},
                        )]
                    if layout.startswith("sharded") and alike:
                        return [Diagnosis(
                            "rng-desync",
                            f"{where}: the tensor is {layout} across the tensor-parallel ranks {ranks}, and every rank drew "
                            "its own part from the same generator state, so each part repeats the same random pattern "
                            "(the heads or positions on one rank reuse another's mask)",
                            {**evidence, "likely_source": "one generator state for a region sharded over tensor parallelism",
                             "fix": "draw sharded regions from a generator of each rank's own (Megatron's model-parallel RNG "
                                    "tracker, torch.distributed.tensor's random ops on CUDA), replicated ones from a "
                                    "generator all ranks of the group share"},
                        )]
        return []

    # -- activation probe ----------------------------------------------------------------------

    def _probe_findings(self, found: list[Diagnosis]) -> list[Diagnosis]:
        if self.probe is None or self.case is None:
            return []
        known = {d.code for d in found}
        try:
            probed = analyze_probe(self.probe, self.case)
        except Exception as exc:  # noqa: BLE001 - a probe that cannot replay a model must not hide the other checks
            self.cmp.notes.append(f"activation probe skipped: {type(exc).__name__}: {exc}")
            return []
        return [d for d in probed if d.code not in known]

    # -- fallback ----------------------------------------------------------------------------

    def _numeric_mismatch(self) -> Diagnosis:
        failures = self.cmp.failures()
        div = self.cmp.first_divergence
        worst: list[TensorComparison] = sorted(failures, key=lambda t: (t.step, -t.max_rel))[:10]
        summary = (f"{len(failures)} tensors exceed tolerance, first at step {div.step}: " + ", ".join(entry_name(k, n) for k, n in div.entries[:3])) \
            if div else "values differ from the reference"
        # Elements compare accepted as AdamW sign noise before the divergence moved the forward
        # a little: what diverges later may only be their consequence.
        accepted = [{"step": t.step, "name": t.name, "elements": t.excused}
                    for t in self.cmp.tensors if t.excused and div is not None and t.step < div.step]
        if accepted:
            summary += (f" (after {sum(a['elements'] for a in accepted)} parameter elements were accepted as AdamW sign noise "
                        f"of near-zero gradients from step {accepted[0]['step']}: the later differences may be their consequence)")
        return Diagnosis(
            "numeric-mismatch",
            summary,
            {
                **({"accepted_sign_noise": accepted,
                    "likely_source": "rounding: parameters accepted as adaptive-optimizer sign noise change the forward "
                                     "slightly; a larger optimizer eps avoids the +-lr steps on near-zero gradients"}
                   if accepted else {}),
                "first_divergence": {"step": div.step, "entries": [list(e) for e in div.entries[:20]]} if div else None,
                "tensors": [
                    {"step": t.step, "kind": t.kind, "name": t.name, "max_abs": t.max_abs, "max_rel": t.max_rel,
                     "mismatched": t.mismatched, "numel": t.numel, "scale": t.scale}
                    for t in worst
                ],
            },
        )


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name, torch.float32)


def _factors(per_rank: dict[str, float | None]) -> str:
    return ", ".join(f"rank {r} x {_fmt(c)}" if c is not None else f"rank {r} zero" for r, c in per_rank.items())


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None), list, dict)) else repr(value)


def _dedupe(found: list[Diagnosis]) -> list[Diagnosis]:
    seen: set[str] = set()
    out = []
    for d in found:
        if d.code not in seen:
            seen.add(d.code)
            out.append(d)
    return out


def diagnose(comparison: CompareResult, reference: Record, actual: Record, **facts: Any) -> list[Diagnosis]:
    """Named causes for a compared run (empty when it matches the reference). ``facts`` are
    :class:`Analysis`'s: ``trace``, ``findings``, and ``probe`` with ``case`` for the
    activation checks (:mod:`harness.record.probe`)."""
    return Analysis(comparison, reference, actual, **facts).run()


def diagnose_result(result: Any) -> list[Diagnosis]:
    """Diagnoses for a :class:`harness.run.RunResult` (loads its records and trace)."""
    return diagnose(
        result.comparison, Record.load(result.reference_path), Record.load(result.record_path),
        trace=load_trace(getattr(result, "trace_path", None)), probe=getattr(result, "probe", None),
        case=getattr(result, "case_obj", None),
    )


def _modules(names: Iterable[str]) -> list[str]:
    """Parameter names folded to their modules: ``layers.1.attn.q.weight`` ... -> ``layers.1.*``."""
    prefixes: list[str] = []
    for name in names:
        parts = name.split(".")
        prefix = ".".join(parts[:2]) + ".*" if len(parts) > 2 else name
        if prefix not in prefixes:
            prefixes.append(prefix)
    return prefixes


def stage_coverage_diagnosis(exc: Any) -> Diagnosis:
    """``pp-stage-coverage`` from a :class:`harness.record.gather.StageCoverageError` (which every
    rank raises alike: the check is collective)."""
    missing, duplicated = list(exc.missing), {k: list(v) for k, v in exc.duplicated.items()}
    parts = []
    if missing:
        parts.append(f"no stage holds {', '.join(_modules(missing))}")
    if duplicated:
        parts.append("several stages hold " + ", ".join(f"{m} (stages {duplicated[n]})" for m, n in zip(_modules(duplicated), duplicated)))
    return Diagnosis(
        "pp-stage-coverage",
        "pipeline stages do not cover the model exactly once: " + "; ".join(parts),
        {"missing": missing, "duplicated": duplicated, "missing_modules": _modules(missing), "duplicated_modules": _modules(duplicated)},
    )
