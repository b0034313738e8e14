"""Compare: structure first, then values with recorded tolerances; the result is data."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cases import mlp_case
from harness.analysis.compare import compare, compare_tensors
from harness.analysis.tolerance import (
    CalibratedTolerances,
    DefaultTolerances,
    Tolerance,
    calibrate,
)
from reference import (
    NonFiniteReferenceError,
    Record,
    cached_reference,
    train_reference,
)
from tests._records import rewrite


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Record:
    return cached_reference(mlp_case("adamw"), cache=tmp_path_factory.mktemp("cache"))


def test_identical_runs_pass(ref: Record, tmp_path) -> None:
    result = compare(ref, rewrite(ref, tmp_path / "same"))
    assert result.passed, result.summary()
    assert result.first_divergence is None and not result.structure and not result.samples
    kinds = {t.kind for t in result.tensors}
    assert kinds == {"loss", "grad", "param", "optim"}
    assert len([t for t in result.tensors if t.kind == "grad"]) == 4 * 3
    assert all(t.max_abs == 0 and t.tolerance.source == "default" for t in result.tensors)
    json.dumps(result.to_dict())  # the diagnosis and reports consume it as JSON


def test_a_single_flipped_element_is_found(ref: Record, tmp_path) -> None:
    def flip(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
        if (step, kind, name) == (1, "grad", "fc1.weight"):
            t = t.clone()
            t[5, 3] = -t[5, 3]
        return t

    result = compare(ref, rewrite(ref, tmp_path / "flip", flip))
    assert not result.passed
    [bad] = result.failures()
    assert (bad.step, bad.kind, bad.name, bad.worst_index, bad.mismatched) == (1, "grad", "fc1.weight", (5, 3), 1)
    assert bad.actual_at_worst == pytest.approx(-bad.expected_at_worst)
    assert bad.max_abs == pytest.approx(2 * abs(bad.expected_at_worst))
    assert result.first_divergence.step == 1 and result.first_divergence.entries == [("grad", "fc1.weight")]
    assert "grad fc1.weight step 1: MISMATCH 1/128" in result.summary()


def test_a_scaled_gradient_is_found_with_its_factor(ref: Record, tmp_path) -> None:
    halve = lambda step, kind, name, t: t * 0.5 if kind == "grad" else t  # noqa: E731
    result = compare(ref, rewrite(ref, tmp_path / "half", halve))
    failures = result.failures()
    assert {(t.kind, t.step) for t in failures} == {("grad", s) for s in range(3)}
    assert len(failures) == 12
    assert all(t.scale == pytest.approx(0.5) for t in failures)
    assert result.first_divergence.step == 0
    assert [k for k, _ in result.first_divergence.entries] == ["grad"] * 4


def test_missing_and_renamed_keys_are_structure_issues(ref: Record, tmp_path) -> None:
    drop = lambda step, kind, name, t: None if name == "fc2.bias.exp_avg" else t  # noqa: E731
    result = compare(ref, rewrite(ref, tmp_path / "drop", drop))
    assert not result.passed
    assert {(i.category, i.kind, i.name) for i in result.structure} == {("missing", "optim", "fc2.bias.exp_avg")}
    assert {i.step for i in result.structure} == {0, 1, 2}
    assert "fc2.bias.exp_avg" in result.structure_text  # deepdiff's readable report
    assert result.failures() == []  # what is there still matches

    renamed = compare(ref, rewrite(ref, tmp_path / "ren", rename={"fc1.weight": "layer1.weight"}))
    cats = {(i.category, i.name) for i in renamed.structure}
    assert {("missing", "fc1.weight"), ("extra", "layer1.weight")} <= cats
    assert "param 'fc1.weight' may have been renamed to 'layer1.weight' (same shape (16, 8))" in renamed.notes
    # The whole mapping, proposed from the shapes, ready for run.watch(..., names=...).
    assert "renamed parameters, proposed from their shapes: run.watch(model, optimizer, layout, names={'layer1.weight': 'fc1.weight'})" in renamed.notes
    assert "structure differs" in renamed.summary()


def test_a_renaming_the_shapes_explain_is_reported_and_the_values_still_compared(ref: Record, tmp_path) -> None:
    """Every name of fc1 renamed (its gradient, value and optimizer state alike) and fc2's
    gradient doubled: the names are structure, and the doubled gradient is found under the
    reference's name because the values were compared under the proposed renaming."""
    names = {"fc1.weight": "up.w", "fc1.bias": "up.b"}
    rename = {**names, **{f"{old}.{key}": f"{new}.{key}" for old, new in names.items() for key in ("exp_avg", "exp_avg_sq", "step")}}
    double = lambda step, kind, name, t: t * 2 if (kind, name) == ("grad", "fc2.weight") else t  # noqa: E731
    result = compare(ref, rewrite(ref, tmp_path / "ren", double, rename=rename))
    assert result.renamed == {"up.w": "fc1.weight", "up.b": "fc1.bias"}
    assert {(i.category, i.name) for i in result.structure if i.kind == "param"} == {
        ("missing", "fc1.weight"), ("missing", "fc1.bias"), ("extra", "up.w"), ("extra", "up.b")}
    assert {(t.kind, t.name) for t in result.failures() if t.step == 0} >= {("grad", "fc2.weight")}
    assert all(t.passed for t in result.tensors if t.name.startswith("fc1."))  # compared, under the reference's names

    # A renamed parameter beside one that is gone: more than a renaming, nothing compared under it.
    drop = lambda step, kind, name, t: None if name.startswith("fc2.bias") else t  # noqa: E731
    partial = compare(ref, rewrite(ref, tmp_path / "part", drop, rename={"fc1.bias": "b"}))
    assert partial.renamed == {} and not any(t.name == "fc1.bias" for t in partial.tensors)


