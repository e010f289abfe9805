"""Decode (and verification) attention over explicit index rows of a token-group cache, in Triton.

Per query n and KV head h, one program serves the G = H / H_kv query heads that share h (GQA):
it walks index[n] in blocks of BLOCK_L slots, reads each named row once (K and V of head h; the
same bytes for both when the row is a shared K = V part), and keeps an online softmax:

    index[n]   12 13 14 15 28 29 -1 -1        slots (-1: padding, contributes nothing)
    line       cache_line(slot)               ops/addressing.py: the LayerCache's row of the slot
    p          softmax(scale * q . k)         over the listed slots only: no causal mask here,
    out[n]     sum p * v                      the index row is the mask (paged or ring alike)

Two options (attention/layer.py): a soft-cap c (SOFTCAP) caps each scaled logit as
c * tanh(s / c), tanh(x) = sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|)); sinks [H] (HAS_SINKS) start each head's online
softmax at (max = sink, sum = 1, acc = 0), so the sink joins the denominator and adds no value.

MXFP8 rows (e4m3 values | one UE8M0 byte per 32 values) are dequantized in the kernel from their
bits; plain rows (fp32 / bf16 / fp16) are loaded as they are. Numerics follow the torch reference:
rows are rounded to the query dtype, logits and softmax in fp32; fp32 queries multiply in IEEE
fp32, bf16 / fp16 queries on tensor cores with fp32 accumulation (interpreted: in fp32, as the
interpreter's bf16 dot is wrong; the operands are still rounded to the query dtype). A query whose row lists no slot
gets zeros.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.ops.triton import PIP_HINT, interpreted, triton_available

if not triton_available():
    raise ImportError(f"the Triton decode attention kernel needs triton: {PIP_HINT}")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MIN_DOT = 16  # tl.dot needs every block dimension >= 16 on a GPU
BLOCK_L = 32  # index columns per loop step


@triton.jit
def _e4m3_to_f32(code):
    """e4m3fn bit patterns [...] (int32, 0..255) -> fp32, exactly (0x7F / 0xFF: NaN)."""
    sign = (code & 0x80) << 24
    exp = (code >> 3) & 0xF
    mant = code & 0x7
    normal = (sign | ((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * 0.001953125  # 2^-9
    sub = tl.where(sign != 0, -sub, sub)
    value = tl.where(exp == 0, sub, normal)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _load_rows(rows_ptr, lines, valid, col, offs_d, D: tl.constexpr, E: tl.constexpr, FP8: tl.constexpr):
    """Columns col + offs_d (< D) of the rows at `lines` [BL] -> [BL, BD] fp32 (0 where masked)."""
    mask = valid[:, None] & (offs_d[None, :] < D)
    if FP8:
        base = rows_ptr + lines[:, None] * (E + E // 32)
        codes = tl.load(base + col + offs_d[None, :], mask=mask, other=0).to(tl.int32)
        sf = tl.load(base + E + (col + offs_d[None, :]) // 32, mask=mask, other=127).to(tl.int32)
        return _e4m3_to_f32(codes) * (sf << 23).to(tl.float32, bitcast=True)
    return tl.load(rows_ptr + lines[:, None] * E + col + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _softcapped(s, softcap):
    """softcap * tanh(s / softcap); tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) <= 1 (no
    overflow: large |x| saturate to +-1)."""
    x = s / softcap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(x < 0, -t, t)


@triton.jit
def _decode_kernel(q_ptr, rows_ptr, index_ptr, lens_ptr, sinks_ptr, out_ptr, L, R, LPU, LAYER_OFFSET, scale, softcap,
                   sqn, sqh, sqd, sin, sil, son, soh, sod,
                   G: tl.constexpr, D: tl.constexpr, E: tl.constexpr, V_OFFSET: tl.constexpr,
                   FP8: tl.constexpr, F32_DOT: tl.constexpr, HAS_LENS: tl.constexpr, SOFTCAP: tl.constexpr,
                   HAS_SINKS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program (n, h): query n's heads h*G .. h*G + G-1 over the slots of index[n] (its first
    lens[n] columns with HAS_LENS: the rest are -1)."""
    n = tl.program_id(0)
    kv_head = tl.program_id(1)
    if HAS_LENS:
        L = tl.minimum(tl.load(lens_ptr + n).to(tl.int32), L)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * G + offs_g
    q_mask = (offs_g[:, None] < G) & (offs_d[None, :] < D)
    q = tl.load(q_ptr + n * sqn + heads[:, None] * sqh + offs_d[None, :] * sqd, mask=q_mask, other=0.0)  # [BG, BD]
    if HAS_SINKS:  # the sink as a first, value-less key: max = sink, sum = e^0 (0 for a sink of -inf)
        m_i = tl.load(sinks_ptr + heads, mask=offs_g < G, other=float("-inf")).to(tl.float32)  # [BG]
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = 0
    while start < L:  # not range(): the interpreter's range() calls int() on a 1-element array (numpy >= 2.4)
        cols = start + tl.arange(0, BLOCK_L)
        slot = tl.load(index_ptr + n * sin + cols * sil, mask=cols < L, other=-1).to(tl.int64)  # [BL]
        valid = slot >= 0
        safe = tl.where(valid, slot, 0)
        lines = safe + safe // R * (LPU - R) + LAYER_OFFSET  # ops/addressing.cache_line
        k = _load_rows(rows_ptr, lines, valid, kv_head * D, offs_d, D, E, FP8).to(q.dtype)  # [BL, BD]
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")  # [BG, BL]
        else:
            s = tl.dot(q, tl.trans(k))  # [BG, BL]
        s = s * scale
        if SOFTCAP:
            s = _softcapped(s, softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BG]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)  # [BG]
        p = tl.exp(s - m_safe[:, None])  # [BG, BL]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_rows(rows_ptr, lines, valid, V_OFFSET + kv_head * D, offs_d, D, E, FP8).to(q.dtype)  # [BL, BD]
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new
        start += BLOCK_L
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [BG, BD]; no listed slot -> 0
    tl.store(out_ptr + n * son + heads[:, None] * soh + offs_d[None, :] * sod, out.to(out_ptr.dtype.element_ty),
             mask=q_mask)


