"""Lightning Fabric DDP with gradient accumulation (``no_backward_sync`` between boundaries),
as a Fabric user writes it. The harness sees the model through ``_FabricModule`` and records at
the optimizer's own step. The bug: each micro-batch's loss is backpropagated without dividing by
the accumulation steps (gradients twice the reference's)."""
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler

from cases.catalog import mlp_case

CASE = mlp_case("adamw", steps=2, micro_batches=2)
NPROC = 2


def train(ctx, run, divide=False, strategy="ddp"):
    fabric = Fabric(accelerator="cpu", devices=ctx.world_size, strategy=strategy)
    fabric.launch()  # the harness started the processes: Fabric joins them
    model = fabric.setup_module(CASE.build_model(ctx.device))  # FSDP2 replaces the parameters: optimizer after
    optimizer = fabric.setup_optimizers(CASE.build_optimizer(model.parameters()))
    run.watch(model, optimizer, hook_step=True)                                      # harness
    micro = CASE.global_batch_size // (ctx.world_size * CASE.micro_batches)
    loader = DataLoader(CASE.dataset, batch_size=micro, sampler=DistributedSampler(CASE.dataset, seed=CASE.seed))
    for i, batch in enumerate(loader):
        boundary = (i + 1) % CASE.micro_batches == 0
        with fabric.no_backward_sync(model, enabled=not boundary):
            loss = CASE.loss_fn(model(batch.input), batch.target)
            fabric.backward(loss / CASE.micro_batches if divide else loss)  # BUG unless divided
        run.loss(run.step, loss, batch.id)                                            # harness
        if boundary:
            optimizer.step()
            optimizer.zero_grad()
        if run.done:                                                                  # harness
            break


def correct(ctx, run):
    train(ctx, run, divide=True)


def _fully_shard(model, device_mesh):
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp2(world_size):
    from lightning.fabric.strategies import ModelParallelStrategy

    return ModelParallelStrategy(parallelize_fn=_fully_shard, data_parallel_size=world_size, tensor_parallel_size=1)


def fsdp2(ctx, run, divide=True):
    """Fabric's FSDP2 (ModelParallelStrategy with fully_shard), accumulating the same way."""
    train(ctx, run, divide=divide, strategy=_fsdp2(ctx.world_size))


def fsdp2_bug(ctx, run):
    fsdp2(ctx, run, divide=False)
