"""Gemma 3 (text): local (sliding-window) and global layers, each kind with its own RoPE; and the
Gemma body that Gemma 2 (models/gemma2.py) shares.

Differences from the Llama family (llama.py), whose attention, MLP, head and loading it reuses:

    norms       RMSNorm multiplies by (1 + w); four per layer (around attention and around the MLP)
    q/k norm    per head, before RoPE (Gemma 3; Gemma 2 has none)
    RoPE        `config.rope_parameters[layer_type]`: a local base for sliding layers, a global one
                (Gemma 2: one RoPE for all layers)
    scale       attention scores times query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5)
    soft-caps   attention logits cap * tanh(s / cap) when `attn_logit_softcapping` is set (Gemma 2),
                final logits when `final_logit_softcapping` is set
    MLP         GeGLU: gelu_tanh(gate) * up
    embedding   multiplied by sqrt(hidden), rounded to the compute dtype first

Parameter names are HF's `Gemma3ForCausalLM` / `Gemma2ForCausalLM` names, with q|k|v and gate|up
merged (models/utils.py).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.contracts.model import ModelCapabilities
from deepinfer.model_executor.layers.activation import gelu_tanh_and_mul
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.layers.parallel_linear import vocab_parallel_embedding, vocab_parallel_head
from deepinfer.model_executor.layers.rotary import RotaryEmbedding, rope_inv_freq
from deepinfer.model_executor.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of

GEMMA_NORM_OFFSET = 1.0  # Gemma's RMSNorm scales by (1 + w)
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def gemma3_rotary(cfg, layer_type: str, max_positions: int) -> RotaryEmbedding:
    """The RoPE of one layer kind ("sliding_attention" or "full_attention")."""
    inv_freq, scaling = rope_inv_freq(cfg, head_dim_of(cfg), cfg.rope_parameters[layer_type], layer_type)
    return RotaryEmbedding(inv_freq, max_positions, scaling)


def check_gemma_config(cfg) -> None:
    """Refuse the options this model does not implement, naming the field and value."""
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported: decoding is causal")
    if cfg.hidden_activation not in _GELU_TANH:
        raise ValueError(f"hidden_activation={cfg.hidden_activation!r} is not supported; "
                         "expected gelu_pytorch_tanh")
    kinds = set(cfg.layer_types) - {"sliding_attention", "full_attention"}
    if kinds or len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types must name sliding_attention/full_attention for each of "
                         f"{cfg.num_hidden_layers} layers; got {cfg.layer_types}")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = getattr(cfg, field, None)
        if cap is not None and not cap > 0:
            raise ValueError(f"{field}={cap!r} must be a positive number or None")


def gemma_norm(cfg, size: int | None = None) -> RMSNorm:
    """Gemma's RMSNorm: weights stored as an offset from 1."""
    return RMSNorm(size or cfg.hidden_size, cfg.rms_norm_eps, offset=GEMMA_NORM_OFFSET)


class GemmaAttention(LlamaAttention):
    """Llama attention (merged qkv, window from `layer_types`) with Gemma's scale, the configured
    logit soft-cap, and Gemma 3's q/k norm when `qk_norm`."""

    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool):
        super().__init__(cfg, layer_idx, rotary)
        self.attn.scale = cfg.query_pre_attn_scalar**-0.5
        self.attn.softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm, self.k_norm = gemma_norm(cfg, self.head_dim), gemma_norm(cfg, self.head_dim)


class GemmaMLP(LlamaMLP):
    """GeGLU: down(gelu_tanh(gate) * up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))  # [T, hidden]


class GemmaDecoderLayer(nn.Module):
    """h += post_attn_norm(attn(input_norm(h))); h += post_ffw_norm(mlp(pre_ffw_norm(h)))."""

    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer_idx, rotary, qk_norm)
        self.mlp = GemmaMLP(cfg)
        self.input_layernorm, self.post_attention_layernorm = gemma_norm(cfg), gemma_norm(cfg)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = gemma_norm(cfg), gemma_norm(cfg)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(h))  # [T, hidden]
        h = h + self.post_attention_layernorm(attn)  # [T, hidden]
        mlp = self.mlp(self.pre_feedforward_layernorm(h))  # [T, hidden]
        return h + self.post_feedforward_layernorm(mlp)  # [T, hidden]


class GemmaModel(nn.Module):
    """Scaled embedding, the layers (layer i with the RoPE of its kind, `rotary[layer_types[i]]`), norm."""

    def __init__(self, cfg, rotary: dict[str, RotaryEmbedding], qk_norm: bool):
        super().__init__()
        self.embed_tokens = vocab_parallel_embedding(cfg.vocab_size, cfg.hidden_size)
        # sqrt(hidden) as float32, cast with the model: rounded to the compute dtype as in HF
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, rotary[kind], qk_norm)
                                    for i, kind in enumerate(cfg.layer_types))
        self.norm = gemma_norm(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        h = h * self.embed_scale.to(h.dtype)  # [T, hidden]
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)  # [T, hidden]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """HF `gemma3_text`. forward() returns hidden states; compute_logits() soft-caps if configured.

    The LM head (tied unless the checkpoint has `lm_head.weight`), `attention_layers()` and
    `load_weights()` are the Llama family's; only the body and the logit cap differ. A Gemma
    variant (Gemma 2) sets `qk_norm` and `rotaries`.
    """

    # as the Llama family: CUDA-graph-safe decode (token groups only, no per-request state), split
    # over tensor-parallel ranks
    capabilities = ModelCapabilities(graph_safe_decode=True, tensor_parallel=True)
    qk_norm = True

    def __init__(self, cfg, max_positions: int):
        nn.Module.__init__(self)  # not LlamaForCausalLM.__init__: that would build a Llama body
        check_gemma_config(cfg)
        self.config = cfg
        self.model = GemmaModel(cfg, self.rotaries(cfg, max_positions), self.qk_norm)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = vocab_parallel_head(cfg.hidden_size, cfg.vocab_size)
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)

    @staticmethod
    def rotaries(cfg, max_positions: int) -> dict[str, RotaryEmbedding]:
        """One RoPE per layer kind, from `rope_parameters[kind]`."""
        return {kind: gemma3_rotary(cfg, kind, max_positions) for kind in sorted(set(cfg.layer_types))}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # [N, V]
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap  # [N, V]
