"""In-kernel decoding of GGUF blocks: one weight value per element of a tile, from its block's bytes.

Every decoder takes `b`, the pointers to the start of each element's block ([BN, BK], uint8), `j`,
the element's index inside its block ([1, BK] int32, so that the index arithmetic runs once per
column of the tile), `ok`, the tile's mask, and returns the weight values in fp32, computed with
the same fp32 operations as `qdot.dequantize_ref` (so, bit for bit, `gguf.quants.dequantize`'s
values where the compiler does not fuse a multiply and an add). The layouts are those of
qmatmul.py's docstring (the 32-value types and the K-quants) and iq_blocks.py's (the grid i-quants
and ternary types); `j` picks the byte and bit of every field:

    Q4_K byte 16 + 32 (j / 64) + j % 32, nibble (j / 32) % 2; scale and min of sub-block j / 32
    Q6_K low nibble: byte 64 h + l % 64, nibble l / 64; high pair: byte 128 + 32 h + l % 32,
         bits 2 (l / 32)   (h = j / 128, l = j % 128)

Scales come from the block's own bytes at every element (the loads of one block hit the same cache
lines). Tables: `tab` is one uint8 device tensor, IQ4's 16 signed values at 0, then the grids at
the offset `GRID` names (rows of 8 or 4 int8 values). The 8 sign bits of a 7-bit `ksigns` index are
computed (bit 7 is the parity of the 7), not looked up.
"""

from __future__ import annotations

from deepinfer.model_executor.layers.ops.triton import PIP_HINT, triton_available

if not triton_available():
    raise ImportError(f"the Triton GGUF kernels need triton: {PIP_HINT}")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# ggml type ids (qdot.KINDS[...].ggml_id), the kernels' KIND
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = tl.constexpr(2), tl.constexpr(3), tl.constexpr(6), tl.constexpr(7), tl.constexpr(8)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = tl.constexpr(10), tl.constexpr(11), tl.constexpr(12), tl.constexpr(13), tl.constexpr(14)
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S = tl.constexpr(16), tl.constexpr(17), tl.constexpr(18), tl.constexpr(19)
IQ4_NL, IQ3_S, IQ2_S, IQ4_XS = tl.constexpr(20), tl.constexpr(21), tl.constexpr(22), tl.constexpr(23)
IQ1_M, TQ1_0, TQ2_0 = tl.constexpr(29), tl.constexpr(34), tl.constexpr(35)


@triton.jit
def _u8(b, off, ok):
    """The byte at b + off, as int32."""
    return tl.load(b + off, mask=ok, other=0).to(tl.int32)


@triton.jit
def _u16(b, off, ok):
    """The little-endian 16-bit word at b + off (any alignment), as int32."""
    return _u8(b, off, ok) | (_u8(b, off + 1, ok) << 8)


