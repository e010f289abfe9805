"""A transformers config from GGUF metadata: one small table of llama.cpp keys, plus each
architecture's fixed design where the file does not state it.

transformers' own GGUF config path re-parses the whole vocabulary (seconds for a 49k vocabulary);
here the reader that the weights need anyway supplies the few scalar keys.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
_ARCHITECTURE_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

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
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

# Gemma 3's fixed design, which llama.cpp hard-codes instead of writing to the file.
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every sixth layer is global
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_GLOBAL_ROPE_THETA = 1000000.0
GEMMA3_27B_BLOCK_COUNT = 62  # the one size whose query scale is hidden/heads rather than head_dim

# Llama 3 rope scaling: llama.cpp stores per-frequency divisors (`rope_freqs`), not the parameters.
LLAMA3_DEFAULT_LOW_FREQ_FACTOR = 1.0
LLAMA3_DEFAULT_HIGH_FREQ_FACTOR = 4.0
LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192


def gguf_config_dict(
    arch: str,
    metadata: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    rope_freqs: np.ndarray | None,
) -> dict[str, Any]:
    """The HF config fields for a file of architecture `arch` (shapes in torch order)."""
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    config = {field: _required(metadata, f"{arch}.{key}") for key, field in _SHAPE_KEYS.items()}
    config["num_key_value_heads"] = _uniform(config["num_key_value_heads"], f"{arch}.attention.head_count_kv")
    config["model_type"] = _MODEL_TYPE[arch]
    config["architectures"] = [_ARCHITECTURE_CLASS[arch]]
    config["head_dim"] = _head_dim(arch, metadata, config)
    config["vocab_size"] = _vocab_size(arch, metadata, tensor_shapes)
    config["tie_word_embeddings"] = "output.weight" not in tensor_shapes
    config.update({field: metadata[key] for key, field in _TOKEN_ID_KEYS.items() if key in metadata})
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    if arch == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_shapes
    if arch == "gemma3":
        config.update(_gemma3_fields(metadata, config))
    else:
        rope_theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
        config["rope_parameters"] = _rope_parameters(
            arch, metadata, rope_theta, config["head_dim"], rope_freqs
        )
    return config


def _required(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(
            f"GGUF metadata key {key!r} is missing; the model's config cannot be built without it"
        )
    return metadata[key]


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
    for key in (f"{arch}.attention.key_length", f"{arch}.rope.dimension_count"):
        if key in metadata:
            return int(metadata[key])
    return config["hidden_size"] // config["num_attention_heads"]


def _vocab_size(arch: str, metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> int:
    if f"{arch}.vocab_size" in metadata:
        return int(metadata[f"{arch}.vocab_size"])
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("GGUF file has neither a vocab_size key nor a token_embd.weight tensor")
    return tensor_shapes["token_embd.weight"][0]


def _rope_parameters(
    arch: str, metadata: dict[str, Any], rope_theta: float, head_dim: int, rope_freqs: np.ndarray | None
) -> dict[str, Any]:
    """HF `rope_parameters` from the scaling keys, or from llama.cpp's Llama 3 `rope_freqs` tensor."""
    if rope_freqs is not None:
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        return llama3_rope_parameters(rope_freqs, rope_theta, head_dim, original)
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": rope_theta}
    if scaling not in ("linear", "yarn"):
        raise ValueError(
            f"GGUF metadata {arch}.rope.scaling.type={scaling!r} is not supported (linear, yarn)"
        )
    params = {"rope_type": scaling, "rope_theta": rope_theta}
    params["factor"] = float(_required(metadata, f"{arch}.rope.scaling.factor"))
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    return params


def _llama3_factors(rope_theta: float, head_dim: int, params: dict[str, float]) -> np.ndarray:
    """llama.cpp's per-frequency divisors for Llama 3 rope scaling with these parameters."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim/2]
    wavelen = 2 * math.pi / freqs
    old, low, high = (
        params["original_max_position_embeddings"],
        params["low_freq_factor"],
        params["high_freq_factor"],
    )
    smooth = (old / wavelen - low) / (high - low)
    factors = 1.0 / ((1 - smooth) / params["factor"] + smooth)
    factors = np.where(wavelen < old / high, 1.0, factors)
    return np.where(wavelen > old / low, params["factor"], factors)


def llama3_rope_parameters(
    rope_freqs: np.ndarray, rope_theta: float, head_dim: int, original_context: int | None
) -> dict[str, Any]:
    """Recover HF's `llama3` rope parameters from the divisors, and prove them by recomputing.

    In the blended band the divisor r gives smooth = (1/r - 1/factor) / (1 - 1/factor), which is
    linear in 1/wavelen: smooth = (old/wavelen - low) / (high - low). A line fit fixes old/(high-low)
    and low/(high-low); the remaining freedom is pinned by the file's original context length, or by
    Llama 3's low_freq_factor = 1 when the file has none.
    """
    divisors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    params = {
        "factor": float(divisors.max()),
        "low_freq_factor": LLAMA3_DEFAULT_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_DEFAULT_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": int(original_context or LLAMA3_DEFAULT_ORIGINAL_CONTEXT),
    }
    params.update(_fit_llama3_band(divisors, rope_theta, head_dim, params, original_context))
    expected = _llama3_factors(rope_theta, head_dim, params)
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-4, atol=1e-6):
        raise ValueError(
            f"GGUF tensor rope_freqs.weight (shape {divisors.shape}) is not Llama 3 rope scaling for "
            f"rope_theta={rope_theta}, head_dim={head_dim}; best fit {params} does not reproduce it"
        )
    return {"rope_type": "llama3", "rope_theta": rope_theta, **params}


def _fit_llama3_band(
    divisors: np.ndarray,
    rope_theta: float,
    head_dim: int,
    params: dict[str, Any],
    original_context: int | None,
) -> dict[str, Any]:
    """Fit low/high/original from the blended band; {} (keep the defaults) when it has < 2 points."""
    factor = params["factor"]
    inv_wavelen = (1.0 / rope_theta ** (np.arange(0, head_dim, 2) / head_dim)) / (2 * math.pi)
    band = (divisors > 1 + 1e-6) & (divisors < factor - 1e-6)
    if band.sum() < 2 or factor <= 1:
        return {}
    smooth = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(
        inv_wavelen[band], smooth, 1
    )  # slope = old/(high-low), -intercept = low/(high-low)
    ratio = slope / -intercept  # old / low
    if original_context:
        old = float(original_context)
        low = old / ratio
    else:
        low = LLAMA3_DEFAULT_LOW_FREQ_FACTOR
        old = float(round(ratio * low))
    high = low + old / slope
    return {
        "low_freq_factor": round(low, 6),
        "high_freq_factor": round(high, 6),
        "original_max_position_embeddings": int(round(old)),
    }


def _gemma3_fields(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3: local/global layers, two rope bases, query scale, tanh-GELU."""
    num_layers = config["num_hidden_layers"]
    global_theta = float(metadata.get("gemma3.rope.freq_base", GEMMA3_GLOBAL_ROPE_THETA))
    global_rope = _rope_parameters("gemma3", metadata, global_theta, config["head_dim"], None)
    local_theta = float(metadata.get("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))
    query_scale = config["head_dim"]
    if num_layers == GEMMA3_27B_BLOCK_COUNT:
        query_scale = config["hidden_size"] // config["num_attention_heads"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(_required(metadata, "gemma3.attention.sliding_window")),
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