def test_a_transposed_shard_is_found(ref: Record, tmp_path) -> None:
    def transpose(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
        return t.t().contiguous() if (kind, name) == ("param", "fc1.weight") else t

    result = compare(ref, rewrite(ref, tmp_path / "t", transpose))
    shape = [i for i in result.structure if i.category == "shape"]
    assert [(i.step, i.name, i.expected, i.actual) for i in shape] == [
        (s, "fc1.weight", "(16, 8)", "(8, 16)") for s in range(3)
    ]

    def swap_shards(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
        # Two row shards concatenated in the wrong order: same shape, wrong layout.
        return torch.cat([t[8:], t[:8]]) if (kind, name) == ("param", "fc1.weight") else t

    swapped = compare(ref, rewrite(ref, tmp_path / "s", swap_shards))
    assert not swapped.structure
    assert {(t.kind, t.name) for t in swapped.failures()} == {("param", "fc1.weight")}
    assert all(t.mismatched > 64 for t in swapped.failures())


def test_sample_id_and_step_count_differences(ref: Record, tmp_path) -> None:
    dup = lambda step, ids: ids[:8] + ids[:8] if step == 1 else ids  # noqa: E731
    result = compare(ref, rewrite(ref, tmp_path / "dup", sample_ids=dup))
    [issue] = result.samples
    assert issue.step == 1 and len(issue.missing) == 8 and issue.duplicated == sorted(ref.step(1).sample_ids[:8])
    assert result.first_divergence.step == 1 and result.first_divergence.entries[0][0] == "samples"

    short = compare(ref, rewrite(ref, tmp_path / "short", steps=2))
    assert [(i.category, i.step) for i in short.structure] == [("steps", 2)]
    assert not short.passed


def test_nan_in_the_parallel_run_fails_and_nan_in_the_reference_is_an_error(ref: Record, tmp_path) -> None:
    def poison(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
        if (step, kind, name) == (2, "param", "fc2.bias"):
            t = t.clone()
            t[0] = math.nan
        return t

    bad = rewrite(ref, tmp_path / "nan", poison)
    result = compare(ref, bad)
    [fail] = result.failures()
    assert (fail.step, fail.name, fail.max_abs, fail.worst_index) == (2, "fc2.bias", math.inf, (0,))
    json.dumps(result.to_dict())
    nan_reference = rewrite(ref, tmp_path / "nanref", poison, source="reference")
    with pytest.raises(NonFiniteReferenceError, match=r"NaN/inf in param 'fc2.bias' at step 2"):
        compare(nan_reference, ref)


def test_compare_tensors_measures_errors() -> None:
    expected = torch.tensor([[1.0, 2.0], [0.0, -4.0]])
    actual = torch.tensor([[1.0, 2.1], [1e-6, -4.0]])
    tol = Tolerance(1e-3, 1e-5, "override", "test")
    r = compare_tensors(actual, expected, tol)
    assert not r.passed and r.mismatched == 1 and r.worst_index == (0, 1)
    assert r.max_abs == pytest.approx(0.1) and r.max_rel == math.inf  # 1e-6 against an exact 0
    assert r.expected_at_worst == 2.0 and r.actual_at_worst == pytest.approx(2.1)
    assert r.tolerance is tol and "Mismatched elements: 1 / 4" in r.message
    ok = compare_tensors(expected + 1e-6, expected, Tolerance(0, 2e-6, "override", "test"))
    assert ok.passed and ok.scale == pytest.approx(1.0)


def test_default_tolerance_is_recorded_per_dtype() -> None:
    policy = DefaultTolerances()
    t32 = policy.for_tensor(0, "grad", "w", torch.float32, scale=2.0)
    assert (t32.source, t32.rtol, t32.atol) == ("default", 1e-5, 2e-5)  # atol follows the tensor's scale
    assert t32.reason.startswith("per-dtype default for torch.float32: rtol 1e-05, atol 1e-05 x max|reference| 2")
    assert policy.for_tensor(0, "grad", "w", torch.float32, scale=0.0).atol == 1e-12  # all-zero tensor: floor
    assert policy.for_tensor(0, "grad", "w", torch.bfloat16, scale=2.0).rtol > t32.rtol
    over = DefaultTolerances({torch.float32: (0.5, 0.5)}).for_tensor(0, "grad", "w", torch.float32, scale=2.0)
    assert (over.rtol, over.atol, over.source) == (0.5, 0.5, "override")


def test_tiny_tensors_are_not_hidden_by_an_absolute_tolerance(ref: Record, tmp_path) -> None:
    # Adam's exp_avg_sq is ~g^2, far below any fixed atol; a factor 1/4 must still show.
    quarter = lambda s, k, n, t: t * 0.25 if n.endswith("exp_avg_sq") else t  # noqa: E731
    result = compare(ref, rewrite(ref, tmp_path / "q", quarter))
    assert float(ref.tensor(0, "optim", "fc2.bias.exp_avg_sq").max()) < 1e-4
    assert {(t.kind, t.name.rsplit(".", 1)[1]) for t in result.failures()} == {("optim", "exp_avg_sq")}
    assert len(result.failures()) == 12


def test_bf16_passes_with_calibrated_tolerance_and_still_catches_a_scaled_gradient(tmp_path) -> None:
    case = mlp_case("adamw", dtype=torch.bfloat16)
    cache = tmp_path / "cache"
    ref = cached_reference(case, cache=cache)
    policy = calibrate(case, ref, cache=cache)
    assert isinstance(policy, CalibratedTolerances)
    # A correct but differently-ordered bf16 run (4 micro-batches: not a calibration variant).
    other = train_reference(case.replace(micro_batches=4), tmp_path / "other")
    equivalent = rewrite(other, tmp_path / "equiv")
    result = compare(ref, equivalent, policy)
    assert result.passed, result.summary()
    assert result.tolerance["mode"] == "calibrated"
    grad = result.get(1, "grad", "fc1.weight")
    assert grad.tolerance.source == "calibrated" and "float64 rerun" in grad.tolerance.reason
    strict = compare(ref, equivalent, DefaultTolerances({torch.bfloat16: (0.0, 0.0)}))
    assert not strict.passed  # the runs really differ: calibration is what makes them pass
    halved = compare(ref, rewrite(other, tmp_path / "half", lambda s, k, n, t: t * 0.5 if k == "grad" else t), policy)
    assert {t.kind for t in halved.failures()} == {"grad"}
    assert all(t.scale == pytest.approx(0.5, rel=0.05) for t in halved.failures())
