"""DeepSeek-V4 sparse MLA decode as one Triton kernel (the torch reference is
`layers/ops/torch_sparse_mla.py`; this module keeps its signature).

Per query n and a block of heads: one online softmax over the window rows named by
`indices_in_kvcache[n]`, then the compressed rows named by `indices_in_kvcache_extra[n]` (-1: no
row, skipped), then the per-head sink logit, which takes probability mass but adds no value. The
latent row is both K and V. No causal mask: the index rows are the mask. Rows are read straight
from a LayerCache's line-per-row allocation; MXFP8 rows (e4m3 values | UE8M0 scale bytes, one per
32 values) are dequantized in the kernel, plain rows (bf16 / fp16 / fp32) are loaded as they are.

Numerics follow the reference: rows are rounded to the query dtype, logits and the softmax are
fp32. fp32 queries multiply in IEEE fp32; bf16 / fp16 queries use the tensor-core dot with fp32
accumulation (the probabilities are rounded to the query dtype for P @ V). Under the interpreter
every dot is fp32 (`interpreted()`): its bf16 tl.dot returns garbage (Triton 3.6, numpy 2.4).
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.ops.addressing import cache_line
from deepinfer.model_executor.layers.ops.triton import PIP_HINT, interpreted, tl, triton, triton_available

if not triton_available():
    raise ImportError(f"the Triton sparse MLA kernel needs triton: {PIP_HINT}")

MIN_DOT = 16  # tl.dot needs every block dimension >= 16 on a GPU


@triton.jit
def load_latent_rows(rows_ptr, lines, row_stride, offs_d, D: tl.constexpr, FP8: tl.constexpr):
    """Rows at `lines` [BL] (-1: none) of a line-per-row allocation -> [BL, BD] fp32, 0 where the
    line is -1 or the column is past D. FP8: e4m3 bytes 0..D-1, then one UE8M0 byte per 32."""
    valid = lines >= 0
    mask = valid[:, None] & (offs_d[None, :] < D)
    base = rows_ptr + tl.where(valid, lines, 0).to(tl.int64)[:, None] * row_stride  # [BL, 1]
    if FP8:
        raw = tl.load(base + offs_d[None, :], mask=mask, other=0)  # [BL, BD] uint8
        values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BL, BD]
        exps = tl.load(base + D + offs_d[None, :] // 32, mask=mask, other=127).to(tl.int32) - 127  # [BL, BD]
        rows = values * tl.exp2(exps.to(tl.float32))
    else:
        rows = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)  # [BL, BD]
    return rows


@triton.jit
def _attend_rows(q, q_ptr, m, denom, acc, rows_ptr, lines_ptr, row_stride, num_cols, scale, offs_d,
                 D: tl.constexpr, BLOCK_L: tl.constexpr, FP8: tl.constexpr, DOT_F32: tl.constexpr):
    """Fold one index row's rows into the running (max m [BH], denominator [BH], acc [BH, BD]).
    Rows are rounded to q's storage dtype (as the reference does), then to q's dot dtype."""
    offs_l = tl.arange(0, BLOCK_L)
    start = 0
    while start < num_cols:  # not range(): the interpreter's range() calls int() on a 1-element array (numpy >= 2.4)
        cols = start + offs_l
        lines = tl.load(lines_ptr + cols, mask=cols < num_cols, other=-1)  # [BL]
        kv = load_latent_rows(rows_ptr, lines, row_stride, offs_d, D, FP8)  # [BL, BD] fp32
        kv = kv.to(q_ptr.dtype.element_ty).to(q.dtype)  # [BL, BD]
        if DOT_F32:
            logits = tl.dot(q, tl.trans(kv), input_precision="ieee")  # [BH, BL]
        else:
            logits = tl.dot(q, tl.trans(kv))  # [BH, BL]
        logits = tl.where((lines >= 0)[None, :], logits * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))  # [BH]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)  # [BH]
        p = tl.exp(logits - m_safe[:, None])  # [BH, BL]
        denom = denom * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")  # [BH, BD]
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)  # [BH, BD]
        m = m_new
        start += BLOCK_L
    return m, denom, acc


@triton.jit
def _sparse_mla_decode_kernel(q_ptr, out_ptr, sink_ptr, rows_a, lines_a, row_stride_a, cols_a,
                              rows_b, lines_b, row_stride_b, cols_b, num_heads, scale,
                              stride_qn, stride_qh, stride_on, stride_oh,
                              D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
                              BLOCK_D: tl.constexpr, FP8_A: tl.constexpr, FP8_B: tl.constexpr,
                              DOT_F32: tl.constexpr):
    """Program (query n, head block): out[n, heads] over rows A, rows B and the sink."""
    n = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_ok = offs_h < num_heads
    mask_hd = head_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(q_ptr + n * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :], mask=mask_hd, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    m, denom, acc = _attend_rows(q, q_ptr, m, denom, acc, rows_a, lines_a + n * cols_a, row_stride_a, cols_a, scale,
                                 offs_d, D, BLOCK_L, FP8_A, DOT_F32)
    m, denom, acc = _attend_rows(q, q_ptr, m, denom, acc, rows_b, lines_b + n * cols_b, row_stride_b, cols_b, scale,
                                 offs_d, D, BLOCK_L, FP8_B, DOT_F32)
    sink = tl.load(sink_ptr + offs_h, mask=head_ok, other=float("-inf")).to(tl.float32)  # [BH]
    m_all = tl.maximum(m, sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    alpha = tl.exp(m - m_safe)
    denom = denom * alpha + tl.exp(sink - m_safe)
    out = acc * alpha[:, None] / tl.where(denom > 0, denom, 1.0)[:, None]  # [BH, BD]; 0 when nothing is read
    tl.store(out_ptr + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_hd)


def cache_lines(cache, slots: torch.Tensor) -> torch.Tensor:
    """Flat slots [...] of a LayerCache -> lines of its `rows2d` [...] int32, -1 kept."""
    lines = cache_line(slots.clamp(min=0), cache.rows_per_unit, cache.lines_per_unit, cache.layer_offset)
    return torch.where(slots >= 0, lines, -1).to(torch.int32)  # [...]


def _source(cache, slots: torch.Tensor, num_queries: int, head_dim: int):
    """(rows2d, lines [N, L] int32 contiguous, row stride, fp8) of one cache read through slots."""
    if slots.dim() != 2 or slots.shape[0] != num_queries:
        raise ValueError(f"index rows must be [N={num_queries}, L], got shape {tuple(slots.shape)}")
    if cache.codec.num_elements != head_dim:
        raise ValueError(f"q head_dim={head_dim} does not match the cache row's {cache.codec.num_elements} elements")
    return cache.rows2d, cache_lines(cache, slots).contiguous(), cache.rows2d.stride(0), bool(cache.codec.fp8)


def decode_mla_mqa_sparse(q: torch.Tensor, key_cache, indices_in_kvcache: torch.Tensor, softmax_scale: float,
                          attn_sink: torch.Tensor, key_cache_extra=None,
                          indices_in_kvcache_extra: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's contract in one kernel: q [N, H, D]; indices_in_kvcache [N, L] slots of
    key_cache (-1: none); optionally indices_in_kvcache_extra [N, L2] slots of key_cache_extra.
    One softmax over both row sets and the sink; K = V. -> [N, H, D] in q's dtype."""
    n, h, d = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    a = _source(key_cache, indices_in_kvcache, n, d)
    if key_cache_extra is not None and indices_in_kvcache_extra is not None:
        b = _source(key_cache_extra, indices_in_kvcache_extra, n, d)
    else:
        b = (a[0], a[1][:, :0].contiguous(), a[2], a[3])  # no extra rows
    sink = attn_sink.to(torch.float32).contiguous()  # [H]
    out = torch.empty_like(q)  # [N, H, D]
    if n == 0:
        return out
    block_h = max(MIN_DOT, min(64, triton.next_power_of_2(h))) if d <= 128 else MIN_DOT
    grid = (n, triton.cdiv(h, block_h))
    _sparse_mla_decode_kernel[grid](
        q, out, sink, a[0], a[1], a[2], a[1].shape[1], b[0], b[1], b[2], b[1].shape[1], h, float(softmax_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        D=d, BLOCK_H=block_h, BLOCK_L=MIN_DOT, BLOCK_D=max(MIN_DOT, triton.next_power_of_2(d)),
        FP8_A=a[3], FP8_B=b[3], DOT_F32=q.dtype == torch.float32 or interpreted())
    return out  # [N, H, D]
