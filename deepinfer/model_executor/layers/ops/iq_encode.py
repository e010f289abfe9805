"""Encoders for ggml's grid (i-quant) and ternary block types: float blocks [B, 256] -> the bytes
`gguf.quants.dequantize` decodes ([B, type bytes]); `block_encode.encode_blocks` is the entry point.

The i-quants code a group of 4 or 8 values as one row of a fixed grid (the gguf package's tables,
read as data), scaled per sub-block of 16 or 32 values by d * f(ls), ls a 3- or 4-bit integer:

    IQ2_XXS  |x| ~ d (ls + 0.5) / 4 grid256[c]   8 per row, 7 sign bits + parity, per 32 values
    IQ2_XS   |x| ~ d (ls + 0.5) / 4 grid512[c]   8 per row, 7 sign bits + parity, per 16 values
    IQ2_S    |x| ~ d (ls + 0.5) / 4 grid1024[c]  8 per row, 8 sign bits, per 16 values
    IQ3_XXS  |x| ~ d (ls + 0.5) / 2 grid256[c]   4 per row, 7 sign bits + parity per 8, per 32 values
    IQ3_S    |x| ~ d (2 ls + 1) grid512[c]       4 per row, 8 sign bits per 8, per 32 values
    IQ1_S    x ~ d (2 ls + 1) (g[c] +- 1/8)      g in {-1,0,1}^8, one delta sign per 32 values
    IQ1_M    x ~ d (2 ls + 1) (g[c] +- 1/8)      scale per 16 values, delta sign per 8
    TQ1_0, TQ2_0  x ~ d q, q in {-1, 0, 1}       one d per 256 values, searched as the scales
                                                  above; gguf.quants packs the codes

A "parity" type stores 7 of a group's 8 signs; the 8th makes the count of negatives even, so a
group with an odd count gives its smallest |x| the wrong sign and codes it as -|x| (the nearest
grid value to it is the smallest). Each sub-block's scale is the best of `_TRIES` around the one
mapping its largest target onto the grid's largest level, then refitted by least squares; the
nearest grid row to a group is the closest of the `_NEIGHBOURS` rows nearest to the lattice point
the group rounds to (a table per type, built once; the candidate scales are compared with the first
`_SEARCH_K` of them, which is most of the speed for a little of the error). Blocks come in chunks
(`block_encode._CHUNK`), so the work arrays stay small.
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType, quants

_NEIGHBOURS = 12  # grid rows compared per group for the final codes
_SEARCH_K = 1  # and while comparing candidate scales
_TRIES = np.geomspace(0.6, 1.15, 8).astype(np.float32)  # scale candidates, relative to amax's
_TRIES_1 = np.geomspace(0.35, 1.0, 8).astype(np.float32)  # the ternary grids: most codes are 0


class _Grid:
    """A type's grid rows [R, g], its levels, and the table lattice point -> nearest rows."""

    def __init__(self, cls: type) -> None:
        cls.init_grid()
        self.rows = cls.grid.reshape(cls.grid_shape).astype(np.float32)  # [R, g]
        self.cols = np.ascontiguousarray(self.rows.T)  # [g, R]
        self.levels = np.array(sorted(cls.grid_map), dtype=np.float32)
        n, g = len(self.levels), self.rows.shape[1]
        powers = n ** np.arange(g)  # lattice index = sum of level index * n^j
        self.powers = powers.astype(np.float32)  # (exact in float32: n^g <= 6561)
        lattice = self.levels[(np.arange(n**g)[:, None] // powers) % n]  # [n^g, g]
        dist = (self.rows**2).sum(-1) - 2 * lattice @ self.rows.T  # [n^g, R]
        self.table = np.argsort(dist, axis=1)[:, :_NEIGHBOURS].astype(np.int32)

    def nearest(self, y: np.ndarray, k: int = _NEIGHBOURS) -> np.ndarray:
        """Index of the (near-)nearest grid row to each y [M, g] -> [M], of the k rows nearest to
        the lattice point y rounds to (k = 1: that row, no distance computed)."""
        level = np.searchsorted((self.levels[1:] + self.levels[:-1]) / 2, y).astype(np.float32)  # [M, g]
        key = (level @ self.powers).astype(np.int32)  # [M]
        if k == 1:
            return self.table[key, 0]
        cand = self.table[key, :k]  # [M, k]
        dist = np.zeros(cand.shape, np.float32)  # [M, k], summed per coordinate (faster than [M, k, g])
        for col, yj in zip(self.cols, y.T, strict=True):
            dist += (col[cand] - yj[:, None]) ** 2
        return np.take_along_axis(cand, dist.argmin(-1)[:, None], -1)[:, 0]


@functools.cache
def _grid(name: str) -> _Grid:
    return _Grid(getattr(quants, name))


@functools.cache
def _ksign_index() -> np.ndarray:
    """8-bit sign mask of even parity -> its 7-bit index in IQ2_XXS.ksigns (odd masks: -1)."""
    table = np.full(256, -1, dtype=np.int32)
    table[np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)] = np.arange(128)
    return table


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)  # [B, 2]


