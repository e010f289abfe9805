"""Random GGUF blocks for the tests: where each ggml type keeps its fp16 scales, so that random
bytes elsewhere still make finite values."""

from __future__ import annotations

import numpy as np

# byte offsets of the fp16 fields (d, m, dmin) in each block; IQ1_M spreads its d (`put_scale`)
_HALF_FIELDS = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82),
                "Q3_K": (108,), "TQ1_0": (52,), "TQ2_0": (64,), "IQ1_M": (-1,)}


def half_fields(kind: str) -> tuple[int, ...]:
    """Byte offsets of the fp16 fields of a `kind` block (-1: IQ1_M's spread d)."""
    return _HALF_FIELDS.get(kind, (0,))


def put_scale(blocks: np.ndarray, kind: str, at: int, scale: np.ndarray) -> None:
    """Write fp16 `scale` [..., 1] (one per block of blocks [..., block bytes]) at byte `at` of each
    block (IQ1_M: into the top nibbles of its four scale words, bytes 48..55)."""
    half = np.asarray(scale).astype(np.float16)
    if kind != "IQ1_M":
        blocks[..., at:at + 2] = half.view(np.uint8)
        return
    bits = half.view(np.uint16)[..., 0]
    words = blocks[..., 48:56].copy().view(np.uint16)
    for i in range(4):
        words[..., i] = (words[..., i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
    blocks[..., 48:56] = words.view(np.uint8)


def finite_scales(blocks: np.ndarray, kind: str, rng: np.random.Generator, low: float, high: float) -> None:
    """Every fp16 field of blocks [..., block bytes] drawn uniformly from [low, high)."""
    for at in half_fields(kind):
        put_scale(blocks, kind, at, rng.uniform(low, high, (*blocks.shape[:-1], 1)))
