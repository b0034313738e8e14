"""torchtitan's own Llama3 under torchtitan's own ``parallelize_llama`` (FSDP, dp_shard = world
size), checked against the single-device reference: ``python -m harness diagnose
cases/torchtitan_example.py``. Written against torchtitan 0.3.0 (``pip install torchtitan==0.3.0``,
which installs beside torch 2.13 without changing torch).

The model is torchtitan's ``Llama3Model`` built from torchtitan's own 0.3 config builders (the
ones its ``debugmodel`` / 8B flavors use), shrunk to vocab 32, dim 32, 2 layers, 4 heads and a
16-position RoPE cache. Like torchtitan's trainer it is built on the meta device, materialized
with ``to_empty`` and initialized with ``init_states`` (torchtitan's per-parameter
``param_init``: truncated normals, depth-scaled output projections); here on CPU and before
parallelizing, so every rank starts from the reference's weights.

What running torchtitan on CPU (gloo) takes, and how this module does it:

- **triton.** torchtitan 0.3 imports ``triton`` at module level (for CUDA expert-parallel
  kernels reached from ``torchtitan.models.common``) without declaring it; a CPU build of torch
  has none, so ``import torchtitan.models.llama3`` fails. :func:`_stub_triton_kernels_if_no_triton`
  registers a stub for that one torchtitan module (its kernels raise if called; a dense model
  never calls them). ``pip install triton`` instead makes the stub unnecessary.
- **Device type.** ``torchtitan.tools.utils.device_type`` is fixed at import as
  ``torch._utils._get_available_device_type() or "cuda"``: "cuda" on a machine without an
  accelerator. ``ParallelDims.build_mesh`` then builds a "cuda" ``DeviceMesh`` and FSDP on it
  fails ("Torch not compiled with CUDA enabled"). ``torchtitan.distributed.parallel_dims`` and
  ``torchtitan.distributed.utils`` copy the name at import (``from torchtitan.tools.utils import
  device_type``), so :func:`use_device_type` sets it (and ``device_module``) in all three modules
  to the rank's device type before the mesh is built; torchtitan's files are not edited.
- **Attention backend.** torchtitan 0.3's Llama3 builders accept only "flex", "flex_flash" and
  "varlen", and refuse "sdpa" for language models. Flex runs a ``torch.compile``-d kernel over a
  per-document ``BlockMask``, varlen a CUDA kernel; neither is for a CPU backward. The layers
  are built with "flex" and their inner attention swapped for torchtitan's own
  ``ScaledDotProductAttention`` (causal, no masks; the forward is called with token ids only),
  which runs forward and backward on CPU.
- **SPMD backend.** ``ParallelismConfig.spmd_backend`` defaults to "spmd_types", which needs
  the sharding configs ``Llama3Model.Config.update_from_config`` installs from a full trainer
  config and spmd_types annotations. FSDP alone needs none of that: "partial_dtensor" (DTensor
  only for model-parallel axes) makes ``parallelize_llama`` apply plain FSDP2 over the 1-D
  ``fsdp`` mesh, as torchtitan's classic path does.
- **Mixed precision.** ``parallelize_llama`` always installs a ``MixedPrecisionPolicy`` from
  ``training.mixed_precision_param`` (default "bfloat16") and ``mixed_precision_reduce``
  (default "float32"). Both are set to the case dtype, so nothing is cast (a bf16 case also
  reduces in bf16, where torchtitan's default would reduce in fp32); only dtypes in
  ``torchtitan.config.TORCH_DTYPE_MAP`` (float32, bfloat16, float16) can be named.
- **Gradient reduction.** ``apply_fsdp_to_decoder`` calls ``set_gradient_divide_factor(1.0)``
  on every FSDP module: gradients are *summed* over dp (torchtitan's trainer divides the loss by
  the global token count instead). FSDP2 then reduce-scatters with ``PREMUL_SUM(1.0)``, which
  gloo refuses, so ``set_force_sum_reduction_for_comms(True)`` makes it a plain SUM, and each
  micro-batch's mean loss is weighted by ``Case.loss_weight(..., grad_reduction="sum")``.
- **Off.** Activation checkpointing (``ac_config=None``), ``torch.compile``, float8 (no model
  converters), CPU offload and FSDP symmetric memory (CUDA only).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


def _stub_triton_kernels_if_no_triton() -> None:
    """Where triton is not installed, stand in for torchtitan's one module that needs it at import.

    ``torchtitan.distributed.minimal_async_ep.kernels`` (imported by ``torchtitan.models.common``
    through the MoE token dispatcher) does ``import triton`` to define the CUDA kernels of its
    symmetric-memory expert parallelism. That module is registered here as a stub whose every
    kernel raises if called (none is on a dense model's path). triton itself is not faked:
    torch probes for it (``has_triton_package``) and must keep seeing that it is absent."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return

    def kernel(attr: str) -> Any:
        if attr.startswith("__"):  # inspect & co. probe dunders: answer like a plain module
            raise AttributeError(attr)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name}.{attr} is a CUDA triton kernel; triton is not installed")

        unavailable.__name__ = attr
        return unavailable

    stub = types.ModuleType(name, "Stand-in for torchtitan's triton kernels (triton is not installed).")
    stub.__getattr__ = kernel  # type: ignore[method-assign]
    sys.modules[name] = stub