@triton.jit
def _half_bits(bits):
    """16 bits (int32) -> the fp16 they hold, as fp32."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _half(b, off, ok):
    return _half_bits(_u16(b, off, ok))


@triton.jit
def _signed(byte):
    """A byte 0..255 (int32) read as int8."""
    return byte - ((byte & 128) << 1)


@triton.jit
def _nibble(b, off, high, ok):
    """The low (high = 0) or high (high = 1) nibble of the byte at b + off."""
    return (_u8(b, off, ok) >> (4 * high)) & 15


@triton.jit
def _field(b, off, bit, width: tl.constexpr, ok):
    """`width` (<= 9) bits from bit `bit` of the little-endian bytes at b + off (both bytes at
    b + off + bit / 8 and the next lie inside the block)."""
    return (_u16(b, off + (bit >> 3), ok) >> (bit & 7)) & ((1 << width) - 1)


@triton.jit
def _sign(bits, e):
    """+1 / -1 (fp32): bit e of the 8 sign bits `bits` (1 = negative)."""
    return 1.0 - 2.0 * ((bits >> e) & 1).to(tl.float32)


@triton.jit
def _ksign(seven, e):
    """+1 / -1 for value e of a 7-bit ksigns index: its bit e, bit 7 the parity of the seven."""
    p = seven ^ (seven >> 4)
    p = p ^ (p >> 2)
    p = (p ^ (p >> 1)) & 1
    return _sign(seven | (p << 7), e)


@triton.jit
def _grid(tab, GRID: tl.constexpr, index, e, WIDTH: tl.constexpr, ok):
    """Value e of grid row `index` (rows of WIDTH int8 values at tab + GRID), fp32."""
    return _signed(_u8(tab + GRID, index * WIDTH + e, ok)).to(tl.float32)


# ---- the 32-value types ----------------------------------------------------------------------


@triton.jit
def _q4_0(b, j, ok):
    return _half(b, 0, ok) * (_nibble(b, 2 + (j & 15), j >> 4, ok) - 8).to(tl.float32)


@triton.jit
def _q4_1(b, j, ok):
    return _half(b, 0, ok) * _nibble(b, 4 + (j & 15), j >> 4, ok).to(tl.float32) + _half(b, 2, ok)


@triton.jit
def _q5(b, j, ok, QH: tl.constexpr):
    """Q5_0 / Q5_1 codes 0..31: the high bit j of the word at QH, the nibbles after it."""
    high = (_u8(b, QH + (j >> 3), ok) >> (j & 7)) & 1
    return _nibble(b, QH + 4 + (j & 15), j >> 4, ok) | (high << 4)


@triton.jit
def _q5_0(b, j, ok):
    return _half(b, 0, ok) * (_q5(b, j, ok, 2) - 16).to(tl.float32)


@triton.jit
def _q5_1(b, j, ok):
    return _half(b, 0, ok) * _q5(b, j, ok, 4).to(tl.float32) + _half(b, 2, ok)


@triton.jit
def _q8_0(b, j, ok):
    return _half(b, 0, ok) * _signed(_u8(b, 2 + j, ok)).to(tl.float32)


@triton.jit
def _iq4_nl(b, j, ok, tab):
    return _half(b, 0, ok) * _grid(tab, 0, _nibble(b, 2 + (j & 15), j >> 4, ok), 0, 1, ok)


# ---- the K-quants and IQ4_XS (256-value blocks) ---------------------------------------------------


@triton.jit
def _k_scale_min(b, s, ok):
    """Q4_K / Q5_K sub-block s (0..7): (A, B) = (d sc, -(dmin mn)) from the 12 bytes at 4."""
    s4 = s & 3
    lo, mid, hi = _u8(b, 4 + s4, ok), _u8(b, 8 + s4, ok), _u8(b, 12 + s4, ok)
    sc = tl.where(s < 4, lo & 63, (hi & 15) | ((lo >> 6) << 4))
    mn = tl.where(s < 4, mid & 63, (hi >> 4) | ((mid >> 6) << 4))
    return _half(b, 0, ok) * sc.to(tl.float32), -(_half(b, 2, ok) * mn.to(tl.float32))


@triton.jit
def _q4_k(b, j, ok):
    a, m = _k_scale_min(b, j >> 5, ok)
    q = _nibble(b, 16 + 32 * (j >> 6) + (j & 31), (j >> 5) & 1, ok)
    return q.to(tl.float32) * a + m


@triton.jit
def _q5_k(b, j, ok):
    a, m = _k_scale_min(b, j >> 5, ok)
    high = (_u8(b, 16 + (j & 31), ok) >> (j >> 5)) & 1
    q = _nibble(b, 48 + 32 * (j >> 6) + (j & 31), (j >> 5) & 1, ok) | (high << 4)
    return q.to(tl.float32) * a + m


@triton.jit
def _two_bits(b, QS: tl.constexpr, j, ok):
    """Q2_K / Q3_K / TQ2_0 codes 0..3: per 128 values 32 bytes at QS, bits 2 (l / 32) of byte l % 32."""
    l = j & 127
    return (_u8(b, QS + 32 * (j >> 7) + (l & 31), ok) >> (2 * (l >> 5))) & 3


@triton.jit
def _q6_k(b, j, ok):
    l = j & 127
    low = _nibble(b, 64 * (j >> 7) + (l & 63), l >> 6, ok)
    high = (_u8(b, 128 + 32 * (j >> 7) + (l & 31), ok) >> (2 * (l >> 5))) & 3
    a = _half(b, 208, ok) * _signed(_u8(b, 192 + (j >> 4), ok)).to(tl.float32)
    return ((low | (high << 4)) - 32).to(tl.float32) * a


@triton.jit
def _q2_k(b, j, ok):
    sc = _u8(b, j >> 4, ok)  # low nibble the scale, high nibble the min
    a = _half(b, 80, ok) * (sc & 15).to(tl.float32)
    m = -(_half(b, 82, ok) * (sc >> 4).to(tl.float32))
    return _two_bits(b, 16, j, ok).to(tl.float32) * a + m


@triton.jit
def _q3_k(b, j, ok):
    high = (_u8(b, j & 31, ok) >> (j >> 5)) & 1
    s = j >> 4
    sc = _nibble(b, 96 + (s & 7), s >> 3, ok) | (((_u8(b, 104 + (s & 3), ok) >> (2 * (s >> 2))) & 3) << 4)
    a = _half(b, 108, ok) * (sc.to(tl.float32) - 32.0)
    return ((_two_bits(b, 32, j, ok) | (high << 2)) - 4).to(tl.float32) * a


@triton.jit
def _iq4_xs(b, j, ok, tab):
    s = j >> 5
    ls = _nibble(b, 4 + (s >> 1), s & 1, ok) | (((_u8(b, 2 + (s >> 2), ok) >> (2 * (s & 3))) & 3) << 4)
    a = _half(b, 0, ok) * (ls.to(tl.float32) - 32.0)
    q = _nibble(b, 8 + 16 * s + (j & 15), (j >> 4) & 1, ok)
    return _grid(tab, 0, q, 0, 1, ok) * a


# ---- the grid i-quants and ternary types (256-value blocks) ---------------------------------------


@triton.jit
def _iq2_scale(d, ls, QUARTER: tl.constexpr):
    """d (0.5 + ls) / 4 (IQ2) or / 2 (IQ3_XXS), in iq_blocks' order of fp32 operations."""
    scaled = d * (ls.to(tl.float32) + 0.5)
    if QUARTER:
        scaled = scaled * 0.25
    else:
        scaled = scaled * 0.5
    return scaled


