"""Batched LoRA deltas in Triton: shrink and expand launches over rows grouped by adapter slot.

The op (ops/lora_kernels.py states it; ops/lora.py holds the torch reference):

    y[t] = scale[s] * (x[t] @ a[s]^T) @ b[s]^T   for slot[t] = s >= 0,   0 for slot -1
    x [T, in], a [S, r_max, in], b [S, out, r_max], scale [S] -> y [T, out] in x's dtype

As in punica's segmented GEMMs, the rows are first grouped by slot (`group_rows_by_slot`, plain torch,
no host sync): `order` lists the rows slot by slot, `starts[s]` / `counts[s]` give slot s's run of it.
The grid is sized from T alone (an upper bound), one grid axis per slot; a program whose row block
lies past its slot's count exits at once, and so does every program of an unused slot.

    order:   | rows of slot 0 | rows of slot 1 | ... | (rows of slot -1: never read)
               ^ starts[0]      ^ starts[1]
    program (m, s) takes order[starts[s] + m * BLOCK_M ...][:counts[s] - m * BLOCK_M]

1. `_shrink_kernel`: h[row, r] = scale[s] * x[row] @ a[s, r]^T, fp32 [T, r_max] (rows of slot -1 unwritten).
2. `_expand_kernel`: y[row, n] = h[row] @ b[s, n]^T, written in y's dtype at the row's own index; y starts
   at zero, so rows of slot -1 keep 0.

Dots accumulate in fp32 (IEEE for fp32 inputs, no TF32); the shrink multiplies in x's dtype (tensor
cores for bf16), the expand in fp32 (h is never rounded). Under the interpreter dot operands are widened
to fp32 and bf16 is rounded by bits (`moe._dot`, `moe._round_to`).
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.ops.lora_kernels import check_lora_args
from deepinfer.model_executor.layers.ops.triton import PIP_HINT, triton_available

if not triton_available():
    raise ImportError(f"the Triton LoRA kernels need triton: {PIP_HINT}")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from deepinfer.model_executor.layers.ops.triton.moe import _dot, _round_to  # noqa: E402

DOT_MIN = 16  # tl.dot needs every block dimension >= 16 on a GPU


def _block(n: int, cap: int) -> int:
    """A power-of-two block size for a dimension of `n`, at least DOT_MIN and at most `cap`."""
    return max(DOT_MIN, min(cap, triton.next_power_of_2(max(n, 1))))


def group_rows_by_slot(slot: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """slot [T] int64 in [-1, S) -> (order [T] int64: the rows grouped by slot, row order kept within a slot,
    rows of slot -1 last; starts [S] int64: where slot s's rows begin in `order`; counts [S] int64)."""
    key = torch.where(slot < 0, num_slots, slot)  # [T]: slot -1 sorts last
    order = key.argsort(stable=True)  # [T]
    counts = torch.bincount(key, minlength=num_slots + 1)[:num_slots]  # [S]
    starts = counts.cumsum(0) - counts  # [S]
    return order, starts, counts


@triton.jit
def _slot_rows(order_ptr, starts_ptr, counts_ptr, slot, pid_m, BLOCK_M: tl.constexpr):
    """Rows [BM] (int64) of program block `pid_m` of `slot`'s run, and which of them are real."""
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    ok = offs < tl.load(counts_ptr + slot)  # [BM]
    rows = tl.load(order_ptr + tl.load(starts_ptr + slot) + offs, mask=ok, other=0).to(tl.int64)  # [BM]
    return rows, ok


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, scale_ptr, h_ptr, order_ptr, starts_ptr, counts_ptr,
                   stride_xt, stride_as, stride_ar, stride_ak, stride_ht,
                   hidden: tl.constexpr, rank: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_R] tile of h = scale[s] * x[rows] @ a[s]^T for one slot's row block."""
    slot = tl.program_id(1)
    num_r = tl.cdiv(rank, BLOCK_R)
    pid_m, pid_r = tl.program_id(0) // num_r, tl.program_id(0) % num_r
    if pid_m * BLOCK_M >= tl.load(counts_ptr + slot):
        return
    rows, row_ok = _slot_rows(order_ptr, starts_ptr, counts_ptr, slot, pid_m, BLOCK_M)  # [BM]
    rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    r_ok = rs < rank  # [BR]
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = ks < hidden  # [BK]
        xt = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        at = tl.load(a_base + ks[:, None] * stride_ak + rs[None, :] * stride_ar,
                     mask=k_ok[:, None] & r_ok[None, :], other=0.0).to(xt.dtype)  # [BK, BR]
        acc = _dot(xt, at, acc, UPCAST)  # [BM, BR]
    scale = tl.load(scale_ptr + slot)
    tl.store(h_ptr + rows[:, None] * stride_ht + rs[None, :], acc * scale,
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, order_ptr, starts_ptr, counts_ptr,
                   stride_ht, stride_bs, stride_bn, stride_br, stride_yt,
                   out_features: tl.constexpr, rank: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y[rows] = h[rows] @ b[s]^T for one slot's row block, in fp32."""
    slot = tl.program_id(1)
    num_n = tl.cdiv(out_features, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // num_n, tl.program_id(0) % num_n
    if pid_m * BLOCK_M >= tl.load(counts_ptr + slot):
        return
    rows, row_ok = _slot_rows(order_ptr, starts_ptr, counts_ptr, slot, pid_m, BLOCK_M)  # [BM]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_ok = cols < out_features  # [BN]
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)  # [BR]
        r_ok = rs < rank  # [BR]
        ht = tl.load(h_ptr + rows[:, None] * stride_ht + rs[None, :],
                     mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # [BM, BR] fp32
        bt = tl.load(b_base + rs[:, None] * stride_br + cols[None, :] * stride_bn,
                     mask=r_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # [BR, BN]
        acc = tl.dot(ht, bt, acc, input_precision="ieee")  # [BM, BN]
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + rows[:, None] * stride_yt + cols[None, :], _round_to(acc, out_ty).to(out_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def default_block_m(num_tokens: int, num_slots: int) -> int:
    """Rows per slot block: 16 while slots see few rows each (decode), else 64."""
    return DOT_MIN if num_tokens < 32 * num_slots else 64


def lora_shrink(x: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, grouping: tuple, block_m: int) -> torch.Tensor:
    """h [T, r_max] fp32 = scale[s] * x @ a[s]^T per row of slot s (rows of slot -1 left unwritten)."""
    order, starts, counts = grouping
    (num_tokens, hidden), (num_slots, rank) = x.shape, a.shape[:2]
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)  # [T, R]
    block_r, block_k = _block(rank, 64), _block(hidden, 128)
    grid = (triton.cdiv(num_tokens, block_m) * triton.cdiv(rank, block_r), num_slots)
    _shrink_kernel[grid](x, a, scale, h, order, starts, counts,
                         x.stride(0), *a.stride(), h.stride(0),
                         hidden=hidden, rank=rank, UPCAST=not x.is_cuda,
                         BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k)
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, grouping: tuple, dtype: torch.dtype, block_m: int) -> torch.Tensor:
    """y [T, out] in `dtype` = h[t] @ b[s]^T per row of slot s, 0 for rows of slot -1."""
    order, starts, counts = grouping
    (num_tokens, rank), (num_slots, out_features) = h.shape, b.shape[:2]
    y = torch.zeros(num_tokens, out_features, dtype=dtype, device=h.device)  # [T, out]
    block_n, block_r = _block(out_features, 128 if num_tokens > 64 else 64), _block(rank, 64)
    grid = (triton.cdiv(num_tokens, block_m) * triton.cdiv(out_features, block_n), num_slots)
    _expand_kernel[grid](h, b, y, order, starts, counts,
                         h.stride(0), *b.stride(), y.stride(0),
                         out_features=out_features, rank=rank,
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r)
    return y


def lora_delta_triton(x: torch.Tensor, slot: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                      *, block_m: int | None = None) -> torch.Tensor:
    """The deltas [T, out] in x's dtype: one shrink and one expand launch. Slots must lie in [-1, S) (not
    checked: that would read them back to the host). `block_m` (a power of two >= 16): rows per slot block."""
    num_tokens, _, num_slots, rank, out_features = check_lora_args(x, slot, a, b, scale)
    if num_tokens == 0 or rank == 0 or num_slots == 0:
        return torch.zeros(num_tokens, out_features, dtype=x.dtype, device=x.device)  # [T, out]
    block_m = default_block_m(num_tokens, num_slots) if block_m is None else block_m
    if block_m < DOT_MIN or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= {DOT_MIN}, got {block_m}")
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    grouping = group_rows_by_slot(slot, num_slots)  # order [T], starts [S], counts [S]
    h = lora_shrink(x, a, scale.float().contiguous(), grouping, block_m)  # [T, R] fp32
    return lora_expand(h, b, grouping, x.dtype, block_m)  # [T, out]
