"""A transformers config from GGUF metadata: one small table of llama.cpp keys, plus each
architecture's fixed design where the file does not state it.

transformers' own GGUF config path re-parses the whole vocabulary (seconds for a 49k vocabulary);
here the reader that the weights need anyway supplies the few scalar keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deepinfer.model_executor.loader.gguf_deepseek2 import deepseek2_config_fields
from deepinfer.model_executor.loader.gguf_gpt_oss import experts_are_mxfp4
from deepinfer.model_executor.loader.gguf_rope import required, rope_parameters

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen2vl", "qwen3", "gemma3", "qwen2moe", "qwen3moe", "gemma2",
                               "phi3", "gpt-oss", "deepseek2")

_MODEL_TYPE = {"gpt-oss": "gpt_oss", "llama": "llama", "qwen2": "qwen2", "qwen2vl": "qwen2", "qwen3": "qwen3",
               "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma2": "gemma2",
               "phi3": "phi3", "deepseek2": "deepseek_v3"}  # deepseek2: v2 or v3 by its gating (gguf_deepseek2.py)
_ARCHITECTURE_CLASS = {
    "gpt-oss": "GptOssForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2vl": "Qwen2ForCausalLM",  # Qwen2-VL / 2.5-VL's language part: its M-RoPE is plain RoPE for text
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",
}
# llama.cpp's `{arch}.pooling_type` (enum llama_pooling_type) -> ours (engine/pooling.py); 0 is none
_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}
# llama.cpp's routing renormalises the top-k weights for these unless `{arch}.expert_weights_norm` says
MOE_RENORMALIZES = {"qwen2moe": False, "qwen3moe": True}

# "{arch}.<key>" -> HF config field; every key is required.
_SHAPE_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_TOKEN_ID_KEYS = {  # eos, eot and eom end a generation (contracts/hf_config.py end_of_generation_ids)
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.eot_token_id": "eot_token_id",
    "tokenizer.ggml.eom_token_id": "eom_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
_FIM_TOKEN_KEYS = {  # fill-in-the-middle tokens (serving/fim.py): llama.cpp's keys, then the older ones;
    # pad, repo and file separator also end a generation, as in llama.cpp
    "fim_pre_token_id": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "fim_suf_token_id": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "fim_mid_token_id": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "fim_pad_token_id": ("tokenizer.ggml.fim_pad_token_id",),
    "fim_rep_token_id": ("tokenizer.ggml.fim_rep_token_id",),
    "fim_sep_token_id": ("tokenizer.ggml.fim_sep_token_id",),
}

# Gemma 3's fixed design, which llama.cpp hard-codes instead of writing to the file.
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every sixth layer is global
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_GLOBAL_ROPE_THETA = 1000000.0
GEMMA3_27B_BLOCK_COUNT = 62  # the one size whose query scale is hidden/heads rather than head_dim

def gguf_config_dict(
    arch: str,
    metadata: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    rope_freqs: np.ndarray | None,
    rope_factors: tuple[np.ndarray, np.ndarray] | None = None,
    tensor_types: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The HF config fields for a file of architecture `arch` (shapes in torch order); `rope_factors`:
    phi3's LongRoPE (short, long) factor tensors, when the file has them; `tensor_types`: each
    tensor's ggml type name (gpt-oss: whether its experts are MXFP4)."""
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    config = {field: required(metadata, f"{arch}.{key}") for key, field in _SHAPE_KEYS.items()}
    config["num_key_value_heads"] = _uniform(config["num_key_value_heads"], f"{arch}.attention.head_count_kv")
    config["model_type"] = _MODEL_TYPE[arch]
    config["architectures"] = [_ARCHITECTURE_CLASS[arch]]
    config["head_dim"] = _head_dim(arch, metadata, config)
    config["vocab_size"] = _vocab_size(arch, metadata, tensor_shapes)
    config["tie_word_embeddings"] = "output.weight" not in tensor_shapes
    config.update({field: metadata[key] for key, field in _TOKEN_ID_KEYS.items() if key in metadata})
    for field, keys in _FIM_TOKEN_KEYS.items():
        found = [key for key in keys if key in metadata]
        if found:
            config[field] = int(metadata[found[0]])
    config["eog_from_token_texts"] = True  # llama.cpp also ends a generation on tokens by their text
    pooling = int(metadata.get(f"{arch}.pooling_type", 0))
    if pooling:  # an embedding model's declaration
        config["pooling_type"] = _POOLING_TYPES.get(pooling, str(pooling))
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    if arch == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_shapes
    if arch == "gpt-oss":
        return {**config, **_gpt_oss_fields(metadata, config, tensor_types or {})}
    if arch == "deepseek2":
        return {**config, **deepseek2_config_fields(metadata, config, tensor_shapes)}
    if arch in MOE_RENORMALIZES or int(metadata.get(f"{arch}.expert_count", 0)) > 0:
        config.update(_moe_fields(arch, metadata, tensor_shapes, config))
    if arch == "gemma3":
        config.update(_gemma3_fields(metadata, config))
    elif arch == "phi3":
        config.update(_phi3_fields(metadata, config, rope_factors))
    else:
        rope_theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
        config["rope_parameters"] = rope_parameters(
            arch, metadata, rope_theta, config["head_dim"], rope_freqs
        )
        if arch == "qwen2vl":  # M-RoPE's (t, h, w) frequency sections: rope_parameters' once pictures come
            sections = [int(v) for v in required(metadata, "qwen2vl.rope.dimension_sections")]
            config["mrope_section"] = sections[:3]  # the converter pads to 4 with 0 (loader/mmproj_source.py)
    if arch == "gemma2":
        config.update(_gemma2_fields(metadata, config))
    return config


