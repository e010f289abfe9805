"""Encoders for the ggml block types the kernels read: a float matrix [N, K] -> the bytes a GGUF file
stores for it (uint8 [N, K / block * block_bytes]), the inverse of `qdot.dequantize_ref` up to the
type's rounding. They make test and benchmark models in every type from a real model's weights
(`scripts/requantize_gguf.py`); `gguf.quants.dequantize` checks them (tests/ops/test_block_encode.py).

Each block's scale is the best of a few candidates around the one that maps its largest value onto
the type's extreme code (least squared error of the block's values), as llama.cpp's quantizers
search; the sub-block scales of a super-block are then coded relative to its fp16 d (and dmin):

    Q2_K    x ~ d sc q - dmin m       q 0..3, sc and m 4 bits, per 16 values
    Q3_K    x ~ d (s - 32) (c - 4)    c 0..7, s 6 bits, per 16 values
    IQ4_NL  x ~ d kv[c]               c 0..15 indexes qdot.IQ4_VALUES, per 32 values
    IQ4_XS  x ~ d (s - 32) kv[c]      s 6 bits, per 32 values of a 256-value super-block

The grid i-quants (IQ1_S .. IQ3_S) and the ternary TQ1_0/TQ2_0 are encoded by `iq_encode.py`;
`encode_blocks` is the one entry point for all of them, and encodes `_CHUNK` blocks at a time.
"""

from __future__ import annotations

import gguf
import numpy as np

from deepinfer.model_executor.layers.ops.iq_encode import ENCODERS as _GRID_ENCODERS
from deepinfer.model_executor.layers.ops.qdot import IQ4_VALUES

_KV = np.array(IQ4_VALUES, dtype=np.float32)
_TRIES = np.linspace(0.88, 1.12, 9, dtype=np.float32)  # candidate scales, relative to the extreme's
_CHUNK = 2048  # blocks encoded at a time: bounds the working memory of the searches


def encode_blocks(x: np.ndarray, kind: str) -> np.ndarray:
    """x float [N, K] (K a multiple of the kind's block) -> uint8 [N, row bytes]."""
    if kind not in _ENCODERS:
        raise ValueError(f"encode_blocks: no encoder for {kind!r}; have {', '.join(_ENCODERS)}")
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    x = np.asarray(x, dtype=np.float32)
    n, k = x.shape
    if k % block:
        raise ValueError(f"encode_blocks: K={k} is not a multiple of {kind}'s {block}-value blocks")
    blocks = x.reshape(-1, block)
    parts = [_ENCODERS[kind](blocks[i:i + _CHUNK]) for i in range(0, len(blocks), _CHUNK)]  # [chunk, bytes]
    return np.concatenate(parts).reshape(n, -1)


# ---- choosing scales and codes ---------------------------------------------------------------


_STEP = 16  # table entries per unit of t: a lookup is the nearest value's index to within 1/32


