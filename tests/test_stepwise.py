"""The stepwise comparison (reference.replay) and its noise model, in one process: a replay
from the reference's own state reproduces it bit for bit; a bug is found at the step it
happens; rounding noise that compounds along a trajectory does not fail a correct run; a pure
noise tensor does not blind its siblings' tolerances."""

from __future__ import annotations

import pytest
import torch

from cases import mlp_case
from harness.analysis.compare import compare
from harness.run import compare_to_reference
from harness.analysis.tolerance import CalibratedTolerances
from reference import KINDS, Record, cached_reference
from reference.replay import replay_reference
from tests._records import rewrite


@pytest.fixture(scope="module", params=["adamw", "sgd"])
def case_and_ref(request, tmp_path_factory: pytest.TempPathFactory):
    case = mlp_case(request.param)
    return case, cached_reference(case, cache=tmp_path_factory.mktemp("cache"))


def test_a_replay_from_the_references_own_state_is_the_reference(case_and_ref, tmp_path) -> None:
    case, ref = case_and_ref
    replay = replay_reference(case, ref, tmp_path / "replay")
    assert replay.num_steps == ref.num_steps and replay.meta["replayed_from"] == str(ref.path)
    for step in range(ref.num_steps):
        assert replay.step(step).loss == ref.step(step).loss
        for kind in KINDS:
            assert replay.step(step).names(kind) == ref.step(step).names(kind)
            for name in ref.step(step).names(kind):
                assert torch.equal(replay.tensor(step, kind, name), ref.tensor(step, kind, name)), (step, kind, name)


def test_a_wrong_update_is_found_at_its_step_and_the_next_gradients_from_there(case_and_ref, tmp_path) -> None:
    case, ref = case_and_ref

    def bad_update(step: int, kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
        return t + 0.05 if (step, kind, name) == (1, "param", "fc2.bias") else t

    actual = rewrite(ref, tmp_path / "bad", bad_update)
    result = compare_to_reference(case, actual, cache=tmp_path / "c")
    assert result.mode == "stepwise" and not result.passed
    first = result.first_divergence
    assert (first.step, first.entries) == (1, [("param", "fc2.bias")])
    assert all(t.passed for t in result.tensors if t.step < 1)


def test_rounding_noise_at_every_step_passes_the_stepwise_check(tmp_path) -> None:
    """A run whose gradients carry rounding-sized noise (1e-7 of their magnitude, what another
    reduction order leaves) at every step and whose updates are exactly what AdamW makes of
    them passes, with the calibrated default tolerances; the trajectory view is reported."""
    case = mlp_case("adamw")
    ref = cached_reference(case, cache=tmp_path / "c")
    # Build the "parallel" record by replaying the reference's own steps with the gradients
    # nudged by 1 ulp-scale noise before the optimizer (what another reduction order does).
    from reference.trainer import ReferenceVariant, _Training

    training = _Training.open(case, tmp_path / "noisy", device="cpu", variant=ReferenceVariant(),
                              source="strategy:noisy", meta=None, overwrite=True)
    gen = torch.Generator().manual_seed(0)

    def noisy_step(step: int) -> None:
        rec = training.writer.step(step)
        training.forward_backward(step, rec)
        for _, p in training.named:
            p.grad += 1e-7 * p.grad.abs().max() * torch.randn(p.grad.shape, generator=gen)
        training.record_grads(step)
        training.optimizer.step()
        training.record_update(step, rec)

    noisy = training.train(noisy_step, case.steps)
    stepwise = compare_to_reference(case, noisy, cache=tmp_path / "c")
    assert stepwise.passed, stepwise.summary()
    assert max(t.max_abs for t in stepwise.tensors if t.kind == "grad") > 0  # the noise is there
    assert stepwise.tolerance["mode"] == "calibrated" and stepwise.tolerance["stepwise"]
    assert stepwise.trajectory and "trajectory" in stepwise.summary()


def test_a_pure_noise_tensor_does_not_blind_its_siblings() -> None:
    noise = {
        (0, "grad", "a"): (1e-7, 1.0),
        (0, "grad", "b"): (2e-7, 1.0),
        (0, "grad", "key_bias"): (1e-9, 1e-9),  # exactly zero in exact arithmetic: noise as large as itself
    }
    policy = CalibratedTolerances(noise, ["float64 rerun"], stepwise=True)
    tol = policy.for_tensor(0, "grad", "a", torch.float32, 1.0)
    assert tol.atol < 1e-5, tol  # the median, not the key bias's relative noise of 1.0
    assert policy.for_tensor(0, "grad", "key_bias", torch.float32, 1e-9).atol >= 4e-9  # its own noise still covered
    assert "no reduction noise" in policy.for_tensor(0, "param", "a", torch.float32, 1.0).reason


def test_clipping_is_part_of_the_case_and_of_the_replay(tmp_path) -> None:
    """With grad_clip the reference clips before the optimizer step and records the clipped
    gradients; the replay does the same, so it still reproduces the reference exactly."""
    case = mlp_case("sgd").replace(name="mlp-sgd-clip", grad_clip=0.05)
    ref = cached_reference(case, cache=tmp_path / "c")
    norm = torch.stack([ref.tensor(0, "grad", n).double().norm() for n in ref.step(0).names("grad")]).norm()
    assert norm == pytest.approx(0.05, rel=1e-5)  # the recorded gradients are the clipped ones
    replay = replay_reference(case, ref, tmp_path / "replay")
    for step in range(ref.num_steps):
        for kind in KINDS:
            for name in ref.step(step).names(kind):
                assert torch.equal(replay.tensor(step, kind, name), ref.tensor(step, kind, name)), (step, kind, name)
    with pytest.raises(Exception, match="grad_clip must be a finite max norm > 0 or None"):
        case.replace(grad_clip=-1.0)
