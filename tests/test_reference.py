"""The single-device reference: deterministic, right semantics, cached, and clear about bad cases."""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

import reference.cache as cache_module
from cases import mlp_case
from cases.data import SyntheticRegression
from cases.models import TwoLayerMLP
from reference import (
    KINDS,
    Case,
    CaseError,
    NonFiniteReferenceError,
    Record,
    Sample,
    cached_reference,
    case_fingerprint,
    collate,
    global_batch_indices,
    micro_batch_indices,
    replica_micro_batch_indices,
    train_reference,
)


def assert_records_identical(a: Record, b: Record) -> None:
    assert a.num_steps == b.num_steps
    for step in range(a.num_steps):
        sa, sb = a.step(step), b.step(step)
        assert (sa.loss, sa.micro_losses, sa.sample_ids, sa.micro_sample_ids) == (
            sb.loss, sb.micro_losses, sb.sample_ids, sb.micro_sample_ids
        )
        assert sa.param_groups == sb.param_groups
        for kind in KINDS:
            assert sa.names(kind) == sb.names(kind)
            for name in sa.names(kind):
                assert torch.equal(a.tensor(step, kind, name), b.tensor(step, kind, name)), (step, kind, name)


# -- determinism and caching -----------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_reference_is_deterministic_across_runs(tmp_path, optimizer: str) -> None:
    case = mlp_case(optimizer, micro_batches=2)
    first = train_reference(case, tmp_path / "a")
    torch.manual_seed(12345)  # unrelated global RNG use between runs must not matter
    torch.randn(10)
    second = train_reference(case, tmp_path / "b")
    assert_records_identical(first, second)
    assert first.complete and first.num_steps == 3
    assert {n for n in first.step(2).names("optim")} >= {"fc1.weight.exp_avg" if optimizer == "adamw" else "fc1.weight.momentum_buffer"}


def test_reference_survives_save_load_and_cache(tmp_path, monkeypatch) -> None:
    case = mlp_case()
    direct = train_reference(case, tmp_path / "direct")
    cached = cached_reference(case, cache=tmp_path / "cache")
    assert_records_identical(direct, cached)
    assert_records_identical(direct, Record.load(direct.path))

    def no_training(*args, **kwargs):
        raise AssertionError("the cached reference was retrained")

    monkeypatch.setattr(cache_module, "train_reference", no_training)
    again = cached_reference(mlp_case(), cache=tmp_path / "cache")  # an equal, separately built case
    assert again.path == cached.path
    assert_records_identical(direct, again)


def test_fingerprint_changes_with_what_changes_the_numbers() -> None:
    base = mlp_case()
    assert case_fingerprint(base) == case_fingerprint(mlp_case())
    lr = base.replace(optimizer_factory=functools.partial(torch.optim.AdamW, lr=2e-2, weight_decay=0.01))
    variants = [
        lr,
        base.replace(seed=1),
        base.replace(micro_batches=2),
        base.replace(dataset=SyntheticRegression(64, 8, 4, seed=99)),
        base.replace(loss_fn=F.l1_loss),
        base.replace(model_factory=functools.partial(TwoLayerMLP, 8, 32, 4)),
    ]
    prints = {case_fingerprint(c) for c in variants} | {case_fingerprint(base)}
    assert len(prints) == len(variants) + 1


# -- semantics --------------------------------------------------------------------------------


def test_gradient_is_that_of_the_mean_loss_over_the_global_batch(tmp_path) -> None:
    case = mlp_case("sgd", micro_batches=4, steps=1)
    record = train_reference(case, tmp_path / "r")
    model = case.build_model().double()
    batch = collate(case.dataset, global_batch_indices(case, 0), dtype=torch.float64)
    loss = F.mse_loss(model(batch.inputs), batch.targets)
    loss.backward()
    step = record.step(0)
    assert step.loss == pytest.approx(loss.item(), rel=1e-6)
    assert len(step.micro_losses) == 4 and step.micro_sample_ids == [list(collate(case.dataset, i).ids) for i in micro_batch_indices(case, 0)]
    assert sorted(step.sample_ids) == sorted(batch.ids)
    for name, param in model.named_parameters():
        torch.testing.assert_close(record.tensor(0, "grad", name).double(), param.grad, rtol=1e-5, atol=1e-7)