def _uniform(value: Any, key: str) -> int:
    """A per-layer list that is the same everywhere collapses to one int; a varying one is refused."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(
                f"GGUF metadata {key!r} varies per layer ({value}); only uniform values are supported"
            )
        return int(value[0])
    return int(value)


def _head_dim(arch: str, metadata: dict[str, Any], config: dict[str, Any]) -> int:
    keys = ("attention.key_length",) if arch == "phi3" else ("attention.key_length", "rope.dimension_count")
    for key in (f"{arch}.{k}" for k in keys):  # phi3's rope.dimension_count counts the rotating dims only
        if key in metadata:
            return int(metadata[key])
    return config["hidden_size"] // config["num_attention_heads"]


def _vocab_size(arch: str, metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> int:
    if f"{arch}.vocab_size" in metadata:
        return int(metadata[f"{arch}.vocab_size"])
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("GGUF file has neither a vocab_size key nor a token_embd.weight tensor")
    return tensor_shapes["token_embd.weight"][0]


def _gemma3_fields(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3: local/global layers, two rope bases, query scale, tanh-GELU."""
    num_layers = config["num_hidden_layers"]
    global_theta = float(metadata.get("gemma3.rope.freq_base", GEMMA3_GLOBAL_ROPE_THETA))
    global_rope = rope_parameters("gemma3", metadata, global_theta, config["head_dim"], None)
    local_theta = float(metadata.get("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))
    query_scale = config["head_dim"]
    if num_layers == GEMMA3_27B_BLOCK_COUNT:
        query_scale = config["hidden_size"] // config["num_attention_heads"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(required(metadata, "gemma3.attention.sliding_window")),
        "layer_types": _gemma3_layer_types(
            metadata.get("gemma3.attention.sliding_window_pattern"), num_layers
        ),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
            "full_attention": global_rope,
        },
        "query_pre_attn_scalar": query_scale,
    }