_stub_triton_kernels_if_no_triton()

# Imported after the stub above (hence noqa: E402).
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims as TitanParallelDims  # noqa: E402
from torchtitan.distributed.utils import set_spmd_backend  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common import compute_ffn_hidden_dim  # noqa: E402
from torchtitan.models.llama3 import Llama3Model, parallelize_llama  # noqa: E402

# torchtitan 0.3's Llama3 flavors are built by these module-private helpers (there is no
# public "custom size" builder); using them keeps the tiny model's layout and init torchtitan's.
from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init  # noqa: E402

# Absolute imports: `python -m harness diagnose` loads this file as a top-level module.
from cases.catalog import OPTIMIZERS, lm_loss  # noqa: E402
from cases.data import SyntheticTokens  # noqa: E402
from cases.strategies.fsdp import run_accumulating  # noqa: E402
from harness.parallel_dims import ParallelDims  # noqa: E402
from harness.strategy import DistContextLike, RankSetup, StrategyBase  # noqa: E402
from reference.case import Batch, Case  # noqa: E402

__all__ = [
    "CASE", "NPROC", "STRATEGY", "TorchtitanFSDP", "parallelize_on_cpu", "tiny_llama3", "tiny_llama3_config", "torchtitan_case", "use_device_type",
]

# The backend parallelize_llama takes its classic FSDP path under (see the module docstring).
SPMD_BACKEND = "partial_dtensor"


def tiny_llama3_config(
    *, vocab: int = 32, dim: int = 32, layers: int = 2, heads: int = 4, max_seq_len: int = 16
) -> Llama3Model.Config:
    """A ``Llama3Model.Config`` shaped like torchtitan's flavors (fused QKV, SwiGLU, complex
    RoPE with Llama scaling, no weight tying), at toy size, with SDPA attention."""
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            n_layers=layers,
            dim=dim,
            n_heads=heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),  # SwiGLU 8/3 * dim, rounded: 96
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=max_seq_len, theta=500000, scaling="llama"),
            fuse_qkv=True,
            # The builders refuse "sdpa"; build with "flex" and swap below (nothing is built yet).
            attn_backend="flex",
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def tiny_llama3(**sizes: int) -> nn.Module:
    """torchtitan's ``Llama3Model`` from :func:`tiny_llama3_config`, with real, initialized
    weights on CPU: built on meta, ``to_empty`` and ``init_states`` as torchtitan's trainer
    does. Deterministic after ``torch.manual_seed``; the RoPE cache (a non-persistent complex64
    buffer) is recomputed by ``init_states``. Forward: token ids ``[batch, seq]`` -> logits
    ``[batch, seq, vocab]``."""
    config = tiny_llama3_config(**sizes)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return model


