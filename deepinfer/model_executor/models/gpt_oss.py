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

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.contracts.model import ModelCapabilities
from deepinfer.distributed.parallel_state import all_reduce, tp_size
from deepinfer.model_executor.layers.mxfp4_moe import SWIGLU_ALPHA, OssExperts
from deepinfer.model_executor.layers.parallel_linear import ShardSpec, computes_expert_slice, even_piece
from deepinfer.model_executor.layers.rotary import RotaryEmbedding
from deepinfer.model_executor.layers.router import Router, RouterSpec
from deepinfer.model_executor.models.decoder import DecoderLM, DecoderSpec
from deepinfer.model_executor.models.llama import LlamaAttention, LlamaConfigFields, llama_spec

_LAYER_TYPES = ("sliding_attention", "full_attention")
_SINKS_WEIGHT = ".self_attn.sinks.weight"


def mxfp4_experts_of(quant) -> bool:
    """Whether the checkpoint stores the experts in MXFP4 (`quantization_config` `quant` has
    quant_method "mxfp4"); a ValueError for any other quantization."""
    if not quant:
        return False
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    if quant.get("quant_method") != "mxfp4":
        raise ValueError(f"gpt_oss: quantization_config.quant_method={quant.get('quant_method')!r} is not "
                         f"supported (mxfp4 experts, or none)")
    return True


def check_gpt_oss_config(cfg, attention_bias: bool, expert_parallel_size: int = 1) -> None:
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
    if not attention_bias:
        raise ValueError("attention_bias=False is not supported (GPT-OSS projections have biases)")


@dataclass(frozen=True)
class OssExpertsSpec:
    """The experts' config, read once: MXFP4 or dense, the clamped SwiGLU's limit and alpha."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    mxfp4: bool
    swiglu_limit: float
    swiglu_alpha: float


@dataclass(frozen=True)
class GptOssConfigFields(LlamaConfigFields):
    """The optional config fields GPT-OSS reads beside the Llama family's (`quantization_config`
    is HFConfigFields'); its projections have biases unless the config says otherwise."""

    attention_bias: bool = True
    swiglu_alpha: float = SWIGLU_ALPHA


def gpt_oss_spec(cfg, expert_parallel_size: int = 1) -> DecoderSpec:
    """The Llama spec (biases on q|k|v and o, windows from `layer_types`, YaRN from the rope
    parameters) with sinks and the MoE block; the optional config fields are read here."""
    fields = GptOssConfigFields.of(cfg)
    attention_bias = bool(fields.attention_bias)
    check_gpt_oss_config(cfg, attention_bias, expert_parallel_size)
    router = RouterSpec(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok,
                        topk_before_score=True, linear_bias=True, fp32_logits=False)
    experts = OssExpertsSpec(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size,
                             mxfp4_experts_of(fields.quantization_config), cfg.swiglu_limit, fields.swiglu_alpha)
    return llama_spec(cfg, fields, attention=GptOssAttention, qkv_bias=attention_bias, o_bias=attention_bias,
                      mlp=lambda spec, cfg, layer_idx, ep: GptOssMoE(router, experts, ep))


class GptOssAttention(LlamaAttention):
    """Llama attention (merged q|k|v with biases, window from `layer_types`) plus one sink per query head."""

    def __init__(self, spec: DecoderSpec, cfg, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(spec, cfg, layer_idx, rotary)
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

    def __init__(self, router: RouterSpec, experts: OssExpertsSpec, expert_parallel_size: int = 1):
        super().__init__()
        self.router = Router(router)
        self.experts = OssExperts(experts.num_experts, experts.hidden_size, experts.intermediate_size,
                                  experts.mxfp4, experts.swiglu_limit, experts.swiglu_alpha, expert_parallel_size)
        self.split = expert_parallel_size > 1  # fixed at construction: partial outputs summed over the ranks
        self.computes_experts = not self.split or computes_expert_slice(expert_parallel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)  # [T, k] each
        out = self.experts(x, ids, weights) if self.computes_experts else torch.zeros_like(x)  # [T, H]
        return all_reduce(out) if self.split else out  # [T, hidden]


class GptOssForCausalLM(DecoderLM):
    """HF `gpt_oss`: the decoder (models/decoder.py) with `gpt_oss_spec`. forward() returns hidden
    states; compute_logits() runs the LM head on selected rows.

    The cache protocol (token groups: one paged "full" group, one "swa" ring), the LM head and
    `load_weights` are the Llama family's: parameters carry HF's names, MXFP4 experts their
    checkpoint's `*_blocks` / `*_scales` (a rank's experts read alone under expert parallelism).
    """

    # no per-request state; attention splits over tensor-parallel ranks, routed experts over
    # expert_parallel_size groups. Decode is not graph-safe: the per-expert path reads expert counts
    # back to the host (and the held pairs are counted on the host under expert parallelism)
    capabilities = ModelCapabilities(tensor_parallel=True, expert_parallel=True)

    @classmethod
    def decoder_spec(cls, cfg, expert_parallel_size: int = 1) -> DecoderSpec:
        return gpt_oss_spec(cfg, expert_parallel_size)

    def bind_caches(self, caches) -> None:
        super().bind_caches(caches)
        for layer in self.model.layers:
            layer.self_attn.bind_sinks()
            layer.mlp.experts.bind_kernels(caches.backend.kernels)

    def load_weights(self, weights) -> None:
        """HF-named tensors; a GGUF file's sinks arrive as `self_attn.sinks.weight`."""
        super().load_weights((name.removesuffix(".weight") if name.endswith(_SINKS_WEIGHT) else name, tensor)
                             for name, tensor in weights)

    def expert_weight_bytes(self) -> int:
        """Bytes of the routed experts' matrices this rank holds (packed MXFP4: blocks + scales)."""
        return sum(layer.mlp.experts.weight_bytes() for layer in self.model.layers)