def _gemma3_layer_types(pattern: Any, num_layers: int) -> list[str]:
    """`pattern`: a period n (layer i is global when (i + 1) % n == 0) or per-layer flags (True = local)."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(
                f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries, not {num_layers}"
            )
        return ["sliding_attention" if local else "full_attention" for local in pattern]
    period = int(pattern or GEMMA3_SLIDING_WINDOW_PATTERN)
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers)]


def _moe_fields(arch: str, metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
                config: dict[str, Any]) -> dict[str, Any]:
    """Routed experts (`{arch}.expert_count` > 0): a llama file is Mixtral (every layer sparse, the
    top-k renormalised); qwen2moe / qwen3moe: the experts' size, the renormalisation llama.cpp
    applies, Qwen2-MoE's shared expert and q/k/v bias, and which layers are dense (no router)."""
    fields = {"num_experts": int(required(metadata, f"{arch}.expert_count")),
              "num_experts_per_tok": int(required(metadata, f"{arch}.expert_used_count"))}
    expert_size = metadata.get(f"{arch}.expert_feed_forward_length")
    if arch == "llama":
        fields.update(model_type="mixtral", architectures=["MixtralForCausalLM"],
                      num_local_experts=fields.pop("num_experts"))
        fields["intermediate_size"] = int(expert_size or config["intermediate_size"])
        return fields
    if arch not in MOE_RENORMALIZES:
        raise ValueError(f"GGUF metadata {arch}.expert_count={fields['num_experts']}: architecture {arch!r} "
                         f"has no routed experts here")
    layers = range(config["num_hidden_layers"])
    fields["moe_intermediate_size"] = int(expert_size or _first_shape(tensor_shapes, "ffn_gate_exps", layers)[1])
    fields["norm_topk_prob"] = bool(metadata.get(f"{arch}.expert_weights_norm", MOE_RENORMALIZES[arch]))
    fields["mlp_only_layers"] = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes]
    fields["decoder_sparse_step"] = 1
    if arch == "qwen2moe":
        shared = metadata.get(f"{arch}.expert_shared_feed_forward_length")
        fields["shared_expert_intermediate_size"] = int(shared or _first_shape(tensor_shapes, "ffn_gate_shexp",
                                                                                layers)[0])
        fields["qkv_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    else:
        fields["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    return fields


def _first_shape(tensor_shapes: dict[str, tuple[int, ...]], part: str, layers: range) -> tuple[int, ...]:
    """The torch shape of the first layer's `blk.N.{part}.weight` (ValueError when no layer has one)."""
    for i in layers:
        if f"blk.{i}.{part}.weight" in tensor_shapes:
            return tensor_shapes[f"blk.{i}.{part}.weight"]
    raise ValueError(f"GGUF file has no {part} tensor and no metadata key giving its size")


# Gemma 2's fixed design, which llama.cpp hard-codes instead of writing to the file
GEMMA2_27B_BLOCK_COUNT = 46  # the one size whose query scale is hidden/heads rather than head_dim
GEMMA2_ATTN_LOGIT_SOFTCAPPING = 50.0  # llama.cpp's values when the file has no key
GEMMA2_FINAL_LOGIT_SOFTCAPPING = 30.0


def _gemma2_fields(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2: sliding (even) and global (odd) layers, logit soft-caps, query scale, tanh-GELU."""
    num_layers = config["num_hidden_layers"]
    query_scale = config["head_dim"]
    if num_layers == GEMMA2_27B_BLOCK_COUNT:
        query_scale = config["hidden_size"] // config["num_attention_heads"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(required(metadata, "gemma2.attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        "query_pre_attn_scalar": query_scale,
        "attn_logit_softcapping": float(metadata.get("gemma2.attn_logit_softcapping",
                                                     GEMMA2_ATTN_LOGIT_SOFTCAPPING)),
        "final_logit_softcapping": float(metadata.get("gemma2.final_logit_softcapping",
                                                      GEMMA2_FINAL_LOGIT_SOFTCAPPING)),
    }


def _phi3_fields(metadata: dict[str, Any], config: dict[str, Any],
                 rope_factors: tuple[np.ndarray, np.ndarray] | None) -> dict[str, Any]:
    """Phi-3 / Phi-4: rotating dims (`rope.dimension_count`) as a partial rotary factor, LongRoPE from
    the `rope_factors_short` / `rope_factors_long` tensors, the window (0: none, as Phi-4 writes it)."""
    head_dim = config["head_dim"]
    rotary_dims = int(metadata.get("phi3.rope.dimension_count", head_dim))
    original = int(metadata.get("phi3.rope.scaling.original_context_length", config["max_position_embeddings"]))
    rope = {"rope_type": "default", "rope_theta": float(metadata.get("phi3.rope.freq_base", 10000.0)),
            "partial_rotary_factor": rotary_dims / head_dim}
    if rope_factors is not None:
        short, long = (np.asarray(f, dtype=np.float64).reshape(-1).tolist() for f in rope_factors)
        if len(short) != rotary_dims // 2 or len(long) != rotary_dims // 2:
            raise ValueError(f"GGUF tensors rope_factors_short/long hold {len(short)}/{len(long)} factors, "
                             f"expected {rotary_dims // 2} (phi3.rope.dimension_count={rotary_dims})")
        rope.update(rope_type="longrope", short_factor=short, long_factor=long,
                    original_max_position_embeddings=original)
        if "phi3.rope.scaling.attn_factor" in metadata:
            rope["attention_factor"] = float(metadata["phi3.rope.scaling.attn_factor"])
    return {"hidden_act": "silu", "rope_parameters": rope, "original_max_position_embeddings": original,
            "sliding_window": int(metadata.get("phi3.attention.sliding_window", 0)) or None}


GPT_OSS_SWIGLU_LIMIT = 7.0  # llama.cpp hard-codes GPT-OSS's clamp, as it does the layer pattern


def _gpt_oss_fields(metadata: dict[str, Any], config: dict[str, Any], tensor_types: dict[str, str]) -> dict[str, Any]:
    """GPT-OSS: experts, even layers sliding (llama.cpp's fixed pattern), YaRN with HF's gpt_oss
    settings (beta_fast 32, beta_slow 1, no truncation), biases; `quantization_config` mxfp4 when
    the expert stacks are MXFP4 (the model keeps them packed)."""
    arch = "gpt-oss"
    rope_theta = float(metadata.get(f"{arch}.rope.freq_base", 150000.0))
    rope = rope_parameters(arch, metadata, rope_theta, config["head_dim"], None)
    if rope["rope_type"] == "yarn":
        rope.update(beta_fast=32.0, beta_slow=1.0, truncate=False)
    fields = {
        "num_local_experts": int(required(metadata, f"{arch}.expert_count")),
        "num_experts_per_tok": int(required(metadata, f"{arch}.expert_used_count")),
        "intermediate_size": int(metadata.get(f"{arch}.expert_feed_forward_length", config["intermediate_size"])),
        "sliding_window": int(required(metadata, f"{arch}.attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(config["num_hidden_layers"])],
        "rope_parameters": rope,
        "attention_bias": True,
        "swiglu_limit": GPT_OSS_SWIGLU_LIMIT,
    }
    if experts_are_mxfp4(tensor_types):
        fields["quantization_config"] = {"quant_method": "mxfp4"}
    return fields
