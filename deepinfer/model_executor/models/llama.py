"""Llama-family decoder: Llama (SmolLM2, Llama 3.x), Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

The body, the layer and the head are models/decoder.py's; this file holds the family's attention and
its `llama_spec`, which the other Llama-like families (Gemma, Phi-3, the MoE members, GPT-OSS) start
from. Parameter names follow HF checkpoints, with q|k|v and gate|up merged (models/utils.py).

Tensor parallelism (layers/parallel_linear.py, read at construction from tp_size()): q|k|v and
gate|up are column-parallel (each rank its query heads, the KV heads they read, its share of the
intermediate size), o_proj and down_proj row-parallel: one all_reduce per attention block and one
per MLP. The embedding and the LM head hold the rank's vocabulary rows; compute_logits gathers
[N, V] on every rank. Each rank's Attention and cache groups count only its own heads.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.contracts.model import ModelCapabilities
from deepinfer.model_executor.layers.attention.layer import Attention
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.layers.parallel_linear import (
    ColumnParallelLinear,
    check_head_split,
    head_pieces,
    row_parallel_linear,
)
from deepinfer.model_executor.layers.rotary import RotaryEmbedding
from deepinfer.model_executor.models.decoder import DecoderLM, DecoderSpec, dense_mlp, shared_rotary
from deepinfer.model_executor.models.layer_loop import run_layers


@dataclass(frozen=True)
class LlamaConfigFields(HFConfigFields):
    """The optional config fields the Llama family reads (transformers' `LlamaConfig` defaults);
    Gemma, GPT-OSS and the MoE members add theirs in subclasses."""

    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    sliding_window: int | None = None  # the window W of the layers that slide
    layer_types: Sequence[str] | None = None  # None: every layer slides when sliding_window is set
    attention_bias: bool = False  # a bias on q|k|v and o
    mlp_bias: bool = False
    tie_word_embeddings: bool = False


def head_dim_of(cfg, fields: LlamaConfigFields | None = None) -> int:
    """The size of one head: `head_dim`, else hidden_size / num_attention_heads."""
    fields = LlamaConfigFields.of(cfg) if fields is None else fields
    return fields.head_dim or cfg.hidden_size // cfg.num_attention_heads


def windows_of(cfg, fields: LlamaConfigFields | None = None) -> tuple[int | None, ...]:
    """Each layer's window W (HF's: keys p-W+1 .. p), or None for full attention.

    `config.layer_types` says which layers slide (Qwen2/3 from `max_window_layers`, Gemma, GPT-OSS);
    without it (Mistral, Phi-3) every layer slides when `config.sliding_window` is set.
    """
    fields = LlamaConfigFields.of(cfg) if fields is None else fields
    layer_types = fields.layer_types or ("sliding_attention",) * cfg.num_hidden_layers
    return tuple(fields.sliding_window if kind == "sliding_attention" else None
                 for kind in layer_types[:cfg.num_hidden_layers])


def llama_spec(cfg, fields: LlamaConfigFields | None = None, **choices) -> DecoderSpec:
    """The Llama family's decoder for `cfg`, its optional fields read here once (a member family
    passes its own `fields`, a subclass of LlamaConfigFields); `choices` replace fields of the spec
    for a member family (Gemma, Phi-3, the MoE members, GPT-OSS)."""
    fields = LlamaConfigFields.of(cfg) if fields is None else fields
    head_dim = head_dim_of(cfg, fields)
    attention_bias = bool(fields.attention_bias)
    spec = dict(attention=LlamaAttention, mlp=dense_mlp, rotaries=shared_rotary, head_dim=head_dim,
                attn_scale=head_dim**-0.5, windows=windows_of(cfg, fields), o_bias=attention_bias,
                qkv_bias=cfg.model_type == "qwen2" or attention_bias, qk_norm=cfg.model_type == "qwen3",
                mlp_bias=bool(fields.mlp_bias), tie_word_embeddings=bool(fields.tie_word_embeddings),
                layer_loop=functools.partial(run_layers, LlamaAttention))  # layers of exactly this attention
    return DecoderSpec(**{**spec, **choices})


def check_tensor_parallel(cfg, tensor_parallel_size: int) -> None:
    """Refuse, before any process starts, a split this model cannot take (ValueError naming the sizes)."""
    check_head_split(cfg.num_attention_heads, cfg.num_key_value_heads, tensor_parallel_size)
    if cfg.intermediate_size % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide "
                         f"intermediate_size={cfg.intermediate_size}")


class LlamaAttention(nn.Module):
    """The rank's query heads and the KV heads they read (all heads with one rank): merged q|k|v,
    the spec's biases, q/k norm, scale, window and soft-cap."""

    def __init__(self, spec: DecoderSpec, cfg, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = spec.head_dim
        q, kv = head_pieces(cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim)
        self.num_heads, self.num_kv_heads = q.local // self.head_dim, kv.local // self.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q, kv, kv], bias=spec.qkv_bias)
        self.o_proj = row_parallel_linear(q.full, cfg.hidden_size, spec.o_bias, "num_attention_heads * head_dim")
        self.qk_norm = spec.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, spec.norm_offset)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, spec.attn_scale, layer_idx,
                              sliding_window=spec.windows[layer_idx], softcap=spec.attn_softcap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)  # [T, H*D], [T, Hkv*D] x2
        q = q.view(T, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, H_kv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, H_kv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # [T, hidden]


class LlamaForCausalLM(DecoderLM):
    """HF `llama`, `mistral`, `qwen2`, `qwen3`: the decoder (models/decoder.py) with `llama_spec`."""

    # the forward reads only ids, positions and token-group metadata, and keeps no per-request
    # state: decode steps may replay as CUDA graphs (worker/cuda_graphs.py); the layers split
    # over tensor-parallel ranks; every op row-independent on the fp32 CPU path (batch-invariant
    # without the mode); linear layers quantizable at load; no experts, no next-n layers
    capabilities = ModelCapabilities(graph_safe_decode=True, tensor_parallel=True, native_batch_invariant=True,
                                     quantize_at_load=True)

    @classmethod
    def decoder_spec(cls, cfg, expert_parallel_size: int = 1) -> DecoderSpec:
        return llama_spec(cfg)