def _as_bytes(v: np.ndarray, dtype: type) -> np.ndarray:
    """Integers [B, n] -> their little-endian bytes [B, n * itemsize]."""
    return np.ascontiguousarray(v.astype(dtype)).view(np.uint8).reshape(v.shape[0], -1)


def _bits(b: np.ndarray) -> np.ndarray:
    """0/1 flags [..., 8] -> one byte each, flag i in bit i."""
    return (b.astype(np.uint8) << np.arange(8, dtype=np.uint8)).sum(-1).astype(np.uint8)


# ---- choosing scales ---------------------------------------------------------------------------


def _search(x: np.ndarray, quant, top: float, tries: np.ndarray) -> np.ndarray:
    """Per row of x [S, n]: the scale s >= 0 (0 for a zero row) whose codes (quant(x, s) -> (codes,
    recon in units of s)) give the least squared error among s = max|x| / top * t, t in tries, then
    refitted by least squares to the codes it chose."""
    base = np.abs(x).max(-1) / top  # [S]
    best_err, best_s = np.full(x.shape[0], np.inf, np.float32), np.where(base == 0, 1, base)
    for t in tries:
        s = np.where(base == 0, 1, base * t)
        err = ((quant(x, s, _SEARCH_K)[1] * s[:, None] - x) ** 2).sum(-1)
        better = err < best_err
        best_err, best_s = np.where(better, err, best_err), np.where(better, s, best_s)
    recon = quant(x, best_s, _SEARCH_K)[1]
    fit = (x * recon).sum(-1) / np.maximum((recon**2).sum(-1), 1e-30)  # least squares given the codes
    return np.where(base == 0, 0, np.where(fit > 0, fit, best_s))