@triton.jit
def _iq2_xxs(b, j, ok, tab, GRID: tl.constexpr):
    g = 2 + 8 * (j >> 5)  # per 32 values: 4 grid indices, then 4 x 7 sign bits | ls
    l = (j >> 3) & 3
    a = _iq2_scale(_half(b, 0, ok), _u8(b, g + 7, ok) >> 4, True)
    seven = _field(b, g + 4, 7 * l, 7, ok)
    return _grid(tab, GRID, _u8(b, g + l, ok), j & 7, 8, ok) * _ksign(seven, j & 7) * a


@triton.jit
def _iq2_xs(b, j, ok, tab, GRID: tl.constexpr):
    word = _u16(b, 2 + 2 * (j >> 3), ok)  # 9-bit index | 7 sign bits
    a = _iq2_scale(_half(b, 0, ok), _nibble(b, 66 + (j >> 5), (j >> 4) & 1, ok), True)
    return _grid(tab, GRID, word & 511, j & 7, 8, ok) * _ksign(word >> 9, j & 7) * a


@triton.jit
def _iq2_s(b, j, ok, tab, GRID: tl.constexpr):
    g = j >> 3
    index = _u8(b, 2 + g, ok) | (((_u8(b, 66 + (g >> 2), ok) >> (2 * (g & 3))) & 3) << 8)
    a = _iq2_scale(_half(b, 0, ok), _nibble(b, 74 + (j >> 5), (j >> 4) & 1, ok), True)
    return _grid(tab, GRID, index, j & 7, 8, ok) * _sign(_u8(b, 34 + g, ok), j & 7) * a


@triton.jit
def _iq3_xxs(b, j, ok, tab, GRID: tl.constexpr):
    aux = 66 + 4 * (j >> 5)  # per 32 values: 4 x 7 sign bits | ls
    a = _iq2_scale(_half(b, 0, ok), _u8(b, aux + 3, ok) >> 4, False)
    seven = _field(b, aux, 7 * ((j >> 3) & 3), 7, ok)
    return _grid(tab, GRID, _u8(b, 2 + (j >> 2), ok), j & 3, 4, ok) * _ksign(seven, j & 7) * a


@triton.jit
def _iq3_s(b, j, ok, tab, GRID: tl.constexpr):
    g = j >> 2
    index = _u8(b, 2 + g, ok) | (((_u8(b, 66 + (g >> 3), ok) >> (g & 7)) & 1) << 8)
    a = _half(b, 0, ok) * (1 + 2 * _nibble(b, 106 + (j >> 6), (j >> 5) & 1, ok)).to(tl.float32)
    return _grid(tab, GRID, index, j & 3, 4, ok) * _sign(_u8(b, 74 + (j >> 3), ok), j & 7) * a


@triton.jit
def _iq1(tab, GRID: tl.constexpr, index, minus, j, d, ls, ok):
    """IQ1_S / IQ1_M: (8 grid + 1, or - 1 where `minus`) times d (2 ls + 1) / 8."""
    value = 8.0 * _grid(tab, GRID, index, j & 7, 8, ok) + (1 - 2 * minus).to(tl.float32)
    return value * (d * (2 * ls + 1).to(tl.float32) * 0.125)