def decode_attention(q: torch.Tensor, rows2d: torch.Tensor, index: torch.Tensor, num_kv_heads: int,
                     rows_per_unit: int, lines_per_unit: int, layer_offset: int, scale: float,
                     fp8: bool, shared_kv: bool = False, lens: torch.Tensor | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D] over the cached rows at index [N, L] (-1: nothing) -> [N, H, D]. lens [N]
    (optional): row n names slots in its first lens[n] columns only, so the walk stops there.
    softcap (None: none) caps the scaled logits; sinks [H] (None: none) join each head's softmax.

    rows2d is the group's line-per-row allocation ([lines, E] plain, [lines, E + E/32] uint8 for
    MXFP8), E = parts * H_kv * D; slot s of this layer is line cache_line(s, rows_per_unit,
    lines_per_unit, layer_offset). shared_kv: the row is one part read as both K and V."""
    num_queries, num_heads, head_dim = q.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    out = torch.empty_like(q)  # [N, H, D]
    if num_queries == 0:
        return out
    group = num_heads // num_kv_heads
    e_half = num_kv_heads * head_dim
    e = e_half if shared_kv else 2 * e_half
    index = index if index.shape[1] else index.new_full((num_queries, 1), -1)  # [N, L >= 1]
    lens_arg = index if lens is None else lens  # an unused pointer without lens
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must be [H] = [{num_heads}], got shape {tuple(sinks.shape)}")
    sinks_arg = index if sinks is None else sinks  # an unused pointer without sinks
    _decode_kernel[(num_queries, num_kv_heads)](
        q, rows2d, index, lens_arg, sinks_arg, out, index.shape[1], rows_per_unit, lines_per_unit, layer_offset,
        scale, 1.0 if softcap is None else float(softcap), *q.stride(), *index.stride(), *out.stride(),
        G=group, D=head_dim, E=e, V_OFFSET=0 if shared_kv else e_half, FP8=fp8, HAS_LENS=lens is not None,
        SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        F32_DOT=q.dtype == torch.float32 or interpreted(), BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)), BLOCK_L=BLOCK_L)
    return out


def decode_layer_attention(cache, q: torch.Tensor, index: torch.Tensor, scale: float,
                           lens: torch.Tensor | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`torch_ref.decode_attention` through the kernel, reading a LayerCache's rows."""
    codec = cache.codec
    return decode_attention(q, cache.rows2d, index, codec.num_kv_heads, cache.rows_per_unit,
                            cache.lines_per_unit, cache.layer_offset, scale, codec.fp8, codec.shared_kv, lens,
                            softcap, sinks)