def test_schedule_is_distributed_samplers(tmp_path) -> None:
    case = mlp_case(global_batch_size=16, micro_batches=2, steps=9, num_samples=40)  # 2 steps per epoch
    assert case.steps_per_epoch == 2
    seen_epochs = []
    for step in range(case.steps):
        whole = global_batch_indices(case, step)
        assert len(whole) == 16 and len(set(whole)) == 16
        for world in (1, 2, 4):
            shards = [replica_micro_batch_indices(case, step, r, world) for r in range(world)]
            # Replica micro-batch m lies inside the reference's micro-batch m.
            for m, ref_micro in enumerate(micro_batch_indices(case, step)):
                assert sorted(i for s in shards for i in s[m]) == sorted(ref_micro)
        epoch, k = divmod(step, 2)
        sampler = DistributedSampler(range(40), num_replicas=1, rank=0, shuffle=True, seed=case.seed)
        sampler.set_epoch(epoch)
        assert whole == list(sampler)[k * 16 : (k + 1) * 16]
        seen_epochs.append(tuple(whole))
    assert len(set(seen_epochs)) == len(seen_epochs)  # every epoch is shuffled anew
    with pytest.raises(CaseError, match="not divisible by replicas x micro_batches = 3 x 2"):
        replica_micro_batch_indices(case, 0, 0, 3)


def test_dropout_is_recorded_when_on(tmp_path) -> None:
    off = train_reference(mlp_case(steps=1), tmp_path / "off")
    on_case = mlp_case(steps=1, dropout=0.5)
    on = train_reference(on_case, tmp_path / "on")
    again = train_reference(on_case, tmp_path / "again")
    assert off.meta["dropout"] == {"active": False, "modules": []}
    assert on.meta["dropout"] == {"active": True, "modules": ["dropout"]}
    assert on.step(0).loss != off.step(0).loss
    assert_records_identical(on, again)  # the training RNG is seeded too


# -- cases that cannot be compared -------------------------------------------------------------


class TupleDataset:
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        return torch.ones(8), torch.ones(4)


class DuplicateIdDataset(SyntheticRegression):
    def __getitem__(self, i: int) -> Sample:
        s = super().__getitem__(i)
        return Sample(id=self.id_offset + 5 if i == 3 else s.id, input=s.input, target=s.target)


def _noisy_mlp() -> torch.nn.Module:
    model = TwoLayerMLP()
    with torch.no_grad():
        model.fc2.bias.add_(random.random())  # unseeded: differs between builds
    return model


def test_dataset_without_ids_is_a_clear_error(tmp_path) -> None:
    case = mlp_case().replace(dataset=TupleDataset())
    with pytest.raises(CaseError, match=r"TupleDataset\[\d+\] is a tuple without id, input"):
        train_reference(case, tmp_path / "r")
    assert not (tmp_path / "r").exists()
    dup = mlp_case(steps=4).replace(dataset=DuplicateIdDataset(64, 8, 4))  # 4 steps use all 64
    with pytest.raises(CaseError, match="samples 3 and 5 share id 1005|samples 5 and 3 share id 1005"):
        train_reference(dup, tmp_path / "r")


def test_nondeterministic_model_factory_is_a_clear_error(tmp_path) -> None:
    case = mlp_case().replace(model_factory=_noisy_mlp)
    with pytest.raises(CaseError, match=r"model_factory is not deterministic: two builds after torch.manual_seed\(0\) differ in 'fc2.bias'"):
        train_reference(case, tmp_path / "r")


def test_non_finite_reference_is_a_clear_error_and_keeps_what_was_recorded(tmp_path) -> None:
    huge = functools.partial(torch.optim.SGD, lr=1e30)
    case = mlp_case().replace(optimizer_factory=huge)
    with pytest.raises(NonFiniteReferenceError, match=r"NaN/inf in (param|loss|grad) .* at step \d"):
        train_reference(case, tmp_path / "r")
    partial = Record.load(tmp_path / "r")
    assert not partial.complete and partial.num_steps >= 1


def test_case_validation_names_the_field() -> None:
    with pytest.raises(CaseError, match="global_batch_size 16 is not divisible by micro_batches 3"):
        mlp_case(micro_batches=3)
    with pytest.raises(CaseError, match="steps must be a positive int, got 0"):
        mlp_case(steps=0)
    with pytest.raises(CaseError, match="dtype must be a floating torch.dtype"):
        mlp_case(dtype=torch.int64)
    with pytest.raises(CaseError, match="fewer than one global batch"):
        mlp_case(num_samples=8)
    with pytest.raises(CaseError, match="loss_fn must be callable, or None when the model returns its own loss"):
        Case("x", TwoLayerMLP, SyntheticRegression(), "mse", torch.optim.SGD, 8)  # type: ignore[arg-type]


