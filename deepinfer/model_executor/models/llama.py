"""Llama-family decoder: Llama (SmolLM2, Llama 3.x), Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

Parameter names follow HF checkpoints, with q|k|v and gate|up merged (models/utils.py).

Tensor parallelism (layers/parallel_linear.py, read at construction from tp_size()): q|k|v and
gate|up are column-parallel (each rank its query heads, the KV heads they read, its share of the
intermediate size), o_proj and down_proj row-parallel: one all_reduce per attention block and one
per MLP. The embedding and the LM head hold the rank's vocabulary rows; compute_logits gathers
[N, V] on every rank. Each rank's Attention and cache groups count only its own heads.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.contracts.model import ModelCapabilities, NoRequestState
from deepinfer.model_executor.layers.activation import silu_and_mul
from deepinfer.model_executor.layers.attention.layer import Attention, attention_cache_groups, bind_attention_caches
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.layers.parallel_linear import (
    ColumnParallelLinear,
    check_head_split,
    even_piece,
    gather_vocab_logits,
    head_pieces,
    row_parallel_linear,
    vocab_parallel_embedding,
    vocab_parallel_head,
)
from deepinfer.model_executor.layers.quant_linear import head_logits
from deepinfer.model_executor.layers.rotary import RotaryEmbedding, rope_inv_freq
from deepinfer.model_executor.models.utils import load_weights


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def sliding_window_of(cfg, layer_idx: int) -> int | None:
    """The layer's window W (HF's: keys p-W+1 .. p), or None for full attention.

    `config.layer_types` says which layers slide (Qwen2/3 from `max_window_layers`, Gemma 3);
    without it (Mistral) every layer slides when `config.sliding_window` is set.
    """
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if window is None or layer_types is None:
        return window
    return window if layer_types[layer_idx] == "sliding_attention" else None


def check_tensor_parallel(cfg, tensor_parallel_size: int) -> None:
    """Refuse, before any process starts, a split this model cannot take (ValueError naming the sizes)."""
    check_head_split(cfg.num_attention_heads, cfg.num_key_value_heads, tensor_parallel_size)
    if cfg.intermediate_size % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide "
                         f"intermediate_size={cfg.intermediate_size}")


class LlamaAttention(nn.Module):
    """The rank's query heads and the KV heads they read (all heads with one rank)."""

    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        q, kv = head_pieces(cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim)
        self.num_heads, self.num_kv_heads = q.local // self.head_dim, kv.local // self.head_dim
        bias = cfg.model_type == "qwen2" or getattr(cfg, "attention_bias", False)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q, kv, kv], bias=bias)
        self.o_proj = row_parallel_linear(q.full, cfg.hidden_size, getattr(cfg, "attention_bias", False),
                                          "num_attention_heads * head_dim")
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                              layer_idx, sliding_window=sliding_window_of(cfg, layer_idx))

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


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        inter, bias = cfg.intermediate_size, getattr(cfg, "mlp_bias", False)
        piece = even_piece(inter, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [piece, piece], bias=bias)
        self.down_proj = row_parallel_linear(inter, cfg.hidden_size, bias, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h))  # [T, hidden]
        return h + self.mlp(self.post_attention_layernorm(h))  # [T, hidden]


class LlamaModel(nn.Module):
    def __init__(self, cfg, max_positions: int):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(cfg, head_dim_of(cfg))
        rotary = RotaryEmbedding(inv_freq, max_positions, scaling)
        self.embed_tokens = vocab_parallel_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rotary) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)  # [T, hidden]


class LlamaForCausalLM(NoRequestState, nn.Module):
    """forward() returns hidden states; compute_logits() runs the LM head on selected rows only."""

    # the forward reads only ids, positions and token-group metadata, and keeps no per-request
    # state: decode steps may replay as CUDA graphs (worker/cuda_graphs.py); the layers split
    # over tensor-parallel ranks; no experts, no next-n layers
    capabilities = ModelCapabilities(graph_safe_decode=True, tensor_parallel=True)

    def __init__(self, cfg, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = vocab_parallel_head(cfg.hidden_size, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, V] on every rank (with several ranks, a collective)."""
        head = self.model.embed_tokens if self.tie_word_embeddings else self.lm_head
        return gather_vocab_logits(head_logits(head, hidden), self.config.vocab_size)  # [N, V]

    # ---- caches (the CachedModel protocol) -------------------------------------------------
    def cache_groups(self) -> list:
        return attention_cache_groups(self.attention_layers())

    def bind_caches(self, caches) -> None:
        bind_attention_caches(self.attention_layers(), caches)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights) -> None:
        skip = ("lm_head.",) if self.tie_word_embeddings else ()
        loaded = load_weights(self, weights, skip_prefixes=skip)
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