def _nearest(t: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the grid value (ascending integers) nearest to each t, by a table over t."""
    lo, hi = int(grid[0]), int(grid[-1])
    points = np.arange(lo * _STEP, hi * _STEP + 1, dtype=np.float32) / _STEP
    table = np.searchsorted((grid[1:] + grid[:-1]) / 2, points)  # one search per table entry
    return table[np.clip(np.rint(t * _STEP), lo * _STEP, hi * _STEP).astype(np.int32) - lo * _STEP]


def _fit(x: np.ndarray, grid: np.ndarray, extreme: float) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x [B, n]: the scale s (of the candidates around the one mapping the row's largest
    |x| onto `extreme`) whose codes c (nearest grid[c] to x / s) give the least squared error."""
    amax = np.take_along_axis(x, np.abs(x).argmax(-1)[:, None], -1)  # [B, 1]: signed
    best_s = amax / extreme
    best_err = np.full(x.shape[0], np.inf, dtype=np.float32)
    for t in _TRIES:
        s = amax / extreme * t  # [B, 1]
        safe = np.where(s == 0, 1, s)
        c = _nearest(x / safe, grid)
        err = ((grid[c] * s - x) ** 2).sum(-1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better[:, None], s, best_s)
    return best_s[:, 0], best_err


def _codes(x: np.ndarray, scale: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Nearest grid index to x / scale (x [B, n], scale [B]); 0 scales give the code of value 0."""
    safe = np.where(scale == 0, 1, scale)[:, None]
    return _nearest(np.where(scale[:, None] == 0, 0, x / safe), grid).astype(np.uint8)


def _super_scales(s: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block scales s [B, S] -> fp16 d [B] and integers ls in [-levels, levels - 1] with
    d * ls ~ s (d maps the largest |s| onto -levels)."""
    smax = np.take_along_axis(s, np.abs(s).argmax(-1)[:, None], -1)[:, 0]
    d = (smax / -levels).astype(np.float16)
    safe = np.where(d == 0, 1, d).astype(np.float32)[:, None]
    ls = np.clip(np.rint(s / safe), -levels, levels - 1).astype(np.int32)
    return d, np.where(d[:, None] == 0, 0, ls)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)  # [B, 2]


def _pack_nibbles(c: np.ndarray) -> np.ndarray:
    """codes [B, 32] -> 16 bytes: value j in the low nibble of byte j, value 16 + j in its high one."""
    return (c[:, :16] | (c[:, 16:] << 4)).astype(np.uint8)


def _pack_two_bits(c: np.ndarray) -> np.ndarray:
    """codes 0..3 [B, 256] -> 64 bytes: per half of 128 values, bits 2j of byte l hold value 32j + l."""
    c = c.reshape(-1, 2, 4, 32).astype(np.uint8)
    return sum(c[:, :, j] << (2 * j) for j in range(4)).reshape(-1, 64).astype(np.uint8)


# ---- the types ---------------------------------------------------------------------------------


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    s, _ = _fit(x, _KV, _KV[0])
    d = s.astype(np.float16)
    c = _codes(x, d.astype(np.float32), _KV)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(c)], axis=1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    b = x.shape[0]
    sub = x.reshape(-1, 32)
    s, _ = _fit(sub, _KV, _KV[0])
    d, ls = _super_scales(s.reshape(b, 8), 32)  # ls [B, 8] in -32..31
    dl = (d.astype(np.float32)[:, None] * ls).reshape(-1)
    c = _codes(sub, dl, _KV).reshape(b, 8, 32)
    s6 = (ls + 32).astype(np.uint16)
    high = sum((s6[:, i] >> 4) << (2 * i) for i in range(8)).astype(np.uint16).reshape(-1, 1).view(np.uint8)
    low = ((s6[:, 0::2] & 0xF) | ((s6[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    qs = _pack_nibbles(c.reshape(-1, 32)).reshape(b, 128)
    return np.concatenate([_f16_bytes(d), high, low, qs], axis=1)


_Q3_GRID = np.arange(-4, 4, dtype=np.float32)


def _q3_k(x: np.ndarray) -> np.ndarray:
    b = x.shape[0]
    sub = x.reshape(-1, 16)
    s, _ = _fit(sub, _Q3_GRID, -4.0)
    d, ls = _super_scales(s.reshape(b, 16), 32)
    dl = (d.astype(np.float32)[:, None] * ls).reshape(-1)
    c = _codes(sub, dl, _Q3_GRID).reshape(b, 256)  # 0..7: value c - 4
    hb = (c >> 2).reshape(b, 8, 32)
    hmask = sum(hb[:, i] << i for i in range(8)).astype(np.uint8)  # bit i of byte l: value 32i + l
    s6 = (ls + 32).astype(np.uint8)
    low = (s6[:, :8] & 0xF) | ((s6[:, 8:] & 0xF) << 4)
    high = sum((s6[:, 4 * t:4 * t + 4] >> 4) << (2 * t) for t in range(4)).astype(np.uint8)
    return np.concatenate([hmask, _pack_two_bits(c & 3), low, high, _f16_bytes(d)], axis=1)


def _q2_fit(sub: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 16 values [..., 16]: the step a and min -m (m >= 0) of x ~ a q - m, q 0..3, of the least
    squared error among ranges [t_lo lo, t_hi hi] shrunk from the values' own [min(lo, 0), hi]."""
    lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
    best = (np.full(lo.shape, np.inf, np.float32), (hi - lo) / 3, -lo)
    for t_lo in (1.0, 0.9, 0.8, 0.7):
        for t_hi in (1.0, 0.9, 0.8, 0.7):
            a, m = (t_hi * hi - t_lo * lo) / 3, -t_lo * lo
            q = np.clip(np.rint((sub + m[..., None]) / np.where(a == 0, 1, a)[..., None]), 0, 3)
            err = ((q * a[..., None] - m[..., None] - sub) ** 2).sum(-1)
            better = err < best[0]
            best = tuple(np.where(better, new, old) for new, old in zip((err, a, m), best, strict=True))
    return best[1], best[2]


def _q2_k(x: np.ndarray) -> np.ndarray:
    b = x.shape[0]
    sub = x.reshape(b, 16, 16)
    scale, mn = _q2_fit(sub)  # [B, 16] each
    d, dmin = (scale.max(-1) / 15).astype(np.float16), (mn.max(-1) / 15).astype(np.float16)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d).astype(np.float32)[:, None]), 0, 15).astype(np.uint8)
    m = np.clip(np.rint(mn / np.where(dmin == 0, 1, dmin).astype(np.float32)[:, None]), 0, 15).astype(np.uint8)
    a = d.astype(np.float32)[:, None] * sc  # [B, 16]
    shifted = sub + (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.rint(shifted / np.where(a == 0, 1, a)[..., None]), 0, 3).astype(np.uint8)
    q = np.where(a[..., None] == 0, 0, q).reshape(b, 256)
    return np.concatenate([sc | (m << 4), _pack_two_bits(q), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


_ENCODERS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, **_GRID_ENCODERS}
ENCODED_KINDS = tuple(_ENCODERS)  # the kinds encode_blocks writes
