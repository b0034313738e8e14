"""Which targets can run on simulated ranks, and the reason a target cannot.

Measured with PyTorch 2.13 (README lists it): tensor parallelism (``parallelize_module``),
FSDP2-style ``replicate`` and their 2-D meshes simulate and match the real ranks. Refused:

- a custom training loop: it is the user's own Python per rank (``ctx.rank``, its own
  recorder calls), and simulation runs one program for every rank;
- ``DistributedDataParallel``: its C++ reducer copies gradients into flat buckets that are
  plain tensors, outside the dispatcher the simulation works through;
- ``fully_shard`` (FSDP2 sharding): it frees and re-allocates unsharded parameters by resizing
  their storage, which a LocalTensor does not have; skipping the resize gives wrong
  gradients that change from run to run, so it is refused rather than trusted;
- pipelining: stages are different programs exchanging activations point to point, which
  needs ``LocalRunnerMode`` threads; not wired yet;
- a model with no DTensor parameter at all: its ranks differ only through Python (hand-made
  shards indexed by ``ctx.rank``), which one process cannot run per rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from harness.simulate.world import SimulationError

__all__ = ["REAL_RANKS", "check_setup", "check_target", "patch_fsdp_storage"]

REAL_RANKS = "run it on real ranks instead: python -m harness diagnose TARGET --nproc N (or pytest --nproc N)"


def _refuse(what: str, why: str) -> SimulationError:
    return SimulationError(f"cannot simulate {what}: {why}; {REAL_RANKS}")


def check_target(target: Any) -> None:
    """Refuse, before anything runs, what is known not to simulate from the target alone."""
    if getattr(target, "train", None) is not None:
        raise _refuse(
            f"{target.name} (a custom training loop)",
            "a custom loop is its own Python on every rank (ctx.rank, its own recorder calls) and simulated "
            "ranks run one program for all ranks",
        )


def check_setup(name: str, setup: Any) -> None:
    """Refuse a strategy whose set-up model or layout cannot be simulated faithfully."""
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from harness.parallel_dims import ParallelDims
    from reference.record import is_dtensor

    modules = [setup.model] if isinstance(setup.model, nn.Module) else list(setup.model)
    if setup.layout.stages is not None or len(modules) != 1:
        raise _refuse(f"{name} (pipeline stages)", "pipeline stages are different programs that exchange activations "
                      "point to point (that needs LocalRunnerMode threads, not supported yet)")
    model = modules[0]
    for sub in model.modules():
        if isinstance(sub, DistributedDataParallel):
            raise _refuse(f"{name} (DistributedDataParallel)", "DDP's C++ reducer copies gradients into flat buckets "
                          "outside the dispatcher that simulated collectives run through")
        if isinstance(sub, FSDPModule) and not isinstance(sub, ReplicateModule):
            raise _refuse(f"{name} (fully_shard)", "FSDP2 frees and re-allocates unsharded parameters by resizing their "
                          "storage, which simulated tensors do not have (skipping it gives wrong gradients)")
    if not any(is_dtensor(p) for p in model.parameters()):
        raise _refuse(f"{name} (no DTensor parameter)", "its ranks would differ only through Python indexed by "
                      "ctx.rank, and simulated ranks share one program")
    if not isinstance(setup.state.get("dims"), ParallelDims):
        raise _refuse(name, "its setup keeps no ParallelDims in RankSetup.state['dims'] (RankSetup.on_mesh does), so "
                      "each simulated rank's layout (replica, coordinates, groups) is unknown")


def patch_fsdp_storage() -> Any:
    """Context: FSDP2's storage resize skipped for LocalTensors (``replicate`` never frees a
    sharded copy, so its values are unaffected); plain tensors as before."""
    import contextlib

    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group
    from torch.distributed._local_tensor import LocalTensor

    def skipping(fn: Any) -> Any:
        def resize(tensor: Any) -> None:
            if not isinstance(tensor, LocalTensor):
                fn(tensor)
        return resize

    stack = contextlib.ExitStack()
    for module, names in ((fsdp_param, ("free_storage", "alloc_storage")), (fsdp_group, ("alloc_storage",))):
        for attr in names:
            original = getattr(module, attr)
            setattr(module, attr, skipping(original))
            stack.callback(setattr, module, attr, original)
    return stack
