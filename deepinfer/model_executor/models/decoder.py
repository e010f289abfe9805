"""The decoder body every family but DeepSeek-V4 shares: one body, one layer, one constructor path.

    h      = embed_tokens(ids)                  * sqrt(hidden) with `embed_scale` (in the compute dtype)
    h[rows] = picture embeds                    a picture model's `picture_rows`, after the scale (as HF)
    layer  : a = self_attn(positions, input_layernorm(h))                           [T, hidden]
             h = h + a                          sandwich: h + post_attention_layernorm(a)
             m = mlp(post_attention_layernorm(h))          sandwich: mlp(pre_feedforward_layernorm(h))
             h = h + m                          sandwich: h + post_feedforward_layernorm(m)
    hidden = norm(h)                                                                [T, hidden]
    logits = head(hidden)                       cap * tanh(logits / cap) with `final_softcap`  [N, V]

A family is a `DecoderLM` subclass whose `decoder_spec(cfg)` returns a `DecoderSpec`: the factories
of its attention, of each layer's MLP or MoE block and of its RoPE tables, and every optional HF
config field the family reads, resolved there once (nothing else probes the config). Parameter names
are HF's: `model.embed_tokens`, `model.layers.{i}.{self_attn,mlp,input_layernorm,...}`, `model.norm`,
`lm_head` (absent when tied to the embedding).

`vocab_split`: the embedding and the LM head hold the rank's vocabulary rows and compute_logits
gathers [N, V] on every rank (the Llama family); else both are held whole (DeepSeek-V2/V3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.contracts.model import ModelCapabilities, NoRequestState
from deepinfer.model_executor.layers.activation import GatedMLP, silu_and_mul
from deepinfer.model_executor.layers.attention.layer import Attention, attention_cache_groups, bind_attention_caches
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.layers.parallel_linear import (
    gather_vocab_logits,
    vocab_parallel_embedding,
    vocab_parallel_head,
)
from deepinfer.model_executor.layers.quant_linear import head_logits
from deepinfer.model_executor.layers.rotary import RotaryEmbedding, rope_inv_freq
from deepinfer.model_executor.models.utils import load_weights


@dataclass(frozen=True)
class DecoderSpec:
    """One family's decoder for one config. Factories (called once per layer):

    attention(spec, cfg, layer_idx, rotary) -> `self_attn`, called as self_attn(positions, x)
    mlp(spec, cfg, layer_idx, expert_parallel_size) -> `mlp` (dense or MoE), called as mlp(x)
    rotaries(spec, cfg, max_positions) -> one RoPE table per layer (layers of a kind share one)
    """

    attention: Callable[..., nn.Module]
    mlp: Callable[..., nn.Module]
    rotaries: Callable[..., Sequence[RotaryEmbedding]]
    head_dim: int = 0
    attn_scale: float = 1.0  # attention scores times this (head_dim ** -0.5 unless the family says)
    windows: tuple[int | None, ...] = ()  # per layer: its sliding window W, or None (full attention)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    attn_softcap: float | None = None  # attention logits cap * tanh(s / cap)
    mlp_bias: bool = False
    act: Callable = silu_and_mul  # the dense MLP's gated activation over [gate | up]
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's 1.0
    sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP too
    embed_scale: bool = False  # embedding times sqrt(hidden), rounded to the compute dtype first
    final_softcap: float | None = None  # logits cap * tanh(logits / cap)
    tie_word_embeddings: bool = False  # the LM head is the embedding table
    vocab_split: bool = True  # embedding and head split by vocabulary over tensor-parallel ranks
    # (DecoderModel, positions, h) -> h after its layers run as straight calls, or None to run the
    # modules (models/layer_loop.py); None: always the modules
    layer_loop: Callable | None = None


def dense_mlp(spec: DecoderSpec, cfg, layer_idx: int, expert_parallel_size: int = 1) -> GatedMLP:
    """The gated MLP of `intermediate_size`, split over tensor-parallel ranks."""
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, spec.act, spec.mlp_bias)


def shared_rotary(spec: DecoderSpec, cfg, max_positions: int) -> list[RotaryEmbedding]:
    """One RoPE table (the config's rope parameters over head_dim) that every layer shares."""
    inv_freq, scaling = rope_inv_freq(cfg, spec.head_dim)
    return [RotaryEmbedding(inv_freq, max_positions, scaling)] * cfg.num_hidden_layers


class DecoderLayer(nn.Module):
    """HF names: `self_attn`, `mlp`, `input_layernorm`, `post_attention_layernorm` (and Gemma's
    `pre_feedforward_layernorm`, `post_feedforward_layernorm`)."""

    def __init__(self, spec: DecoderSpec, cfg, layer_idx: int, rotary, expert_parallel_size: int = 1):
        super().__init__()
        self.layer_idx, self.sandwich = layer_idx, spec.sandwich_norms
        self.self_attn = spec.attention(spec, cfg, layer_idx, rotary)
        self.mlp = spec.mlp(spec, cfg, layer_idx, expert_parallel_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.norm_offset)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.norm_offset)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]."""
        attn = self.self_attn(positions, self.input_layernorm(h))  # [T, hidden]
        if not self.sandwich:
            h = h + attn  # [T, hidden]
            return h + self.mlp(self.post_attention_layernorm(h))  # [T, hidden]
        h = h + self.post_attention_layernorm(attn)  # [T, hidden]
        mlp = self.mlp(self.pre_feedforward_layernorm(h))  # [T, hidden]
        return h + self.post_feedforward_layernorm(mlp)  # [T, hidden]


class DecoderModel(nn.Module):
    """`embed_tokens`, `layers`, `norm`: input ids [T] -> final hidden states [T, hidden]."""

    def __init__(self, spec: DecoderSpec, cfg, rotaries: Sequence, expert_parallel_size: int = 1):
        super().__init__()
        embedding = vocab_parallel_embedding if spec.vocab_split else nn.Embedding
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        if spec.embed_scale:  # sqrt(hidden) as float32, cast with the model: rounded to the compute dtype as in HF
            self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(DecoderLayer(spec, cfg, i, rotaries[i], expert_parallel_size)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.norm_offset)
        self.scaled = spec.embed_scale
        self.layer_loop = spec.layer_loop
        self._layer_plan = None  # the layer loop's plan of these layers (kept and checked by the loop)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, picture_rows=None) -> torch.Tensor:
        """`picture_rows` (rows [P], embeds [P, hidden]): those packed rows take the pictures'
        encoder output instead of the (scaled) token embedding; picture rows are not scaled."""
        h = self.embed_tokens(input_ids)  # [T, hidden]
        if self.scaled:
            h = h * self.embed_scale.to(h.dtype)  # [T, hidden]
        if picture_rows is not None:
            rows, embeds = picture_rows
            h = h.index_copy(0, rows, embeds.to(h.dtype))  # [T, hidden]
        elif self.layer_loop is not None:
            out = self.layer_loop(self, positions, h)  # [T, hidden], or None
            if out is not None:
                return self.norm(out)  # [T, hidden]
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)  # [T, hidden]

    def _apply(self, fn, *args, **kwargs):
        self._layer_plan = None  # moved or cast: the kernels' call class is decided again
        return super()._apply(fn, *args, **kwargs)


class DecoderLM(NoRequestState, nn.Module):
    """forward() returns hidden states; compute_logits() runs the LM head on selected rows only.

    A family subclass sets `capabilities` and `decoder_spec(cfg)` (which may refuse a config with a
    ValueError naming the field), and overrides what else differs (loading, caches)."""

    capabilities = ModelCapabilities()

    def __init__(self, cfg, max_positions: int = 0, expert_parallel_size: int = 1):
        super().__init__()
        self.spec = spec = self.decoder_spec(cfg, expert_parallel_size)
        self.config, self.max_positions, self.expert_parallel_size = cfg, max_positions, expert_parallel_size
        self.rotaries = spec.rotaries(spec, cfg, max_positions)  # [L] (a list: not registered here)
        self.model = DecoderModel(spec, cfg, self.rotaries, expert_parallel_size)
        self.tie_word_embeddings = spec.tie_word_embeddings
        if not spec.tie_word_embeddings:
            head = vocab_parallel_head if spec.vocab_split else _whole_head
            self.lm_head = head(cfg.hidden_size, cfg.vocab_size)

    @classmethod
    def decoder_spec(cls, cfg, expert_parallel_size: int = 1) -> DecoderSpec:
        """The family's spec for `cfg` (a ValueError naming the field for a config it cannot run)."""
        raise NotImplementedError(f"{cls.__name__} declares no decoder_spec")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, picture_rows=None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden]; `picture_rows` as `DecoderModel.forward`."""
        return self.model(input_ids, positions, picture_rows)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, V] on every rank (with several ranks, a collective)."""
        if not self.spec.vocab_split:
            return self.lm_head(hidden)  # [N, V]
        head = self.model.embed_tokens if self.tie_word_embeddings else self.lm_head
        logits = gather_vocab_logits(head_logits(head, hidden), self.config.vocab_size)  # [N, V]
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap  # [N, V]

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


def _whole_head(hidden_size: int, vocab_size: int) -> nn.Linear:
    return nn.Linear(hidden_size, vocab_size, bias=False)