def _scales(s: np.ndarray, c0: float, c1: float, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block scales s [B, S] >= 0 -> fp16 d [B] and ls [B, S] in 0..top, d (ls + c0) c1 ~ s."""
    d = (s.max(-1) / ((top + c0) * c1)).astype(np.float16)
    safe = np.where(d == 0, 1, d).astype(np.float32)[:, None]
    ls = np.clip(np.rint(s / (safe * c1) - c0), 0, top).astype(np.int32)
    return d, ls


def _magnitude_quant(grid: _Grid):
    def quant(a: np.ndarray, s: np.ndarray, k: int = _NEIGHBOURS) -> tuple[tuple, np.ndarray]:
        g = grid.rows.shape[1]
        c = grid.nearest((a / s[:, None]).reshape(-1, g), k).reshape(a.shape[0], -1)  # [S, n / g]
        return (c,), grid.rows[c].reshape(a.shape)
    return quant


def _signed_targets(x: np.ndarray, parity: bool) -> tuple[np.ndarray, np.ndarray]:
    """x [B, V] -> targets a (|x|, one element negated per odd group of 8 if parity) and the 0/1
    sign flags [B, V / 8, 8] the codes store (even in count per group when parity)."""
    a, neg = np.abs(x), (x < 0).reshape(x.shape[0], -1, 8)
    if parity:
        odd = neg.sum(-1) % 2 == 1  # [B, V / 8]
        a8 = a.reshape(neg.shape)
        first = np.zeros(neg.shape, dtype=bool)
        np.put_along_axis(first, a8.argmin(-1)[..., None], True, -1)
        flip = first & odd[..., None]
        neg, a = neg ^ flip, np.where(flip, -a8, a8).reshape(x.shape)
    return a, neg


def _grid_fit(x: np.ndarray, name: str, sub: int, parity: bool, c0: float, c1: float):
    """Blocks x [B, 256] -> (d [B], ls [B, 256 / sub], grid codes [B, 256 / g], signs [B, 32, 8])."""
    grid = _grid(name)
    b = x.shape[0]
    a, neg = _signed_targets(x, parity)
    quant = _magnitude_quant(grid)
    s = _search(a.reshape(-1, sub), quant, grid.levels[-1], _TRIES)
    d, ls = _scales(s.reshape(b, -1), c0, c1, 15)
    dl = (d.astype(np.float32)[:, None] * (ls + c0) * c1).reshape(-1)  # [B * 256 / sub]
    codes, _ = quant(a.reshape(-1, sub), np.where(dl == 0, 1, dl))
    return d, ls, codes[0].reshape(b, -1), neg


# ---- the types ---------------------------------------------------------------------------------


def _iq2_xxs(x: np.ndarray) -> np.ndarray:
    d, ls, c, neg = _grid_fit(x, "IQ2_XXS", 32, True, 0.5, 0.25)  # c [B, 32], neg [B, 32, 8]
    k = _ksign_index()[_bits(neg)].reshape(-1, 8, 4).astype(np.uint32)  # per sub-block of 32
    aux = (k << np.array([0, 7, 14, 21], np.uint32)).sum(-1, dtype=np.uint32) | (ls.astype(np.uint32) << 28)
    qs = np.concatenate([c.reshape(-1, 8, 4).astype(np.uint8), _as_bytes(aux, np.uint32).reshape(-1, 8, 4)], -1)
    return np.concatenate([_f16_bytes(d), qs.reshape(-1, 64)], axis=1)


def _iq2_xs(x: np.ndarray) -> np.ndarray:
    d, ls, c, neg = _grid_fit(x, "IQ2_XS", 16, True, 0.5, 0.25)  # ls [B, 16], c [B, 32]
    q = c | (_ksign_index()[_bits(neg)] << 9)
    scales = ls[:, 0::2] | (ls[:, 1::2] << 4)
    return np.concatenate([_f16_bytes(d), _as_bytes(q, np.uint16), scales.astype(np.uint8)], axis=1)


def _iq2_s(x: np.ndarray) -> np.ndarray:
    d, ls, c, neg = _grid_fit(x, "IQ2_S", 16, False, 0.5, 0.25)  # c [B, 32] 10 bits
    qh = ((c >> 8).reshape(-1, 8, 4) << np.array([0, 2, 4, 6])).sum(-1)
    scales = ls[:, 0::2] | (ls[:, 1::2] << 4)
    parts = (c & 0xFF, _bits(neg), qh, scales)
    return np.concatenate([_f16_bytes(d), *(p.astype(np.uint8) for p in parts)], axis=1)


def _iq3_xxs(x: np.ndarray) -> np.ndarray:
    d, ls, c, neg = _grid_fit(x, "IQ3_XXS", 32, True, 0.5, 0.5)  # c [B, 64], ls [B, 8]
    k = _ksign_index()[_bits(neg)].reshape(-1, 8, 4).astype(np.uint32)
    aux = (k << np.array([0, 7, 14, 21], np.uint32)).sum(-1, dtype=np.uint32) | (ls.astype(np.uint32) << 28)
    return np.concatenate([_f16_bytes(d), c.astype(np.uint8), _as_bytes(aux, np.uint32)], axis=1)


def _iq3_s(x: np.ndarray) -> np.ndarray:
    d, ls, c, neg = _grid_fit(x, "IQ3_S", 32, False, 0.5, 2.0)  # c [B, 64] 9 bits, ls [B, 8]
    qh = _bits((c >> 8).reshape(-1, 8, 8))
    scales = ls[:, 0::2] | (ls[:, 1::2] << 4)
    parts = (c & 0xFF, qh, _bits(neg), scales)
    return np.concatenate([_f16_bytes(d), *(p.astype(np.uint8) for p in parts)], axis=1)


def _ternary_quant(per: int):
    """The IQ1 grid with a delta of +-1/8 chosen per `per` values (codes: rows, delta is negative)."""
    grid, delta = _grid("IQ1_S"), float(quants.IQ1_S.delta)

    def quant(x: np.ndarray, s: np.ndarray, k: int = _NEIGHBOURS) -> tuple[tuple, np.ndarray]:
        y = x / s[:, None]  # [S, n]
        fits = []
        for dv in (delta, -delta):
            c = grid.nearest((y - dv).reshape(-1, 8), k).reshape(x.shape[0], -1)  # [S, n / 8]
            recon = grid.rows[c].reshape(x.shape) + dv
            fits.append((c, recon, ((recon - y) ** 2).reshape(x.shape[0], -1, per).sum(-1)))  # err [S, n / per]
        (c_pos, r_pos, e_pos), (c_neg, r_neg, e_neg) = fits
        neg = e_neg < e_pos  # [S, n / per]
        c = np.where(np.repeat(neg, per // 8, axis=1), c_neg, c_pos)
        return (c, neg), np.where(np.repeat(neg, per, axis=1), r_neg, r_pos)
    return quant


def _iq1_fit(x: np.ndarray, sub: int, per: int):
    """Blocks [B, 256] -> (d [B], ls [B, 256 / sub] 0..7, rows [B, 32], delta negative [B, 256 / per])."""
    b = x.shape[0]
    quant = _ternary_quant(per)
    s = _search(x.reshape(-1, sub), quant, 1.125, _TRIES_1)
    d, ls = _scales(s.reshape(b, -1), 0.5, 2.0, 7)
    dl = (d.astype(np.float32)[:, None] * (2 * ls + 1)).reshape(-1)
    (c, neg), _ = quant(x.reshape(-1, sub), np.where(dl == 0, 1, dl))
    return d, ls, c.reshape(b, 32), neg.reshape(b, -1)


def _iq1_s(x: np.ndarray) -> np.ndarray:
    d, ls, c, neg = _iq1_fit(x, 32, 32)  # ls, neg [B, 8]
    qh = ((c >> 8).reshape(-1, 8, 4) << np.array([0, 3, 6, 9])).sum(-1) | (ls << 12) | (neg.astype(np.int64) << 15)
    return np.concatenate([_f16_bytes(d), (c & 0xFF).astype(np.uint8), _as_bytes(qh, np.uint16)], axis=1)


def _iq1_m(x: np.ndarray) -> np.ndarray:
    d, ls, c, neg = _iq1_fit(x, 16, 8)  # ls [B, 16], neg [B, 32]
    nib = (c >> 8) | (neg.astype(np.int64) << 3)  # [B, 32]: 3 high index bits and the delta sign
    qh = nib[:, 0::2] | (nib[:, 1::2] << 4)
    u = d.reshape(-1, 1).view(np.uint16).astype(np.int64)  # [B, 1]: d's bits, a nibble per word
    words = (ls.reshape(-1, 4, 4) << np.array([0, 3, 6, 9])).sum(-1) | (((u >> np.array([0, 4, 8, 12])) & 0xF) << 12)
    return np.concatenate([(c & 0xFF).astype(np.uint8), qh.astype(np.uint8), _as_bytes(words, np.uint16)], axis=1)


def _ternary(kind: str):
    """TQ1_0 / TQ2_0: d of the least squared error (candidates as `_search`), codes packed by gguf."""
    def encode(x: np.ndarray) -> np.ndarray:
        def quant(v: np.ndarray, s: np.ndarray, k: int = 0) -> tuple[tuple, np.ndarray]:
            q = np.clip(np.rint(v / s[:, None]), -1, 1)
            return (q,), q
        d = _search(x, quant, 1.0, _TRIES_1).astype(np.float16)
        q = np.where(d[:, None] == 0, 0, quant(x, np.where(d == 0, 1, d).astype(np.float32))[1])
        out = quants.quantize(q.astype(np.float32), GGMLQuantizationType[kind])  # d = 1 where q != 0
        out[:, -2:] = _f16_bytes(d)  # both types end in their fp16 d
        return out
    return encode


ENCODERS = {"IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s, "IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s,
            "IQ1_S": _iq1_s, "IQ1_M": _iq1_m, "TQ1_0": _ternary("TQ1_0"), "TQ2_0": _ternary("TQ2_0")}