@triton.jit
def _iq1_s(b, j, ok, tab, GRID: tl.constexpr):
    qh = _u16(b, 34 + 2 * (j >> 5), ok)  # per 32 values: 4 x 3 high index bits, ls, the delta sign
    index = _u8(b, 2 + (j >> 3), ok) | (((qh >> (3 * ((j >> 3) & 3))) & 7) << 8)
    return _iq1(tab, GRID, index, (qh >> 15) & 1, j, _half(b, 0, ok), (qh >> 12) & 7, ok)


@triton.jit
def _iq1_m(b, j, ok, tab, GRID: tl.constexpr):
    g = j >> 3
    qh = _nibble(b, 32 + (g >> 1), g & 1, ok)  # 3 high index bits | the delta sign
    s = j >> 4
    ls = (_u16(b, 48 + 2 * (s >> 2), ok) >> (3 * (s & 3))) & 7
    d = (_u8(b, 49, ok) >> 4) | (_u8(b, 51, ok) & 0xF0) | ((_u8(b, 53, ok) >> 4) << 8) | ((_u8(b, 55, ok) & 0xF0) << 8)
    return _iq1(tab, GRID, _u8(b, g, ok) | ((qh & 7) << 8), qh >> 3, j, _half_bits(d), ls, ok)


@triton.jit
def _tq1_0(b, j, ok):
    """Base-3 digits: 5 per byte of bytes 0..31 (values 0..159) and 32..47, 4 per byte of 48..51."""
    first, second = j < 160, j < 240
    byte = tl.where(first, j & 31, tl.where(second, 32 + ((j - 160) & 15), 48 + ((j - 240) & 3)))
    p = tl.where(first, j >> 5, tl.where(second, (j - 160) >> 4, (j - 240) >> 2))  # the digit: times 3^p
    power = tl.where(p == 0, 1, tl.where(p == 1, 3, tl.where(p == 2, 9, tl.where(p == 3, 27, 81))))
    digit = (((_u8(b, byte, ok) * power) & 255) * 3) >> 8
    return (digit - 1).to(tl.float32) * _half(b, 52, ok)


@triton.jit
def _tq2_0(b, j, ok):
    return (_two_bits(b, 0, j, ok) - 1).to(tl.float32) * _half(b, 64, ok)


@triton.jit
def decode(b, j, ok, tab, KIND: tl.constexpr, GRID: tl.constexpr):
    """The fp32 weight values of a tile: element (n, k) is value j[k] of the block at b[n, k]."""
    if KIND == Q4_0:
        v = _q4_0(b, j, ok)
    elif KIND == Q4_1:
        v = _q4_1(b, j, ok)
    elif KIND == Q5_0:
        v = _q5_0(b, j, ok)
    elif KIND == Q5_1:
        v = _q5_1(b, j, ok)
    elif KIND == Q8_0:
        v = _q8_0(b, j, ok)
    elif KIND == IQ4_NL:
        v = _iq4_nl(b, j, ok, tab)
    elif KIND == Q4_K:
        v = _q4_k(b, j, ok)
    elif KIND == Q5_K:
        v = _q5_k(b, j, ok)
    elif KIND == Q6_K:
        v = _q6_k(b, j, ok)
    elif KIND == Q2_K:
        v = _q2_k(b, j, ok)
    elif KIND == Q3_K:
        v = _q3_k(b, j, ok)
    elif KIND == IQ4_XS:
        v = _iq4_xs(b, j, ok, tab)
    else:
        v = _decode_grid(b, j, ok, tab, KIND, GRID)
    return v


@triton.jit
def _decode_grid(b, j, ok, tab, KIND: tl.constexpr, GRID: tl.constexpr):
    if KIND == IQ2_XXS:
        v = _iq2_xxs(b, j, ok, tab, GRID)
    elif KIND == IQ2_XS:
        v = _iq2_xs(b, j, ok, tab, GRID)
    elif KIND == IQ2_S:
        v = _iq2_s(b, j, ok, tab, GRID)
    elif KIND == IQ3_XXS:
        v = _iq3_xxs(b, j, ok, tab, GRID)
    elif KIND == IQ3_S:
        v = _iq3_s(b, j, ok, tab, GRID)
    elif KIND == IQ1_S:
        v = _iq1_s(b, j, ok, tab, GRID)
    elif KIND == IQ1_M:
        v = _iq1_m(b, j, ok, tab, GRID)
    elif KIND == TQ1_0:
        v = _tq1_0(b, j, ok)
    else:
        tl.static_assert(KIND == TQ2_0, "no decoder for this ggml type")
        v = _tq2_0(b, j, ok)
    return v
