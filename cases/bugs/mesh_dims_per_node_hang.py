"""A 2 x 2 mesh whose dim names are ordered differently on some ranks, so the ranks disagree
on which process group is "dp" - and the job hangs.

Real-world class: a mesh shape or dim order computed from per-node settings (an environment
variable set on one node, a config default that differs): ranks 0-1 all-reduce gradients over
the groups of mesh dim 0, ranks 2-3 over those of mesh dim 1; every all-reduce waits for a
partner that is in another group.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from cases.catalog import mlp_case

from ._manual_dp import ManualDataParallel

EXPECTED_CODE = "collective-missing"
NPROC = 4
# It hangs at step 0: the hang is named once no rank has made progress for STALL_WINDOW s, however
# long the ranks took to reach it on a loaded machine; TIMEOUT only caps a run that never stalls.
TIMEOUT = 120
STALL_WINDOW = 3
CASE = mlp_case("adamw", steps=2)


class PerNodeMeshOrder(ManualDataParallel):
    name = "manual-dp-per-node-mesh-order"

    def setup(self, case, ctx):
        setup = super().setup(case, ctx)
        # BUG: the second node lists the dims the other way round
        names = ("dp", "replica") if ctx.rank < 2 else ("replica", "dp")
        mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=names)
        setup.state["dp_group"] = mesh.get_group("dp")
        return setup

    def forward_backward(self, case, setup, micro_batches):
        self._group = setup.state["dp_group"]
        return super().forward_backward(case, setup, micro_batches)

    def sync_grads(self, model, world_size):
        import torch.distributed as dist

        for p in model.parameters():
            dist.all_reduce(p.grad, group=self._group)
            p.grad /= world_size


def STRATEGY():
    return PerNodeMeshOrder()