def torchtitan_case(dtype: torch.dtype = torch.float32, steps: int = 3) -> Case:
    """The tiny torchtitan Llama3 on synthetic tokens, mean next-token cross entropy, AdamW."""
    suffix = f"-{str(dtype).removeprefix('torch.')}" if dtype != torch.float32 else ""
    return Case(
        name=f"torchtitan-llama3-adamw{suffix}",
        model_factory=functools.partial(tiny_llama3),
        dataset=SyntheticTokens(64, 8, 32),
        loss_fn=lm_loss,
        optimizer_factory=OPTIMIZERS["adamw"],
        global_batch_size=8,
        steps=steps,
        dtype=dtype,
    )


def use_device_type(device_type: str) -> None:
    """Make torchtitan build meshes and pick devices for ``device_type`` ("cpu" under gloo).

    torchtitan fixes ``device_type`` at import (``_get_available_device_type() or "cuda"``,
    so "cuda" without an accelerator) and two modules copy it by ``from ... import``; each copy
    is set here. A no-op where torchtitan already agrees."""
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    import torchtitan.distributed.utils as tt_dist_utils
    import torchtitan.tools.utils as tt_utils

    device_module = getattr(torch, device_type)  # torch.cpu / torch.cuda, as torchtitan's own lookup
    for module in (tt_utils, tt_dist_utils):
        module.device_type, module.device_module = device_type, device_module
    tt_parallel_dims.device_type = device_type


def _dtype_name(dtype: torch.dtype) -> str:
    # parallelize_llama looks the mixed-precision dtypes up by name in TORCH_DTYPE_MAP.
    for name, value in TORCH_DTYPE_MAP.items():
        if value == dtype:
            return name
    raise ValueError(
        f"torchtitan's parallelize_llama names FSDP dtypes from {sorted(TORCH_DTYPE_MAP)}; "
        f"{dtype} is not one of them"
    )


def parallelize_on_cpu(model: nn.Module, titan_dims: Any, parallelism: ParallelismConfig, dtype: torch.dtype) -> nn.Module:
    """torchtitan's ``parallelize_llama`` as this module runs it on CPU / gloo (see the module
    docstring): mixed precision at ``dtype`` (nothing cast), no compile, no activation
    checkpointing, and plain SUM reductions for FSDP (gloo has no PREMUL_SUM)."""
    name = _dtype_name(dtype)
    parallelize_llama(
        model,
        parallel_dims=titan_dims,
        training=TrainingConfig(mixed_precision_param=name, mixed_precision_reduce=name),
        parallelism=parallelism,
        compile_config=CompileConfig(enable=False),
        ac_config=None,
        dump_folder="",  # only read by activation checkpointing (off)
    )
    # parallelize_llama left divide factor 1 (a sum): gloo has no PREMUL_SUM, use SUM itself.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


class TorchtitanFSDP(StrategyBase):
    """torchtitan's ``parallelize_llama`` with FSDP only (dp_shard = world size), gradients
    summed over dp as torchtitan does, mixed precision off."""

    name = "torchtitan-fsdp"

    def setup(self, case: Case, ctx: DistContextLike) -> RankSetup:
        use_device_type(ctx.device.type)
        set_spmd_backend(SPMD_BACKEND)  # what torchtitan's Trainer does from config.parallelism
        model = case.build_model(ctx.device)
        world = ctx.world_size
        parallelism = ParallelismConfig(data_parallel_shard_degree=world, spmd_backend=SPMD_BACKEND)
        titan_dims = TitanParallelDims.from_config(parallelism, world)
        titan_dims.build_mesh()  # collective: every rank builds it
        parallelize_on_cpu(model, titan_dims, parallelism, case.dtype)
        # The recorder's view: every rank a data-parallel replica of a 1-D dp mesh.
        dims = ParallelDims(dp=world)
        return RankSetup.on_mesh(
            case, ctx, model, dims, titan_dims.get_mesh("fsdp"), grad_reduction="sum", titan_dims=titan_dims
        )

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
        # Each micro-batch's mean loss weighted by loss_weight(n, dp, grad_reduction="sum") (the
        # state's "grad_reduction"); reduce-scatter only on the last (set_requires_gradient_sync).
        return run_accumulating(case, setup, micro_batches)


CASE = torchtitan_case()
STRATEGY = TorchtitanFSDP()
NPROC = 2
