"""DeepSeek-V4 lightning-indexer scores as one Triton kernel (the torch reference is
`IndexerScorer.score` in `models/deepseek_v4/indexer.py`):

    I(n, r) = sum_h w[n, h] · ReLU(q[n, h] · K_r) · index_head_dim^-1/2

Scores only: masking invisible rows and the stable top-k stay in torch (`topk_visible_rows`), so
the tie rule is untouched. Keys are read through line indices, from a dense tensor (shared [R, d]
or one list per query [n, R, d]) or straight from a LayerCache (MXFP8 index rows dequantized in
the kernel). The products are IEEE fp32 like the reference's: the scores pick rows, and a
rounding change could move a pick.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.ops.triton import tl, triton
from deepinfer.model_executor.layers.ops.triton.sparse_mla import MIN_DOT, cache_lines, load_latent_rows


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, out_ptr, rows_ptr, lines_ptr, row_stride, num_heads, num_rows, scale,
                           stride_qn, stride_qh, stride_wn, stride_on, stride_ln,
                           D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                           FP8: tl.constexpr):
    """Program (query n, block of rows): out[n, rows]; -inf where a line is -1."""
    n = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    lines = tl.load(lines_ptr + n * stride_ln + offs_r, mask=offs_r < num_rows, other=-1)  # [BR]
    keys = load_latent_rows(rows_ptr, lines, row_stride, offs_d, D, FP8)  # [BR, BD] fp32
    total = tl.zeros((BLOCK_R,), tl.float32)
    h0 = 0
    while h0 < num_heads:  # not range(): see sparse_mla._attend_rows
        offs_h = h0 + tl.arange(0, BLOCK_H)
        head_ok = offs_h < num_heads
        q = tl.load(q_ptr + n * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=head_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)  # [BH, BD]
        w = tl.load(w_ptr + n * stride_wn + offs_h, mask=head_ok, other=0.0).to(tl.float32)  # [BH]
        dots = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [BH, BR]
        total += tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)  # [BR]
        h0 += BLOCK_H
    total = tl.where(lines >= 0, total, float("-inf"))
    tl.store(out_ptr + n * stride_on + offs_r, total, mask=offs_r < num_rows)


def _check(q: torch.Tensor, weights: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [n, h, d], got shape {tuple(q.shape)}")
    if tuple(weights.shape) != tuple(q.shape[:2]):
        raise ValueError(f"weights must be [n, h] = {tuple(q.shape[:2])}, got shape {tuple(weights.shape)}")


def _launch(q, weights, rows: torch.Tensor, lines: torch.Tensor, fp8: bool, softmax_scale: float) -> torch.Tensor:
    """q [n, h, d], weights [n, h], rows [lines, row], lines [n or 1, R] int32 (-1: none) -> [n, R] fp32."""
    n, h, d = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    lines = lines.contiguous()
    out = torch.empty(n, lines.shape[1], dtype=torch.float32, device=q.device)  # [n, R]
    if out.numel() == 0:
        return out
    block_r = MIN_DOT if d > 128 else 2 * MIN_DOT
    grid = (n, triton.cdiv(lines.shape[1], block_r))
    _indexer_scores_kernel[grid](
        q, weights, out, rows, lines, rows.stride(0), h, lines.shape[1], float(softmax_scale),
        q.stride(0), q.stride(1), weights.stride(0), out.stride(0), lines.stride(0) if lines.shape[0] > 1 else 0,
        D=d, BLOCK_H=max(MIN_DOT, min(64, triton.next_power_of_2(h))), BLOCK_R=block_r,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(d)), FP8=fp8)
    return out  # [n, R]


def indexer_scores(q: torch.Tensor, index_keys: torch.Tensor, weights: torch.Tensor,
                   softmax_scale: float) -> torch.Tensor:
    """`IndexerScorer.score` in one kernel: q [n, h, d], index_keys [R, d] (shared) or [n, R, d]
    (each query's own), weights [n, h] -> scores [n, R] fp32, not yet masked."""
    _check(q, weights)
    n, _, d = q.shape
    if index_keys.dim() not in (2, 3) or index_keys.shape[-1] != d or (index_keys.dim() == 3 and
                                                                      index_keys.shape[0] != n):
        raise ValueError(f"index_keys must be [R, {d}] or [{n}, R, {d}], got shape {tuple(index_keys.shape)}")
    width = index_keys.shape[-2]
    keys = index_keys.reshape(-1, d)  # [R or n*R, d]
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    per_query = index_keys.dim() == 3
    lines = torch.arange(keys.shape[0], dtype=torch.int32, device=q.device).view(n if per_query else 1, width)
    return _launch(q, weights, keys, lines, False, softmax_scale)  # [n, R]


def indexer_scores_from_cache(q: torch.Tensor, weights: torch.Tensor, index_cache, slots: torch.Tensor,
                              softmax_scale: float) -> torch.Tensor:
    """Scores against the index rows at `slots` [R] (shared) or [n, R] (per query) of a LayerCache,
    read and (MXFP8) dequantized in the kernel -> [n, R] fp32; -inf where a slot is -1."""
    _check(q, weights)
    if index_cache.codec.num_elements != q.shape[-1]:
        raise ValueError(f"q head_dim={q.shape[-1]} does not match the index row's "
                         f"{index_cache.codec.num_elements} elements")
    if slots.dim() not in (1, 2) or (slots.dim() == 2 and slots.shape[0] != q.shape[0]):
        raise ValueError(f"slots must be [R] or [{q.shape[0]}, R], got shape {tuple(slots.shape)}")
    lines = cache_lines(index_cache, slots.view(-1 if slots.dim() == 2 else 1, slots.shape[-1]))  # [n or 1, R]
    return _launch(q, weights, index_cache.rows2d, lines, bool(index_cache.codec.fp8), softmax_scale)  # [n, R]
