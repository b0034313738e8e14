"""Real third-party model code: tiny Hugging Face ``transformers`` models built from configs in
code (nothing is downloaded), as cases the harness checks like its own.

``transformers`` is an optional dependency (``pip install -e ".[test]"``); importing this module
works without it, building a model does not. The factories are module-level partials so a case
travels to the ranks by pickling.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from reference.case import Case

from .catalog import OPTIMIZERS, lm_loss
from .data import SyntheticTokens

__all__ = [
    "HF_MODELS",
    "LabelledTokens",
    "Conv1DColwise",
    "Conv1DRowwise",
    "bert_tp_plan",
    "gpt2_tp_plan",
    "hf_case",
    "hf_lm_loss",
    "llama_tp_plan",
    "tiny_gpt2",
    "tiny_llama",
]


def tiny_llama(*, vocab: int = 32, hidden: int = 32, layers: int = 2, heads: int = 4, seq: int = 16) -> nn.Module:
    """``LlamaForCausalLM`` with 2 layers, hidden 32 (random init, no cache)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq, use_cache=False,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def tiny_gpt2(*, vocab: int = 32, hidden: int = 32, layers: int = 2, heads: int = 4, seq: int = 16) -> nn.Module:
    """``GPT2LMHeadModel`` with 2 layers, hidden 32, dropout off (random init, no cache)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager",
        bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def tiny_qwen3(*, vocab: int = 32, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, seq: int = 16) -> nn.Module:
    """``Qwen3ForCausalLM`` with 2 layers, hidden 32: per-head RMSNorms on queries and keys
    (``q_norm``, ``k_norm``, weights of size head_dim shared by every head), the parameters a
    head-sharding tensor-parallel plan keeps replicated while their gradients come from sharded
    heads (random init, no cache)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=seq, use_cache=False, attn_implementation="eager", tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config)


def tiny_qwen2_moe(*, vocab: int = 32, hidden: int = 32, layers: int = 2, heads: int = 4, experts: int = 4, seq: int = 16,
                   router_loss: bool = False) -> nn.Module:
    """``Qwen2MoeForCausalLM`` with 2 layers of 4 experts (top-2) and a shared expert; its experts
    run ``torch._grouped_mm``, which has no float64 kernel. ``router_loss``: the model's loss adds
    the load-balancing loss of the router (``output_router_logits``, coefficient 0.01), a
    statistic of the tokens of each forward (random init, no cache)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, num_experts=experts, num_experts_per_tok=2, max_position_embeddings=seq,
        use_cache=False, output_router_logits=router_loss, router_aux_loss_coef=0.01, attn_implementation="eager",
        tie_word_embeddings=False,
    )
    return Qwen2MoeForCausalLM(config)


def tiny_bert(*, vocab: int = 32, hidden: int = 32, layers: int = 2, heads: int = 4, seq: int = 16,
              attention: str = "eager") -> nn.Module:
    """``BertForMaskedLM`` with 2 layers, hidden 32, and BERT's default dropout: 0.1 on the
    hidden states and 0.1 on the attention probabilities (a mask over every head), as the
    config ships (random init). ``attention="sdpa"``: transformers' default, the attention
    dropout drawn inside ``scaled_dot_product_attention``."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=2 * hidden, max_position_embeddings=seq, attn_implementation=attention,
    )
    return BertForMaskedLM(config)


HF_MODELS = {"llama": tiny_llama, "bert": tiny_bert, "bert-sdpa": functools.partial(tiny_bert, attention="sdpa"), "gpt2": tiny_gpt2, "qwen3": tiny_qwen3, "qwen2-moe": tiny_qwen2_moe,
             "qwen2-moe-router-loss": functools.partial(tiny_qwen2_moe, router_loss=True)}


def hf_lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of a causal LM's output: a Hugging Face ``ModelOutput``
    (its ``logits``), or plain logits."""
    logits = output.logits if hasattr(output, "logits") else output
    return lm_loss(logits, targets)


class LabelledTokens(Dataset):
    """A plain ``torch.utils.data.Dataset`` in the Hugging Face style: each item is a dict
    ``{"id", "input_ids", "attention_mask", "labels"}`` (the model shifts the labels and
    computes its own loss). The sample id is the item's ``"id"`` key."""

    def __init__(self, num_samples: int = 64, seq_len: int = 8, vocab: int = 32):
        self.tokens = SyntheticTokens(num_samples, seq_len, vocab)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.tokens[index]
        row = torch.cat([sample.input, sample.target[-1:]])
        return {"id": sample.id, "input_ids": row, "attention_mask": torch.ones_like(row), "labels": row}


