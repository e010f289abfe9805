"""Gemma 3 (text): local (sliding-window) and global layers, each kind with its own RoPE; and the
Gemma spec that Gemma 2 (models/gemma2.py) shares.

Differences from the Llama family (llama.py), whose attention and spec it starts from:

    norms       RMSNorm multiplies by (1 + w); four per layer (around attention and around the MLP)
    q/k norm    per head, before RoPE (Gemma 3; Gemma 2 has none)
    RoPE        `config.rope_parameters[layer_type]`: a local base for sliding layers, a global one
                (Gemma 2: one RoPE for all layers)
    scale       attention scores times query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5)
    soft-caps   attention logits cap * tanh(s / cap) when `attn_logit_softcapping` is set (Gemma 2),
                final logits when `final_logit_softcapping` is set
    MLP         GeGLU: gelu_tanh(gate) * up
    embedding   multiplied by sqrt(hidden), rounded to the compute dtype first
    head        tied to the embedding unless the config says otherwise

Parameter names are HF's `Gemma3ForCausalLM` / `Gemma2ForCausalLM` names, with q|k|v and gate|up
merged (models/utils.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.contracts.model import ModelCapabilities
from deepinfer.model_executor.layers.activation import gelu_tanh_and_mul
from deepinfer.model_executor.layers.rotary import RotaryEmbedding, rope_inv_freq
from deepinfer.model_executor.models.decoder import DecoderLM, DecoderSpec
from deepinfer.model_executor.models.llama import LlamaConfigFields, llama_spec

GEMMA_NORM_OFFSET = 1.0  # Gemma's RMSNorm scales by (1 + w)
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
_LAYER_TYPES = ("sliding_attention", "full_attention")


def check_gemma_config(cfg, attn_softcap, final_softcap, bidirectional: bool) -> None:
    """Refuse the options this model does not implement, naming the field and value."""
    if bidirectional:
        raise ValueError("use_bidirectional_attention=True is not supported: decoding is causal")
    if cfg.hidden_activation not in _GELU_TANH:
        raise ValueError(f"hidden_activation={cfg.hidden_activation!r} is not supported; "
                         "expected gelu_pytorch_tanh")
    if set(cfg.layer_types) - set(_LAYER_TYPES) or len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types must name sliding_attention/full_attention for each of "
                         f"{cfg.num_hidden_layers} layers; got {cfg.layer_types}")
    for field, cap in (("attn_logit_softcapping", attn_softcap), ("final_logit_softcapping", final_softcap)):
        if cap is not None and not cap > 0:
            raise ValueError(f"{field}={cap!r} must be a positive number or None")


@dataclass(frozen=True)
class GemmaConfigFields(LlamaConfigFields):
    """The optional config fields Gemma 2 and 3 read beside the Llama family's; the head is tied
    unless the config says otherwise."""

    attn_logit_softcapping: float | None = None  # None: no cap on the attention logits
    final_logit_softcapping: float | None = None  # None: no cap on the final logits
    use_bidirectional_attention: bool = False
    tie_word_embeddings: bool = True


def gemma_spec(cfg, qk_norm: bool, rotaries) -> DecoderSpec:
    """The Gemma decoder for `cfg` (the optional fields read here once); Gemma 3 and Gemma 2 differ
    in `qk_norm` and their RoPE tables."""
    fields = GemmaConfigFields.of(cfg)
    attn_softcap, final_softcap = fields.attn_logit_softcapping, fields.final_logit_softcapping
    check_gemma_config(cfg, attn_softcap, final_softcap, fields.use_bidirectional_attention)
    return llama_spec(cfg, fields, qk_norm=qk_norm, rotaries=rotaries, act=gelu_tanh_and_mul,
                      attn_scale=cfg.query_pre_attn_scalar**-0.5, attn_softcap=attn_softcap,
                      final_softcap=final_softcap, norm_offset=GEMMA_NORM_OFFSET, sandwich_norms=True,
                      embed_scale=True)


def gemma3_rotaries(spec: DecoderSpec, cfg, max_positions: int) -> list[RotaryEmbedding]:
    """One RoPE per layer kind, from `rope_parameters[kind]`; layer i takes its kind's."""
    tables = {}
    for kind in sorted(set(cfg.layer_types)):
        inv_freq, scaling = rope_inv_freq(cfg, spec.head_dim, cfg.rope_parameters[kind], kind)
        tables[kind] = RotaryEmbedding(inv_freq, max_positions, scaling)
    return [tables[kind] for kind in cfg.layer_types]


class Gemma3ForCausalLM(DecoderLM):
    """HF `gemma3_text`: the decoder (models/decoder.py) with `gemma_spec`."""

    # as the Llama family: CUDA-graph-safe decode (token groups only, no per-request state), split
    # over tensor-parallel ranks, row-independent on the fp32 CPU path, quantizable at load
    capabilities = ModelCapabilities(graph_safe_decode=True, tensor_parallel=True, native_batch_invariant=True,
                                     quantize_at_load=True)

    @classmethod
    def decoder_spec(cls, cfg, expert_parallel_size: int = 1) -> DecoderSpec:
        return gemma_spec(cfg, qk_norm=True, rotaries=gemma3_rotaries)
