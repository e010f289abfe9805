"""GGUF block formats repacked, once at load, into `QuantWeight` (layers/ops/qmatmul.py).

Every block is split into integer values q and, per group of 32 (Q6_K: 16) values, the scale
and min such that `q * scale + minv` is the value GGUF's own dequantization gives, in fp16 where
fp16 holds all of a tensor's exactly (the formats whose d and m are fp16 fields), else fp32:

    type   block (bytes)                          q        group  scale        minv
    Q4_0   d | 16 nibbles                         0..15    32     d            -8 d
    Q4_1   d m | 16 nibbles                       0..15    32     d            m
    Q4_K   d dmin | 12 B 6-bit sc, mn | 128 nib.  0..15    32     d sc_j       -dmin mn_j
    Q8_0   d | 32 int8                            int8     32     d            0
    Q5_0   d | 4 B high bits | 16 nibbles         -16..15  32     d            0
    Q5_1   d m | 4 B high bits | 16 nibbles       0..31    32     d            m
    Q5_K   d dmin | 12 B sc, mn | 32 B hi | 128   0..31    32     d sc_j       -dmin mn_j
    Q6_K   128 B low 4 | 64 B high 2 | 16 sc | d  -32..31  16     d sc_j       0

(d, m, dmin: fp16; within a 32-value group of Q4_0/Q4_1/Q5_x, byte j's low nibble is value j and
its high nibble value 16 + j; Q4_K/Q5_K hold 64 values per 32 bytes, low nibbles first.)
Any other type returns None: the caller dequantizes it and logs the type once.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, compact_scales

REPACKED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
_QK_K = 256


def repack_gguf(kind: str, data: np.ndarray, shape: tuple[int, ...]) -> QuantWeight | None:
    """The 2-D tensor `shape` [N, K] stored as GGUF blocks `data` (uint8), or None if `kind`
    (the ggml type name) has no packed layout here."""
    if kind not in REPACKED_TYPES or len(shape) != 2:
        return None
    n, k = shape
    rows = np.asarray(data, dtype=np.uint8).reshape(n, -1)  # [N, bytes per row]
    q, scale, minv, bits, group = _UNPACK[kind](rows, k)
    scale, minv = compact_scales(_f32(scale, n), _f32(minv, n))
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(q)), scale, minv, bits, group, kind)


def _f32(values: np.ndarray, n: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(n, -1))


def _blocks(rows: np.ndarray, size: int) -> np.ndarray:
    return rows.reshape(rows.shape[0], -1, size)  # [N, blocks, bytes]


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]  # [N, blocks]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per group -> 32 values (low nibbles, then high)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _pack4(q: np.ndarray) -> np.ndarray:
    """[..., 32] values 0..15 -> [..., 16] bytes in the packed layout."""
    return q[..., :16] | (q[..., 16:] << 4)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes per group -> bit j of the little-endian word, for j in 0..31."""
    return np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32]


def _q4_0(rows, k):
    b = _blocks(rows, 18)  # [N, k/32, 18]
    d = _half(b[..., 0:2])
    return b[..., 2:].reshape(rows.shape[0], -1), d, -8.0 * d, 4, 32


def _q4_1(rows, k):
    b = _blocks(rows, 20)
    return b[..., 4:].reshape(rows.shape[0], -1), _half(b[..., 0:2]), _half(b[..., 2:4]), 4, 32


def _q8_0(rows, k):
    b = _blocks(rows, 34)
    d = _half(b[..., 0:2])
    return b[..., 2:].view(np.int8).reshape(rows.shape[0], -1), d, np.zeros_like(d), 8, 32


def _q5_0(rows, k):
    b = _blocks(rows, 22)
    d = _half(b[..., 0:2])
    q = _nibbles(b[..., 6:]) | (_high_bits(b[..., 2:6]) << 4)  # [N, k/32, 32] in 0..31
    return (q.astype(np.int8) - 16).reshape(rows.shape[0], -1), d, np.zeros_like(d), 8, 32


def _q5_1(rows, k):
    b = _blocks(rows, 24)
    q = _nibbles(b[..., 8:]) | (_high_bits(b[..., 4:8]) << 4)
    return q.astype(np.int8).reshape(rows.shape[0], -1), _half(b[..., 0:2]), _half(b[..., 2:4]), 8, 32


def _k_scales(b: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per 32-value sub-block, scale d sc_j and min -dmin mn_j: [N, k/256, 8] each."""
    from gguf.quants import Q4_K

    n, nb = b.shape[:2]
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(n * nb, 12))  # [n*nb, 8]
    d, dmin = _half(b[..., 0:2])[..., None], _half(b[..., 2:4])[..., None]
    return d * sc.reshape(n, nb, 8), -dmin * mn.reshape(n, nb, 8)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 8 sub-blocks of 32 values: per 32 bytes, low nibbles then high nibbles."""
    qs = qs.reshape(*qs.shape[:-1], 4, 32)  # [N, nb, 4, 32]
    return np.stack([qs & 0xF, qs >> 4], axis=-2).reshape(*qs.shape[:-2], 8, 32)  # [N, nb, 8, 32]


def _q4_k(rows, k):
    b = _blocks(rows, 144)
    scale, minv = _k_scales(b, 144)
    q = _k_low_nibbles(b[..., 16:])  # [N, nb, 8, 32]
    return _pack4(q).reshape(rows.shape[0], -1), scale, minv, 4, 32


def _q5_k(rows, k):
    b = _blocks(rows, 176)
    scale, minv = _k_scales(b, 176)
    qh = b[..., 16:48]  # [N, nb, 32]: bit j of byte i is the high bit of value i of sub-block j
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, nb, 8, 32]
    q = _k_low_nibbles(b[..., 48:]) | (high << 4)
    return q.astype(np.int8).reshape(rows.shape[0], -1), scale, minv, 8, 32


def _q6_k(rows, k):
    b = _blocks(rows, 210)
    n, nb = b.shape[:2]
    ql = b[..., :128].reshape(n, nb, 2, 2, 32)  # [N, nb, half, 2, 32]: 64 low-nibble bytes per half
    low = np.stack([ql & 0xF, ql >> 4], axis=-3).reshape(n, nb, 2, 4, 32)  # values (half, quarter, 32)
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32)  # [N, nb, half, 1, 32]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [N, nb, half, 4, 32]
    q = (low | (high << 4)).astype(np.int8) - 32  # [N, nb, 2, 4, 32] = 256 values in order
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # [N, nb, 16]
    scale = _half(b[..., 208:210])[..., None] * sc
    return q.reshape(n, -1), scale, np.zeros_like(scale), 8, 16


_UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q5_1": _q5_1,
           "Q5_K": _q5_k, "Q6_K": _q6_k}
