"""The diagnosis engine's gradient patterns, in process: a reference record rewritten as a
parallel run would have left it (scaled gradients, rank layouts), with no ranks spawned.

The multi-rank bug cases (tests/test_diagnose.py) show each code end to end; these pin the
decision boundaries - which factor is which code, and when a factor is only rounding."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases import mlp_case
from harness.analysis.compare import compare
from harness.analysis.diagnose import diagnose
from reference import Record, cached_reference
from tests._records import rewrite

SCALE_CODES = {"grad-scaled", "grad-double-averaged", "grad-not-averaged", "pp-loss-scaling"}
_serial = itertools.count()


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Record:
    return cached_reference(mlp_case("sgd"), cache=tmp_path_factory.mktemp("cache"))


def dp_layout(dp: int) -> dict:
    """``meta`` for a record from ``dp`` data-parallel replicas (what the engine sizes factors by)."""
    return {"world_size": dp, "ranks": [{"rank": r, "dp_size": dp, "mesh": {"dp": r}} for r in range(dp)]}


def scaled_run(ref: Record, path: Path, factor: float, *, dp: int = 2, only: str | None = None) -> list:
    """Diagnoses for a run whose step-0 gradients (or only ``only``'s) are ``factor`` x the reference's."""

    def scale(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
        hit = kind == "grad" and step == 0 and (only is None or name == only)
        return t * factor if hit else t

    actual = rewrite(ref, path / f"run-{next(_serial)}", scale, meta=dp_layout(dp))
    return diagnose(compare(ref, actual), ref, actual)


@pytest.mark.parametrize(
    ("factor", "dp", "code"),
    [(0.5, 2, "grad-double-averaged"), (2.0, 2, "grad-not-averaged"), (0.25, 4, "grad-double-averaged"),
     (4.0, 4, "grad-not-averaged"), (3.0, 2, "grad-scaled")],
)
def test_a_common_gradient_factor_is_named_by_what_explains_it(ref: Record, tmp_path, factor: float, dp: int, code: str) -> None:
    [d] = scaled_run(ref, tmp_path, factor, dp=dp)
    assert d.code == code, d.summary
    assert d.evidence["factor"] == pytest.approx(factor)
    assert d.evidence["step"] == 0


def test_an_unexplained_factor_says_no_size_explains_it(ref: Record, tmp_path) -> None:
    [d] = scaled_run(ref, tmp_path, 3.0, dp=2)
    assert "no size of this run explains it" in d.evidence["likely_source"]


def test_a_factor_on_part_of_the_model_lists_the_unaffected_tensors(ref: Record, tmp_path) -> None:
    [d] = scaled_run(ref, tmp_path, 2.0, dp=2, only="fc1.weight")
    assert d.code == "grad-not-averaged"
    assert d.evidence["partial"] is True and d.evidence["params"] == ["fc1.weight"]
    assert "fc2.weight" in d.evidence["unaffected"]


@pytest.mark.parametrize("factor", [1.0 + 1e-4, 1.0 - 5e-4, 1.0015])
def test_a_factor_within_rounding_of_one_is_not_called_a_scale_bug(ref: Record, tmp_path, factor: float) -> None:
    # Off the fp32 tolerance (so the run fails) but 1 within what rounding can fit: the
    # reference's gradient plus noise. Calling it "grad-scaled 1.0001x" sends users hunting
    # for a constant that is not there.
    codes = [d.code for d in scaled_run(ref, tmp_path, factor)]
    assert codes == ["numeric-mismatch"], codes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    factor=st.one_of(st.floats(0.02, 0.9), st.floats(1.1, 50.0)),
    dp=st.sampled_from([2, 4, 8]),
)
def test_every_clear_factor_is_a_scale_code_whose_size_matches(ref: Record, tmp_path, factor: float, dp: int) -> None:
    [d] = scaled_run(ref, tmp_path, factor, dp=dp)
    assert d.code in SCALE_CODES, d.summary
    assert d.evidence["factor"] == pytest.approx(factor, rel=1e-6)
    if d.code == "grad-double-averaged":
        assert factor == pytest.approx(1 / dp, rel=0.03)
    elif d.code == "grad-not-averaged":
        assert factor == pytest.approx(dp, rel=0.03)


def tiny_grad_reference(base: Record, path: Path) -> Record:
    """``base`` with its fc1.weight[0, 0] gradient at step 0 within rounding of 0."""

    def tiny(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
        if (step, kind, name) == (0, "grad", "fc1.weight"):
            t = t.clone()
            t[0, 0] = 1e-12
        return t

    return rewrite(base, path, tiny, source="reference")


@pytest.fixture(scope="module")
def adam_ref(tmp_path_factory: pytest.TempPathFactory) -> Record:
    base = cached_reference(mlp_case("adamw"), cache=tmp_path_factory.mktemp("adam-cache"))
    return tiny_grad_reference(base, tmp_path_factory.mktemp("adam-ref") / "ref")


def _moved_record(ref: Record, path: Path, index: tuple[int, int], by: float) -> Record:
    def move(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
        if (step, kind, name) == (0, "param", "fc1.weight"):
            t = t.clone()
            t[index] += by
        return t

    return rewrite(ref, path / f"run-{next(_serial)}", move, meta=dp_layout(2))


def test_an_adam_step_on_a_near_zero_gradient_is_accepted_as_rounding(adam_ref: Record, tmp_path) -> None:
    # AdamW moves an element by ~lr whatever its gradient's size: a ~0 gradient whose sign
    # flipped in a correct run lands the parameter 2 lr away. The comparison accepts it, says so.
    lr = adam_ref.step(0).param_groups[0]["lr"]
    actual = _moved_record(adam_ref, tmp_path, (0, 0), -2 * lr)
    result = compare(adam_ref, actual)
    assert result.passed, result.summary()
    [accepted] = [t for t in result.tensors if t.excused]
    assert (accepted.step, accepted.name, accepted.excused) == (0, "fc1.weight", 1)
    assert "within AdamW sign noise" in accepted.line()
    assert any("fc1.weight" in n and "+-lr step" in n for n in result.notes)
    assert diagnose(result, adam_ref, actual) == []


def test_sign_noise_is_not_accepted_for_sgd(ref: Record, tmp_path) -> None:
    sgd_ref = tiny_grad_reference(ref, tmp_path / "sgd-ref")
    result = compare(sgd_ref, _moved_record(sgd_ref, tmp_path, (0, 0), -0.02))
    assert not result.passed and not any(t.excused for t in result.tensors)  # SGD moves a ~0 gradient by ~0


def test_later_differences_name_the_accepted_noise_they_may_follow_from(adam_ref: Record, tmp_path) -> None:
    lr = adam_ref.step(0).param_groups[0]["lr"]

    def flip_then_drift(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
        if (step, kind, name) == (0, "param", "fc1.weight"):
            t = t.clone()
            t[0, 0] -= 2 * lr
        if (step, kind) == (1, "grad"):
            t = t * 1.0001  # the slightly moved forward: within rounding of 1, off the fp32 tolerance
        return t

    actual = rewrite(adam_ref, tmp_path / "drift", flip_then_drift, meta=dp_layout(2))
    [d] = diagnose(compare(adam_ref, actual), adam_ref, actual)
    assert d.code == "numeric-mismatch"
    assert d.evidence["accepted_sign_noise"] == [{"step": 0, "name": "fc1.weight", "elements": 1}]
    assert "accepted as AdamW sign noise" in d.summary


@pytest.mark.parametrize(("index", "by"), [((0, 1), -0.02), ((0, 0), -0.2)])
def test_other_parameter_differences_get_no_rounding_excuse(adam_ref: Record, tmp_path, index, by: float) -> None:
    # (0, 1): its gradient is clearly non-zero; (0, 0) by 10 lr: more than a flipped step can move
    actual = _moved_record(adam_ref, tmp_path, index, by)
    result = compare(adam_ref, actual)
    assert not result.passed and not any(t.excused for t in result.tensors)
    [d] = diagnose(result, adam_ref, actual)
    assert d.code == "numeric-mismatch" and "accepted_sign_noise" not in d.evidence


def test_a_flip_stays_accepted_while_it_persists_and_only_within_its_bound(adam_ref: Record, tmp_path) -> None:
    # The flipped element stays ~2 lr off at every later step: accepted each time, counted
    # against the one step (0) whose gradient was sign-uncertain - 3 lr at step 2 is too far.
    lr = adam_ref.step(0).param_groups[0]["lr"]

    def stay_off(by_step: dict[int, float]):
        def mutate(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
            if kind == "param" and name == "fc1.weight" and step in by_step:
                t = t.clone()
                t[0, 0] -= by_step[step] * lr
            return t
        return mutate

    persisting = rewrite(adam_ref, tmp_path / "persist", stay_off({0: 2, 1: 2, 2: 2}), meta=dp_layout(2))
    result = compare(adam_ref, persisting)
    assert result.passed, result.summary()
    assert [t.step for t in result.tensors if t.excused] == [0, 1, 2]

    drifting = rewrite(adam_ref, tmp_path / "drift-far", stay_off({0: 2, 1: 2, 2: 3}), meta=dp_layout(2))
    result = compare(adam_ref, drifting)
    assert not result.passed
    assert [t.step for t in result.tensors if t.excused] == [0, 1]
