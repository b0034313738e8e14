"""The CUDA / NCCL path: ranks on their own GPU with the NCCL backend, a strategy checked
against the reference on GPUs, a bug named there, a hang named from NCCL's Flight Recorder.

Skipped, with the reason, where the machine has too few CUDA devices (CI's CPU runners); a
GPU runner runs exactly this file with ``.ci/gpu`` (``.github/workflows/gpu.yml``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.launch.remote import RankRunner, RanksHung

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(GPUS < n, reason=f"the CUDA/NCCL path needs {n} CUDA device(s), this machine has {GPUS}; "
                                               "a GPU runner runs it with .ci/gpu")


@pytest.fixture(scope="module")
def nccl_runner():
    with RankRunner(backend="nccl", device="cuda", stall_window=3.0) as runner:
        yield runner


def reduce_on_own_gpu(ctx) -> tuple[int, float, str]:
    t = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(t)
    return torch.cuda.current_device(), float(t[0]), str(dist.get_backend())


def skips_a_collective(ctx) -> None:
    t = torch.ones(4, device=ctx.device)
    dist.all_reduce(t)
    if ctx.rank == 0:
        dist.all_reduce(t)  # only rank 0: it waits, rank 1 finishes
    torch.cuda.synchronize()


@needs_gpus(1)
def test_nccl_ranks_each_use_their_own_gpu(nccl_runner) -> None:
    world = min(GPUS, 2)
    result = nccl_runner.run(reduce_on_own_gpu, nproc=world, timeout=120)
    assert sorted(v[0] for v in result.values.values()) == list(range(world))
    assert all(v[1] == sum(range(1, world + 1)) and v[2] == "nccl" for v in result.values.values())


@needs_gpus(1)
def test_ddp_on_gpus_matches_the_reference(nccl_runner, reference_cache, tmp_path) -> None:
    from harness.pipeline import diagnose_target

    report = diagnose_target("ddp", nproc=min(GPUS, 2), runner=nccl_runner, cache=reference_cache, workdir=tmp_path)
    assert report.verdict.verdict == "pass", report.verdict.to_dict()


@needs_gpus(2)
def test_a_bug_on_gpus_is_named(nccl_runner, reference_cache, tmp_path) -> None:
    from harness.pipeline import diagnose_target

    report = diagnose_target("double_averaged_ddp", nproc=2, runner=nccl_runner, cache=reference_cache, workdir=tmp_path)
    assert report.codes == ["grad-double-averaged"], report.verdict.to_dict()


@needs_gpus(1)
def test_fsdp_on_gpus_resumes_bitwise_with_the_cuda_rng_in_the_checkpoint(nccl_runner, reference_cache, tmp_path) -> None:
    # DCP on NCCL: the same API, written from each rank's device memory; each rank's file holds
    # the CUDA generator beside the CPU one, and the gate compares both.
    from harness.pipeline import diagnose_target
    from harness.record.checkpoint import rank_file

    report = diagnose_target("fsdp", nproc=min(GPUS, 2), steps=4, resume_at=2, runner=nccl_runner, cache=reference_cache,
                             workdir=tmp_path)
    resume = report.resume
    assert report.verdict.verdict == "pass", (report.verdict.to_dict(), resume)
    assert resume["load_exact"] and resume["continuation"]["compared"] == "bitwise"
    saved = torch.load(rank_file(tmp_path / "checkpoint", 0), weights_only=True)
    assert "cuda" in saved["rng"], sorted(saved["rng"])


@needs_gpus(2)
def test_a_hang_on_nccl_is_named_from_flight_recorder(nccl_runner) -> None:
    from harness.tracing import diagnose_hang

    with pytest.raises(RanksHung) as info:
        nccl_runner.run(skips_a_collective, nproc=2, timeout=60)
    [found] = diagnose_hang(info.value.outcome)
    assert found.code == "collective-missing" and found.evidence["absent_ranks"] == [1], found
