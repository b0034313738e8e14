"""Which targets can run on simulated ranks, and the reason a target cannot.

Measured with PyTorch 2.13 (README lists it): tensor parallelism (``parallelize_module``),
FSDP2-style ``replicate`` and their 2-D meshes simulate and match the real ranks. Refused:

- a custom training loop: it is the user's own Python per rank (``ctx.rank``, its own
  recorder calls), and simulation runs one program for every rank;
- ``DistributedDataParallel``: its C++ reducer checks and buckets parameters as plain tensors,
  outside the dispatcher the simulation works through (setting it up fails);
- ``fully_shard`` (FSDP2 sharding): it frees and re-allocates unsharded parameters by resizing
  their storage, which a LocalTensor does not have; skipping the resize gives wrong
  gradients that change from run to run, so it is refused rather than trusted;
- pipelining: stages are different programs exchanging activations point to point. Measured
  under ``LocalRunnerMode`` (a thread per stage): the schedule's own p2p (``dist.irecv`` with
  one integer peer) reaches LocalTensor's receive, which only takes what ``local_p2p_op`` sent
  with a peer per rank, and fails (``'LocalTensor' object has no attribute '__src_rank__'``);
- a model with no DTensor parameter at all: its ranks differ only through Python (hand-made
  shards indexed by ``ctx.rank``), which one process cannot run per rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from harness.simulate.world import SimulationError

__all__ = ["DDP_REASON", "REAL_RANKS", "check_setup", "check_target"]

DDP_REASON = ("DDP's C++ reducer checks and buckets parameters as plain tensors, outside the dispatcher that "
              "simulated collectives run through")
REAL_RANKS = "run it on real ranks instead: python -m harness diagnose TARGET --nproc N (or pytest --nproc N)"


def _refuse(what: str, why: str) -> SimulationError:
    return SimulationError(f"cannot simulate {what}: {why}; {REAL_RANKS}")


def check_target(target: Any) -> None:
    """Refuse, before anything runs, what is known not to simulate from the target alone."""
    if getattr(target, "layout", None) is not None:
        raise SimulationError(f"{target.name} is a layout check, not a training target: run harness.simulate.layout."
                              f"check_layout(target.layout) or python -m harness diagnose {target.name}")
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
        raise _refuse(f"{name} (pipeline stages)", "torch.distributed.pipelining sends activations point to point with "
                      "one integer peer for all ranks, which simulated point-to-point (LocalRunnerMode) cannot route; the "
                      "layout check (python -m harness layout --pp P ...) simulates pipeline layouts stage by stage")
    model = modules[0]
    for sub in model.modules():
        if isinstance(sub, DistributedDataParallel):
            raise _refuse(f"{name} (DistributedDataParallel)", DDP_REASON)
        if isinstance(sub, FSDPModule) and not isinstance(sub, ReplicateModule):
            raise _refuse(f"{name} (fully_shard)", "FSDP2 frees and re-allocates unsharded parameters by resizing their "
                          "storage, which simulated tensors do not have (skipping it gives wrong gradients)")
    if not any(is_dtensor(p) for p in model.parameters()):
        raise _refuse(f"{name} (no DTensor parameter)", "its ranks would differ only through Python indexed by "
                      "ctx.rank, and simulated ranks share one program")
    if not isinstance(setup.state.get("dims"), ParallelDims):
        raise _refuse(name, "its setup keeps no ParallelDims in RankSetup.state['dims'] (RankSetup.on_mesh does), so "
                      "each simulated rank's layout (replica, coordinates, groups) is unknown")
