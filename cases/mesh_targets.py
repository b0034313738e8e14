"""DTensor and mesh targets for 8 ranks: TP=8 (seed 001 section 5's node, on the 8-head
transformer) and seed 000 section 9's ``[dp=4, tp=2]`` mesh with global batch 32. On the mesh,
each data-parallel replica reads 8 samples; both TP ranks of a replica read the same 8 (TP
splits heads and MLP columns, never the batch again); gradients are averaged over the 4 ranks
that hold the same TP shard (FSDP2-style ``replicate`` on ``dp``).

They run on 8 real ranks (``--nproc 8``) or, on a machine with fewer cores, on 8 simulated
ranks (``--simulate 8``). ``SIMULATION_DEMO`` is what ``python -m harness diagnose --simulate 8``
runs: every bug named with its code, the correct strategies passing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from harness.parallel_dims import ParallelDims
from harness.strategy import RankSetup
from harness.targets.target import Target
from reference.case import collate
from reference.schedule import micro_batch_indices, replica_micro_batch_indices

from .catalog import transformer_case, wide_transformer_case
from .strategies.hybrid import DDPTensorParallelStrategy, apply_replicate
from .strategies.tp import TensorParallelStrategy, apply_tensor_parallel

__all__ = ["MESH_TARGETS", "SIMULATION_DEMO"]

SEED_BATCH = 32  # seed 000 section 9: global batch 32 over dp=4 -> 8 samples per replica


def _case(**options):
    return transformer_case(global_batch_size=SEED_BATCH, num_samples=128, **options)


class PerRankBatches(DDPTensorParallelStrategy):
    """BUG: batches sharded by global rank, as if every rank were its own replica: the two TP
    ranks of a replica read different samples."""

    name = "dp-tp-per-rank-batches"

    def local_batches(self, case, setup, step):
        shards = replica_micro_batch_indices(case, step, dist.get_rank(), dist.get_world_size())
        return [collate(case.dataset, idx, device=setup.device, dtype=case.dtype) for idx in shards]


class UnshardedSampler(DDPTensorParallelStrategy):
    """BUG: every replica reads the whole global batch (no sampler sharding over dp)."""

    name = "dp-tp-unsharded-sampler"

    def local_batches(self, case, setup, step):
        return [collate(case.dataset, idx, device=setup.device, dtype=case.dtype) for idx in micro_batch_indices(case, step)]


class SwappedMeshDims(DDPTensorParallelStrategy):
    """BUG: the mesh is built with its dims in the wrong order (``(tp, dp)``), while the data
    loader and the declared layout use ``rank // tp`` as the replica: each "tp" group holds ranks
    of different replicas, which read different samples."""

    name = "dp-tp-swapped-mesh"

    def setup(self, case, ctx):
        dims = ParallelDims.for_world(ctx.world_size, tp=self.tp)
        mesh = init_device_mesh(ctx.device.type, (dims.tp, dims.dp), mesh_dim_names=("tp", "dp"))
        model = case.build_model(ctx.device)
        apply_tensor_parallel(model, mesh["tp"], self.plan)
        apply_replicate(model, mesh["dp"])
        return RankSetup.on_mesh(case, ctx, model, dims, mesh)


def _target(name: str, strategy, code: str | None, description: str, **case_options) -> Callable[[], Target]:
    def build() -> Target:
        return Target(name, _case(**case_options), strategy, nproc=8, expected_code=code, description=description)

    return build


def _tp8(name: str, code: str | None, description: str, **case_options) -> Callable[[], Target]:
    def build() -> Target:
        return Target(name, wide_transformer_case(**case_options), TensorParallelStrategy(), nproc=8, expected_code=code,
                      description=description)

    return build


MESH_TARGETS: dict[str, Callable[[], Target]] = {
    "dp4-tp2": _target("dp4-tp2", DDPTensorParallelStrategy(tp=2), None,
                       "seed 000 section 9: [dp=4, tp=2] mesh, global batch 32, replicate over dp, TP over tp"),
    "dp4-tp2-per-rank-batches": _target("dp4-tp2-per-rank-batches", PerRankBatches(tp=2), "inconsistent-replica-inputs",
                                        PerRankBatches.__doc__.split(":")[1].strip()),
    "dp4-tp2-unsharded-sampler": _target("dp4-tp2-unsharded-sampler", UnshardedSampler(tp=2), "duplicate-samples",
                                         UnshardedSampler.__doc__.split(":")[1].strip()),
    "tp8": _tp8("tp8", None, "TP=8 inside a node (seed 001 section 5) on the 8-head transformer"),
    "tp8-dropout": _tp8("tp8-dropout", None, "TP=8 with dropout: the 8 peers draw the reference's masks "
                        "(pure TP reads the whole batch on every rank, so one device's masks are matched)", dropout=0.1),
    "dp4-tp2-swapped-mesh": _target("dp4-tp2-swapped-mesh", SwappedMeshDims(tp=2), "swapped-mesh-dims",
                                    SwappedMeshDims.__doc__.split(":")[1].strip()),
}

# (target, expected code or None) for the simulated demo at 8 ranks: the bundled DTensor bug
# cases (cases/bugs: tensor parallelism, here with tp=8), this module's mesh bugs, and the
# correct counterparts.
SIMULATION_DEMO: list[tuple[str, str | None]] = [
    ("tp_per_rank_batches", "inconsistent-replica-inputs"),
    ("tp_rank_seeded_dropout", "rng-desync"),
    ("dp4-tp2-per-rank-batches", "inconsistent-replica-inputs"),
    ("dp4-tp2-unsharded-sampler", "duplicate-samples"),
    ("dp4-tp2-swapped-mesh", "swapped-mesh-dims"),
    ("dp4-tp2", None),
    ("tp8", None),
    ("tp8-dropout", None),
    ("seed-8gpu", None),  # the layout check of the same mesh (cases.layouts)
]
