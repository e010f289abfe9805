"""RoPE parameters from GGUF metadata: HF's `rope_parameters` from the scaling keys (default, linear,
YaRN), or HF's `llama3` parameters recovered from llama.cpp's per-frequency divisors (the
`rope_freqs` tensor, which llama.cpp writes instead of the parameters) and proved by recomputing
them. `gguf_config.py` builds the rest of the config.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# Llama 3 rope scaling: llama.cpp stores per-frequency divisors (`rope_freqs`), not the parameters.
LLAMA3_DEFAULT_LOW_FREQ_FACTOR = 1.0
LLAMA3_DEFAULT_HIGH_FREQ_FACTOR = 4.0
LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192


def required(metadata: dict[str, Any], key: str) -> Any:
    """metadata[key]; ValueError naming the key when the file lacks it."""
    if key not in metadata:
        raise ValueError(
            f"GGUF metadata key {key!r} is missing; the model's config cannot be built without it"
        )
    return metadata[key]


def rope_parameters(
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
    params["factor"] = float(required(metadata, f"{arch}.rope.scaling.factor"))
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
