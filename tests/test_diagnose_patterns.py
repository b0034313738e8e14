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
from harness.compare import compare
from harness.diagnose import diagnose
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


@pytest.fixture(scope="module")
def adam_ref(tmp_path_factory: pytest.TempPathFactory) -> Record:
    """An AdamW reference whose fc1.weight[0, 0] gradient at step 0 is within rounding of 0."""
    base = cached_reference(mlp_case("adamw"), cache=tmp_path_factory.mktemp("adam-cache"))

    def tiny(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
        if (step, kind, name) == (0, "grad", "fc1.weight"):
            t = t.clone()
            t[0, 0] = 1e-12
        return t

    return rewrite(base, tmp_path_factory.mktemp("adam-ref") / "ref", tiny, source="reference")


def _param_moved(ref: Record, path: Path, index: tuple[int, int], by: float) -> list:
    def move(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
        if (step, kind, name) == (0, "param", "fc1.weight"):
            t = t.clone()
            t[index] += by
        return t

    actual = rewrite(ref, path / f"run-{next(_serial)}", move, meta=dp_layout(2))
    return diagnose(compare(ref, actual), ref, actual)


def test_an_adam_step_on_a_near_zero_gradient_is_explained_as_rounding(adam_ref: Record, tmp_path) -> None:
    lr = adam_ref.step(0).param_groups[0]["lr"]
    [d] = _param_moved(adam_ref, tmp_path, (0, 0), -2 * lr)  # the sign of a ~0 gradient flipped
    assert d.code == "numeric-mismatch"
    assert "likely rounding, not a bug" in d.summary
    assert d.evidence["adaptive_sign_noise"]["elements"] == {"fc1.weight": 1}
    assert "exp_avg_sq" in d.evidence["likely_source"]


@pytest.mark.parametrize(("index", "by"), [((0, 1), -0.02), ((0, 0), -0.2)])
def test_other_parameter_differences_get_no_rounding_excuse(adam_ref: Record, tmp_path, index, by: float) -> None:
    # (0, 1): its gradient is clearly non-zero; (0, 0) by 10 lr: more than a flipped step can move
    [d] = _param_moved(adam_ref, tmp_path, index, by)
    assert d.code == "numeric-mismatch"
    assert "adaptive_sign_noise" not in d.evidence and "not a bug" not in d.summary