def hf_case(
    model: str = "llama",
    *,
    optimizer: str = "adamw",
    dtype: torch.dtype = torch.float32,
    steps: int = 3,
    global_batch_size: int = 8,
    micro_batches: int = 1,
    seq_len: int = 8,
    model_loss: bool = False,
    per_replica: tuple[str, ...] = (),
) -> Case:
    """A tiny Hugging Face causal LM (``"llama"`` or ``"gpt2"``) on synthetic tokens.
    ``model_loss``: dict batches (:class:`LabelledTokens`) and the loss the model computes from
    its ``labels`` (``loss_fn=None``), as Hugging Face training code does. ``per_replica``: the
    case's declared per-replica statistics (``("loss",)`` for a router's load-balancing loss)."""
    if model not in HF_MODELS:
        raise ValueError(f"unknown Hugging Face model {model!r}; allowed: {', '.join(HF_MODELS)}")
    suffix = f"-{str(dtype).removeprefix('torch.')}" if dtype != torch.float32 else ""
    return Case(
        name=f"hf-{model}-{optimizer}{suffix}" + ("-model-loss" if model_loss else "") + ("-per-replica" if per_replica else ""),
        model_factory=functools.partial(HF_MODELS[model]),
        dataset=LabelledTokens(64, seq_len, 32) if model_loss else SyntheticTokens(64, seq_len, 32),
        loss_fn=None if model_loss else hf_lm_loss,
        optimizer_factory=OPTIMIZERS[optimizer],
        global_batch_size=global_batch_size,
        micro_batches=micro_batches,
        steps=steps,
        dtype=dtype,
        per_replica=per_replica,
    )


def llama_tp_plan() -> dict[str, ParallelStyle]:
    """Megatron-style tensor parallelism of every Llama decoder layer, by module-name pattern:
    q/k/v and the MLP's gate/up column-wise (local heads and columns), o and down row-wise."""
    from .strategies.tp import colwise, rowwise

    return {
        "model.layers.*.self_attn.[qkv]_proj": colwise(),
        "model.layers.*.self_attn.o_proj": rowwise(),
        "model.layers.*.mlp.[gu][ap]*_proj": colwise(),  # gate_proj, up_proj
        "model.layers.*.mlp.down_proj": rowwise(),
    }


class _Conv1DStyle:
    """Shared by the Conv1D styles: partition a ``Conv1D`` with :meth:`_conv1d_placement` per
    parameter, with the style's own input / output handling; other modules as the base style."""

    def _conv1d_placement(self, pname: str) -> Any:
        raise NotImplementedError

    def _partition_conv1d_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, param in module.named_parameters():
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [self._conv1d_placement(pname)], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            ))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module).__name__ != "Conv1D":
            return super()._apply(module, device_mesh)  # type: ignore[misc]
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DColwise(_Conv1DStyle, ColwiseParallel):
    """``ColwiseParallel`` that also takes transformers' ``Conv1D`` (GPT-2's linear layers,
    whose weight is ``[in, out]``): the weight is sharded on dim 1, the bias on dim 0."""

    def _conv1d_placement(self, pname: str) -> Any:
        return Shard(1) if pname == "weight" else Shard(0)


class Conv1DRowwise(_Conv1DStyle, RowwiseParallel):
    """``RowwiseParallel`` that also takes transformers' ``Conv1D``: the weight (``[in, out]``)
    is sharded on dim 0, the bias replicated; the input arrives sharded on its last dim."""

    def _conv1d_placement(self, pname: str) -> Any:
        return Shard(0) if pname == "weight" else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module).__name__ == "Conv1D":
            self.desired_input_layouts = (Shard(-1),)
        return super()._apply(module, device_mesh)


def bert_tp_plan() -> dict[str, ParallelStyle]:
    """Megatron-style tensor parallelism of BERT's encoder layers: query/key/value and the
    intermediate dense column-wise (each rank attends with its own heads), the attention output
    and output dense row-wise."""
    from .strategies.tp import colwise, rowwise

    return {
        "bert.encoder.layer.*.attention.self.query": colwise(),
        "bert.encoder.layer.*.attention.self.key": colwise(),
        "bert.encoder.layer.*.attention.self.value": colwise(),
        "bert.encoder.layer.*.attention.output.dense": rowwise(),
        "bert.encoder.layer.*.intermediate.dense": colwise(),
        "bert.encoder.layer.*.output.dense": rowwise(),
    }


def gpt2_tp_plan() -> dict[str, ParallelStyle]:
    """Tensor parallelism of GPT-2's MLPs (``c_fc`` column-wise, ``c_proj`` row-wise). The
    attention stays replicated: its fused ``c_attn`` splits q/k/v by a global width, so an even
    column split would hand a rank parts of two of them."""
    return {
        "transformer.h.*.mlp.c_fc": Conv1DColwise(input_layouts=Replicate(), output_layouts=Shard(-1)),
        "transformer.h.*.mlp.c_proj": Conv1DRowwise(input_layouts=Shard(-1), output_layouts=Replicate()),
    }
