"""torchtitan's own tensor parallelism (parallelize_llama, tp = 2, sequence parallel) on its Llama3.

torchtitan's Llama3 is the tiny model of ``cases/torchtitan_example.py``, over 2 TP ranks on
CPU / gloo: torchtitan's ``ParallelDims`` with tp = world size, the sharding configs
``Llama3Model.Config.update_from_config`` installs (sequence parallel on, torchtitan's default)
and torchtitan's ``parallelize_llama``. Parameters become DTensors on torchtitan's
``("fsdp", "tp")`` mesh (fsdp of size 1), which the harness gathers itself: the loop declares no
shard.

The loss is torchtitan's normalisation, each token's loss over the step's global token count
(``train_step``: the count summed over the ``batch`` mesh when dp is enabled, else the local
count). The bug: the token count summed over every rank (``dist.all_reduce`` on the default
group), TP peers included; they see the same tokens, so the count is tp times too large and
the gradients are 1/tp of the reference's.

What running torchtitan's TP path on CPU takes beyond the FSDP example's (its docstring):
- **Sharding configs before build.** Under the "partial_dtensor" backend ``Module.parallelize``
  distributes every module whose config carries a ``sharding_config``; llama3's are installed
  on the config by ``update_from_config(config=...)`` (any object with a ``parallelism``
  field), so the config is updated and the model built from it, seeded and initialized as
  :func:`cases.torchtitan_example.tiny_llama3` does (the reference's weights), then
  parallelized: the full weights are sharded, not drawn per shard.
- **Logits.** llama3's ``lm_head`` leaves its output vocab-sharded (``Shard(-1)`` on tp: 0.3
  always computes torchtitan's loss loss-parallel). Without loss parallel, as torchtitan's
  classic plan (``output_layouts=Replicate(), use_local_output=True``), the output is made
  replicated with ``full_tensor()``; the case's loss runs on the full logits.
- **FSDP at degree 1.** ``parallelize_llama`` always applies ``fully_shard`` (here over the
  size-1 ``fsdp`` mesh) for its ``MixedPrecisionPolicy``: dtypes are the case's and gloo gets
  plain SUM reductions, as in the FSDP example. Async TP (a compile pass) and float8 (a model
  converter) are off: no compile, no converters.
"""
from types import SimpleNamespace

import torch
import torch.distributed as dist

# First: importing it stubs torchtitan's triton kernels where triton is absent.
from cases.torchtitan_example import parallelize_on_cpu, tiny_llama3_config, torchtitan_case, use_device_type
from harness.parallel_dims import ParallelDims
from torchtitan.config import ParallelismConfig
from torchtitan.distributed import ParallelDims as TitanParallelDims
from torchtitan.distributed.utils import set_spmd_backend

CASE = torchtitan_case(steps=2)
NPROC = 2


def tp_llama3(ctx, parallelism):
    """The reference's tiny Llama3, under torchtitan's TP over a tp = world mesh."""
    use_device_type(ctx.device.type)
    set_spmd_backend(parallelism.spmd_backend)  # what torchtitan's Trainer does from the config
    titan_dims = TitanParallelDims.from_config(parallelism, ctx.world_size)
    titan_dims.build_mesh()  # collective
    config = tiny_llama3_config()
    config.update_from_config(config=SimpleNamespace(parallelism=parallelism))  # llama3's TP sharding configs
    torch.manual_seed(CASE.seed)  # as Case.build_model: the same draws as the reference
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=ctx.device)
    with torch.no_grad():
        model.init_states(buffer_device=ctx.device)
    parallelize_on_cpu(model, titan_dims, parallelism, CASE.dtype)
    return model.train(), titan_dims


def global_tokens(titan_dims, local, over_world=False):
    """The step's token count, as torchtitan's ``train_step`` sums it."""
    count = torch.tensor(local)
    if over_world:
        dist.all_reduce(count)  # BUG: TP peers counted as if they read other tokens
    elif titan_dims.dp_enabled:
        dist.all_reduce(count, group=titan_dims.get_mesh("batch").get_group())
    return count


def train(ctx, run, over_world=True):
    world = ctx.world_size
    parallelism = ParallelismConfig(tensor_parallel_degree=world, spmd_backend="partial_dtensor")
    model, titan_dims = tp_llama3(ctx, parallelism)
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, ParallelDims(tp=world).layout(ctx.rank))             # harness
    for step in range(run.steps):
        batches = run.batches(step)
        tokens = global_tokens(titan_dims, sum(b.targets.numel() for b in batches), over_world)
        for batch in batches:
            logits = model(batch.inputs).full_tensor()  # vocab-sharded DTensor -> replicated, local
            loss = CASE.loss_fn(logits, batch.targets)  # mean over this micro-batch's tokens
            # torchtitan's weight: its tokens over the step's (run.loss_weight(batch, "sum") here)
            (loss * batch.targets.numel() / tokens).backward()
            run.loss(step, loss if run.layout.holds_loss else None, batch.ids)        # harness
        run.before_step(step)                                                         # harness
        optimizer.step()
        run.after_step(step)                                                          # harness
        optimizer.zero_grad()


def correct(ctx, run):
    train(ctx, run, over_world=False)