def test_loss_weight_follows_the_loss_and_gradient_reductions() -> None:
    case = mlp_case(global_batch_size=16)
    assert case.loss_weight(4, 2) == 4 * 2 / 16
    assert case.loss_weight(4, 2, grad_reduction="sum") == 4 / 16
    summed = case.replace(loss_reduction="sum")
    assert summed.loss_weight(4, 2) == 2 / 16 and summed.loss_weight(4, 2, grad_reduction="sum") == 1 / 16
    assert summed.combine_losses([(3.0, 4), (5.0, 4)]) == 8.0 and case.combine_losses([(3.0, 4), (5.0, 12)]) == 4.5
    with pytest.raises(CaseError, match="loss_reduction must be one of"):
        case.replace(loss_reduction="avg")
    with pytest.raises(CaseError, match="grad_reduction must be one of"):
        case.loss_weight(4, 2, grad_reduction="max")


def test_dict_samples_collate_key_by_key_and_cast_only_floating_values() -> None:
    import torch

    from reference.case import collate

    class Dicts:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"id": 100 + i, "x": torch.full((3,), float(i)), "mask": torch.ones(3, dtype=torch.long)}

    batch = collate(Dicts(), [0, 2], dtype=torch.float64)
    assert batch.ids == (100, 102) and batch.targets is None
    assert batch.inputs["x"].dtype == torch.float64 and batch.inputs["mask"].dtype == torch.long
    assert batch.inputs["x"].shape == (2, 3)


def test_build_model_casts_floating_tensors_only_and_the_determinism_check_sees_buffers() -> None:
    import torch
    from torch import nn

    class WithBuffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)), persistent=False)
            self.register_buffer("noise", torch.rand(3), persistent=False)  # unseeded by design below

    case = mlp_case().replace(model_factory=WithBuffers, dtype=torch.bfloat16)
    model = case.build_model()
    assert model.lin.weight.dtype == torch.bfloat16 and model.freqs.dtype == torch.complex64
    assert model.freqs.imag.abs().sum() > 0  # the imaginary part survived
    case.check_model_factory()  # seeded: deterministic, buffers included

    class Unseeded(WithBuffers):
        def __init__(self):
            super().__init__()
            import random

            self.noise = torch.tensor([random.random()])

    with pytest.raises(CaseError, match="not deterministic.*noise"):
        mlp_case().replace(model_factory=Unseeded).check_model_factory()


def test_the_cache_key_covers_dict_samples() -> None:
    """A dataset of dicts ({"id", "input_ids", ...}) is part of the reference's fingerprint like
    a dataset of Samples: other token values must not load the old cached reference."""
    import torch

    from reference.cache import case_fingerprint

    class Dicts:
        def __init__(self, fill: int):
            self.fill = fill

        def __len__(self):
            return 16

        def __getitem__(self, i):
            return {"id": 100 + i, "x": torch.full((3,), float(i + self.fill)), "mask": torch.ones(3, dtype=torch.long)}

    case = mlp_case(global_batch_size=4, steps=1)
    assert case_fingerprint(case.replace(dataset=Dicts(0))) == case_fingerprint(case.replace(dataset=Dicts(0)))
    assert case_fingerprint(case.replace(dataset=Dicts(0))) != case_fingerprint(case.replace(dataset=Dicts(1)))


