"""GPT-OSS (HF `gpt_oss`): alternating sliding-window and full attention with learned sinks, and a
top-k MoE whose experts are MXFP4 in the released checkpoints (kept packed here).

Differences from the Llama family (llama.py), whose attention, cache protocol, head and loading it reuses:

    layers      `layer_types`: sliding_attention (window `sliding_window`, 128) / full_attention
    attention   q/k/v/o with biases; a learned sink per head (`self_attn.sinks` [H]): the softmax
                denominator gains exp(sink - max), with no value row
    RoPE        YaRN (transformers' rope init: inverse frequencies and the cos/sin scale)
    MLP         router (`mlp.router`, a Linear with bias): top-k of the logits, softmax over those k;
                experts (layers/mxfp4_moe.py): biases, interleaved gate|up, clamped SwiGLU
                (alpha 1.702, limit `swiglu_limit`), MXFP4 blocks + scales or dense weights

Tensor parallelism: the attention heads split as in the Llama family, each rank holding its heads'
sinks; embedding and LM head split by vocabulary; the router is held whole by every rank.

Expert parallelism (`expert_parallel_size` ep, dividing tensor_parallel_size n and the experts): a
rank holds the experts of its slice (E / ep, `expert_piece`), read alone from the checkpoint; the
first rank of each slice computes the slice's partial output (`computes_expert_slice`), the other
n / ep - 1 holders add zeros, and one all_reduce sums them. With ep = 1 every rank holds all
experts and computes the whole MoE output itself, on the replicated activations, with no collective
(rank 0 computing alone and an all_reduce would leave the others waiting in it: the same wall time
plus one collective per layer).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.contracts.model import ModelCapabilities
from deepinfer.distributed.parallel_state import all_reduce, tp_size
from deepinfer.model_executor.layers.mxfp4_moe import SWIGLU_ALPHA, OssExperts
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.layers.parallel_linear import (
    ShardSpec,
    computes_expert_slice,
    even_piece,
    vocab_parallel_embedding,
    vocab_parallel_head,
)
from deepinfer.model_executor.layers.rotary import RotaryEmbedding, rope_inv_freq
from deepinfer.model_executor.models.llama import LlamaAttention, LlamaForCausalLM, head_dim_of

_LAYER_TYPES = ("sliding_attention", "full_attention")
_SINKS_WEIGHT = ".self_attn.sinks.weight"


def mxfp4_experts_of(cfg) -> bool:
    """Whether the checkpoint stores the experts in MXFP4 (`quantization_config.quant_method == "mxfp4"`);
    a ValueError for any other quantization."""
    quant = getattr(cfg, "quantization_config", None)
    if not quant:
        return False
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    if quant.get("quant_method") != "mxfp4":
        raise ValueError(f"gpt_oss: quantization_config.quant_method={quant.get('quant_method')!r} is not "
                         f"supported (mxfp4 experts, or none)")
    return True


def check_gpt_oss_config(cfg, expert_parallel_size: int = 1) -> None:
    """Refuse the options this model does not implement, naming the field and value."""
    if expert_parallel_size > 1 and cfg.num_local_experts % expert_parallel_size:
        raise ValueError(f"num_local_experts={cfg.num_local_experts} is not divisible by "
                         f"expert_parallel_size={expert_parallel_size}")
    types = list(cfg.layer_types or [])
    if len(types) != cfg.num_hidden_layers or set(types) - set(_LAYER_TYPES):
        raise ValueError(f"layer_types must name sliding_attention/full_attention for each of "
                         f"{cfg.num_hidden_layers} layers; got {cfg.layer_types}")
    if "sliding_attention" in types and not cfg.sliding_window:
        raise ValueError(f"sliding_window={cfg.sliding_window!r}: sliding_attention layers need a window")
    if not getattr(cfg, "attention_bias", True):
        raise ValueError("attention_bias=False is not supported (GPT-OSS projections have biases)")
    mxfp4_experts_of(cfg)


class GptOssAttention(LlamaAttention):
    """Llama attention (merged q|k|v with biases, window from `layer_types`) plus one sink per query head."""

    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(cfg, layer_idx, rotary)
        piece = even_piece(cfg.num_attention_heads, "num_attention_heads")  # the rank's heads
        self.sinks = nn.Parameter(torch.zeros(piece.local))  # [H_local]
        if tp_size() > 1:
            self.shard_specs = {"sinks": ShardSpec(0, (piece,))}

    def bind_sinks(self) -> None:
        """Hand the attention layer its sinks as fp32 (after loading and the dtype cast)."""
        self.attn.sinks = self.sinks.detach().float()  # [H_local]


class GptOssMoE(nn.Module):
    """Router (top-k of the logits, softmax over the k) and the experts: all of them, or with
    expert_parallel_size > 1 the rank's slice, whose partial outputs one all_reduce sums."""

    def __init__(self, cfg, expert_parallel_size: int = 1):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        self.experts = OssExperts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size,
                                  mxfp4_experts_of(cfg), cfg.swiglu_limit,
                                  getattr(cfg, "swiglu_alpha", SWIGLU_ALPHA), expert_parallel_size)
        self.split = expert_parallel_size > 1  # fixed at construction: partial outputs summed over the ranks
        self.computes_experts = not self.split or computes_expert_slice(expert_parallel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)  # [T, E]
        top, ids = logits.topk(self.top_k, dim=-1)  # [T, k] each
        out = self.experts(x, ids, top.softmax(dim=-1)) if self.computes_experts else torch.zeros_like(x)  # [T, H]
        return all_reduce(out) if self.split else out  # [T, hidden]


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary: RotaryEmbedding, expert_parallel_size: int):
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer_idx, rotary)
        self.mlp = GptOssMoE(cfg, expert_parallel_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h))  # [T, hidden]
        return h + self.mlp(self.post_attention_layernorm(h))  # [T, hidden]


class GptOssModel(nn.Module):
    def __init__(self, cfg, max_positions: int, expert_parallel_size: int):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(cfg, head_dim_of(cfg))
        rotary = RotaryEmbedding(inv_freq, max_positions, scaling)
        self.embed_tokens = vocab_parallel_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i, rotary, expert_parallel_size)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)  # [T, hidden]


class GptOssForCausalLM(LlamaForCausalLM):
    """HF `gpt_oss`. forward() returns hidden states; compute_logits() runs the LM head on selected rows.

    The cache protocol (token groups: one paged "full" group, one "swa" ring), the LM head and
    `load_weights` are the Llama family's: parameters carry HF's names, MXFP4 experts their
    checkpoint's `*_blocks` / `*_scales` (a rank's experts read alone under expert parallelism).
    """

    # no per-request state; attention splits over tensor-parallel ranks, routed experts over
    # expert_parallel_size groups. Decode is not graph-safe: the per-expert path reads expert counts
    # back to the host (and the held pairs are counted on the host under expert parallelism)
    capabilities = ModelCapabilities(tensor_parallel=True, expert_parallel=True)

    def __init__(self, cfg, max_positions: int, expert_parallel_size: int = 1):
        nn.Module.__init__(self)  # not LlamaForCausalLM.__init__: that would build a Llama body
        check_gpt_oss_config(cfg, expert_parallel_size)
        self.config = cfg
        self.model = GptOssModel(cfg, max_positions, expert_parallel_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = vocab_parallel_head(cfg.hidden_size, cfg.vocab_size)

    def bind_caches(self, caches) -> None:
        super().bind_caches(caches)
        for layer in self.model.layers:
            layer.self_attn.bind_sinks()
            layer.mlp.experts.bind_kernels(caches.backend.kernels.name)

    def load_weights(self, weights) -> None:
        """HF-named tensors; a GGUF file's sinks arrive as `self_attn.sinks.weight`."""
        super().load_weights((name.removesuffix(".weight") if name.endswith(_SINKS_WEIGHT) else name, tensor)
                             for name, tensor in weights)

    def expert_weight_bytes(self) -> int:
        """Bytes of the routed experts' matrices this rank holds (packed MXFP4: blocks + scales)."""
        return sum(layer.mlp.experts.weight_bytes() for layer in self.model.layers)