class _NoFloat64Matmul(torch.nn.Module):
    """A linear layer whose matmul, like ``torch._grouped_mm``, has no float64 kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 8) / 8**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _no_f64_mm(x, self.weight)


def _no_f64_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.harness_test.no_f64_mm(x, w)


def _register_no_f64_mm() -> None:
    """A custom op with a float32 kernel only (what _grouped_mm is on CPU, where it also needs
    16-byte aligned strides), differentiable, so the fallback is exercised forward and backward."""
    if hasattr(torch.ops, "harness_test") and hasattr(torch.ops.harness_test, "no_f64_mm"):
        return

    @torch.library.custom_op("harness_test::no_f64_mm", mutates_args=())
    def no_f64_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64 or w.dtype == torch.float64:
            raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double")
        return x @ w.t()

    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return no_f64_mm(g, w.t().contiguous()), no_f64_mm(g.t().contiguous(), x.t().contiguous())

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    no_f64_mm.register_autograd(backward, setup_context=setup)


def test_the_float64_rerun_runs_ops_without_a_float64_kernel_in_the_case_dtype(tmp_path) -> None:
    """An MoE's grouped matmul has no float64 kernel: the calibration's float64 rerun runs that
    op in float32 (forward and backward), everything else in float64, and its record lists it."""
    from reference import Case, ReferenceVariant, train_reference
    from reference.upcast import UpcastFallback

    _register_no_f64_mm()
    with pytest.raises(RuntimeError, match="got Double"):
        _no_f64_mm(torch.ones(2, 8, dtype=torch.float64), torch.ones(4, 8, dtype=torch.float64))
    case = Case("no-f64-kernel", _NoFloat64Matmul, SyntheticRegression(16, 8, 4), F.mse_loss,
                functools.partial(torch.optim.SGD, lr=0.1), global_batch_size=8, steps=2)
    plain = train_reference(case, tmp_path / "f32")
    upcast = train_reference(case, tmp_path / "f64", variant=ReferenceVariant(upcast=torch.float64))
    assert upcast.meta["upcast_fallback"] == ["no_f64_mm"] and "upcast_fallback" not in plain.meta
    for step in range(2):
        a, b = upcast.tensor(step, "grad", "weight"), plain.tensor(step, "grad", "weight")
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b.double(), rtol=1e-5, atol=1e-6)
    # An op that writes into its argument writes through to the float64 original.
    if not hasattr(torch.ops.harness_test, "no_f64_fill_"):
        @torch.library.custom_op("harness_test::no_f64_fill_", mutates_args=("x",))
        def no_f64_fill_(x: torch.Tensor) -> None:
            if x.dtype == torch.float64:
                raise RuntimeError("no float64 kernel")
            x.fill_(1.5)
    x = torch.zeros(3, dtype=torch.float64)
    with UpcastFallback(torch.float64, torch.float32) as mode:
        torch.ops.harness_test.no_f64_fill_(x)
    assert x.tolist() == [1.5, 1.5, 1.5] and x.dtype == torch.float64 and mode.fell_back == {"no_f64_fill_"}


def _damage(record_dir, how: str) -> str:
    """Damage step 0's file of a cached record ``how`` (its first tensor for "flipped", its last
    for "truncated", all of them for "deleted"); returns which file."""
    target = record_dir / "steps" / "0000.bin"
    if how == "truncated":
        target.write_bytes(target.read_bytes()[:-3])
    elif how == "deleted":
        target.unlink()
    elif how == "flipped":
        data = bytearray(target.read_bytes())
        for i in range(4):
            data[4 + i] ^= 0x7F  # four data bytes: a value off by orders of magnitude, the length unchanged
        target.write_bytes(bytes(data))
    elif how == "meta":
        (record_dir / "meta.json").write_text("{not json")
    return target.name


@pytest.mark.parametrize("how", ["truncated", "deleted", "flipped", "meta"])
def test_a_damaged_cache_entry_is_recomputed_with_a_notice_never_used(tmp_path, capsys, how) -> None:
    case = mlp_case(steps=1)
    first = cached_reference(case, cache=tmp_path / "cache")
    good = {n: first.tensor(0, "grad", n) for n in first.step(0).names("grad")}
    _damage(first.path, how)
    if how != "meta":
        assert first.verify(), "the damage must be visible to verify()"
    again = cached_reference(case, cache=tmp_path / "cache")
    err = capsys.readouterr().err
    assert "is not sound" in err and "recomputed, not used" in err, err
    assert again.verify() == []
    for name, value in good.items():
        assert torch.equal(again.tensor(0, "grad", name), value), name


def test_the_notice_says_what_was_wrong(tmp_path, capsys) -> None:
    case = mlp_case(steps=1)
    first = cached_reference(case, cache=tmp_path / "cache")
    _damage(first.path, "flipped")
    cached_reference(case, cache=tmp_path / "cache")
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "recomputed, not used" in err, err


def test_two_processes_sharing_a_cache_never_read_a_half_written_entry(tmp_path) -> None:
    """Several processes ask for the same uncached reference at once, twice over: each gets a
    complete record whose every file matches its checksum, and the entry left behind is sound."""
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import sys, torch\n"
        "from cases import mlp_case\n"
        "from reference.cache import cached_reference\n"
        "for _ in range(2):\n"
        "    r = cached_reference(mlp_case(steps=2), cache=sys.argv[1])\n"
        "    assert r.complete and r.verify() == [], r.verify()\n"
        "    [r.tensor(s, k, n) for s in range(r.num_steps) for k in ('grad', 'param', 'optim') for n in r.step(s).names(k)]\n"
        "print('ok')\n"
    )
    repo = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "cache")], cwd=repo,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and out.strip() == "ok", err
    final = cached_reference(mlp_case(steps=2), cache=tmp_path / "cache")
    assert final.verify() == []
