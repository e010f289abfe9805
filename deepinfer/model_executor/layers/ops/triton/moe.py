"""Grouped expert GEMM for routed MoE experts (clamped SwiGLU), in Triton.

The torch reference (`FusedExperts` in layers/fused_moe.py) loops over experts in Python.
Here the T*k (token, slot) pairs are sorted by expert once and each expert's run of pairs is padded
to a multiple of `BLOCK_M`, so every row block of the sorted list belongs to exactly one expert
(`align_pairs_by_expert`, plain torch, no host sync). Two kernel launches then cover all experts:

1. `_gate_up_act_kernel`: `act[row] = silu(min(g, L)) * clamp(u, -L, L)` with `g | u = x[token] @ W1[e]^T`,
   written at the pair's padded sorted row (`act [R_pad, I]`, in the activation dtype).
2. `_down_kernel`: `y[pair] = w[pair] * (act[row] @ W2[e]^T)` in fp32, written at the pair's own index
   (`y [T*k, H]`), so the final per-token sum `y.view(T, k, H).sum(1)` needs no atomics and is deterministic.

The math follows the torch loop: fp32 accumulation, the projections rounded to the activation dtype
before the SwiGLU and before weighting (as `F.linear` in that dtype does), routing weights and the
token sum in fp32. Dots run in IEEE fp32 (no TF32) for fp32 inputs; under the interpreter dot operands
are widened to fp32 and bf16 rounding is done by bits (see `_dot`, `_round_to`). Blocks past the last
expert's padding carry expert -1 and exit at once, so the grid can be sized from T*k alone (an upper
bound) and never waits on the device for the true block count.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.ops.triton import PIP_HINT, triton_available

if not triton_available():
    raise ImportError(f"the Triton MoE kernels need triton: {PIP_HINT}")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DOT_MIN = 16  # tl.dot needs every block dimension >= 16 on a GPU


def _block(n: int, cap: int) -> int:
    """A power-of-two block size for a dimension of `n`, at least DOT_MIN and at most `cap`."""
    return max(DOT_MIN, min(cap, triton.next_power_of_2(max(n, 1))))


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per expert block: 16 while experts see few pairs each (decode; padding would dominate), else 64."""
    return DOT_MIN if num_pairs < 32 * num_experts else 64


def max_padded_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the row blocks after padding each expert's pairs to a multiple of `block_m`.

    sum_e ceil(c_e / B) <= (P + n_active * (B - 1)) / B with n_active <= min(E, P) experts in use.
    """
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert and pad each expert's run to a multiple of `block_m`.

    `topk_ids [T, k]` -> (`sorted_pairs [NB*block_m]` int64: the flat pair index t*k+j at each padded
    sorted row, `T*k` on padding rows; `block_expert [NB]` int32: the expert of each row block, -1 past
    the last expert's padding; `expert_offsets [E+1]` int64: where expert e's rows start, padded).
    NB = `max_padded_blocks(T*k, E, block_m)`; experts without pairs get no block. Ids must lie in [0, E).
    """
    flat = topk_ids.reshape(-1).long()  # [P]
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=device)  # [E+1]
    offsets[1:] = padded.cumsum(0)
    order = flat.argsort(stable=True)  # [P] pair indices grouped by expert
    sorted_experts = flat[order]  # [P]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]  # [P]
    num_blocks = max_padded_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.long, device=device)  # [NB*B]
    sorted_pairs[offsets[sorted_experts] + rank] = order
    starts = torch.arange(num_blocks, device=device) * block_m  # [NB]
    block_expert = torch.searchsorted(offsets[1:], starts, right=True)  # [NB] in [0, E]
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)  # [NB]
    return sorted_pairs, block_expert, offsets


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 products; UPCAST (the interpreter, whose dot misreads bf16 data) widens a and b first."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _round_to(x, OUT: tl.constexpr):
    """fp32 `x` rounded to OUT's precision (nearest, ties to even), kept in fp32.

    bf16 rounds by bits: the interpreter's fp32 -> bf16 cast truncates, a GPU's rounds to nearest.
    """
    if OUT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(OUT).to(tl.float32)


@triton.jit
def _tile(sorted_pairs_ptr, num_pairs, num_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (m, n)'s tile: padded sorted rows [BM] (int64), their pairs [BM] and which are real,
    columns [BN] and which lie below `num_cols`."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    pairs = tl.load(sorted_pairs_ptr + rows)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    return rows, pairs, pairs < num_pairs, cols, cols < num_cols


@triton.jit
def _gate_up_act_kernel(x_ptr, w_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr,
                        num_pairs, top_k, limit,
                        stride_xt, stride_we, stride_wn, stride_wk, stride_ar,
                        hidden: tl.constexpr, inter: tl.constexpr, HAS_LIMIT: tl.constexpr, UPCAST: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of act = clamped_swiglu(x[token] @ W1[e]^T) for one expert's row block."""
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows, pairs, row_ok, cols, col_ok = _tile(sorted_pairs_ptr, num_pairs, inter, BLOCK_M, BLOCK_N)  # cols: channels
    tokens = tl.where(row_ok, pairs // top_k, 0).to(tl.int64)  # [BM]
    w_base = w_ptr + expert * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = ks < hidden  # [BK]
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w_mask = k_ok[:, None] & col_ok[None, :]  # [BK, BN]
        w_off = ks[:, None] * stride_wk + cols[None, :] * stride_wn  # [BK, BN]
        w_gate = tl.load(w_base + w_off, mask=w_mask, other=0.0).to(a.dtype)  # [BK, BN]
        w_up = tl.load(w_base + inter * stride_wn + w_off, mask=w_mask, other=0.0).to(a.dtype)  # [BK, BN]
        acc_gate = _dot(a, w_gate, acc_gate, UPCAST)  # [BM, BN]
        acc_up = _dot(a, w_up, acc_up, UPCAST)  # [BM, BN]
    out_ty = act_ptr.dtype.element_ty
    gate = _round_to(acc_gate, out_ty)  # [BM, BN] rounded like F.linear's output
    up = _round_to(acc_up, out_ty)  # [BM, BN]
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    silu = _round_to(gate / (1.0 + tl.exp(-gate)), out_ty)  # [BM, BN]
    act = _round_to(silu * up, out_ty)  # [BM, BN] exact in out_ty
    tl.store(act_ptr + rows[:, None] * stride_ar + cols[None, :], act.to(out_ty),
             mask=col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, y_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr,
                 num_pairs,
                 stride_ar, stride_we, stride_wn, stride_wk, stride_yp,
                 hidden: tl.constexpr, inter: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y[pair] = weight[pair] * (act[row] @ W2[e]^T), fp32, at each pair's row."""
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows, pairs, row_ok, cols, col_ok = _tile(sorted_pairs_ptr, num_pairs, hidden, BLOCK_M, BLOCK_N)  # cols: hidden
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = ks < inter  # [BK]
        a = tl.load(act_ptr + rows[:, None] * stride_ar + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(a.dtype)  # [BK, BN]
        acc = _dot(a, w, acc, UPCAST)  # [BM, BN]
    out = _round_to(acc, act_ptr.dtype.element_ty)  # [BM, BN] rounded like F.linear's output
    safe_pairs = tl.where(row_ok, pairs, 0).to(tl.int64)  # [BM]
    weight = tl.load(weights_ptr + safe_pairs, mask=row_ok, other=0.0)  # [BM] fp32
    tl.store(y_ptr + safe_pairs[:, None] * stride_yp + cols[None, :], out * weight[:, None],
             mask=row_ok[:, None] & col_ok[None, :])


def _check_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
    """Raise ValueError naming the first argument whose shape or dtype does not fit."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [T, H] tensor, got {x.dtype} {tuple(x.shape)}")
    num_experts, two_inter, hidden = gate_up_proj.shape
    if hidden != x.shape[1] or two_inter % 2:
        raise ValueError(f"gate_up_proj must have shape [E, 2I, {x.shape[1]}], got {tuple(gate_up_proj.shape)}")
    if down_proj.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"down_proj must have shape {(num_experts, hidden, two_inter // 2)}, "
                         f"got {tuple(down_proj.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.is_floating_point():
        raise ValueError(f"topk_ids must be an integer [{x.shape[0]}, k] tensor, got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must have shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")


def _check_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError when an expert id lies outside [0, E) (reads the ids back to the host)."""
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), got {lo}..{hi}")


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  gate_up_proj: torch.Tensor, down_proj: torch.Tensor, swiglu_limit: float | None = None,
                  *, check_ids: bool = True, block_m: int | None = None) -> torch.Tensor:
    """Routed clamped-SwiGLU experts as two grouped GEMM launches.

    x [T, H], topk_ids [T, k] (expert ids), topk_weights [T, k], gate_up_proj [E, 2I, H] (gate rows, then
    up rows), down_proj [E, H, I] -> [T, H] in x's dtype: sum_j w[t, j] * expert_{ids[t, j]}(x[t]).
    Weights may be another float dtype than x (tiles are cast to x's dtype, as a dequantized checkpoint
    would be). `check_ids=False` skips the range check of the ids (a host sync) for a caller that did it.
    `block_m` (rows per expert block, a power of two >= 16) defaults to `default_block_m(T*k, E)`.
    """
    _check_inputs(x, topk_ids, topk_weights, gate_up_proj, down_proj)
    num_experts, two_inter, hidden = gate_up_proj.shape
    inter, (num_tokens, top_k) = two_inter // 2, topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)  # [T, H]
    if check_ids:
        _check_ids(topk_ids, num_experts)
    block_m = default_block_m(num_pairs, num_experts) if block_m is None else block_m
    if block_m < DOT_MIN or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= {DOT_MIN}, got {block_m}")
    x = x.contiguous()  # [T, H]
    sorted_pairs, block_expert, _ = align_pairs_by_expert(topk_ids, num_experts, block_m)  # [NB*BM], [NB]
    upcast = not x.is_cuda  # interpreted: widen dot operands (exact for bf16/fp16 products)
    act = torch.empty(sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)  # [NB*BM, I]
    block_n, block_k = _block(inter, 64), _block(hidden, 64)
    grid = (block_expert.numel(), triton.cdiv(inter, block_n))
    _gate_up_act_kernel[grid](x, gate_up_proj, act, sorted_pairs, block_expert,
                              num_pairs, top_k, float(swiglu_limit or 0.0),
                              x.stride(0), *gate_up_proj.stride(), act.stride(0),
                              hidden=hidden, inter=inter, HAS_LIMIT=swiglu_limit is not None, UPCAST=upcast,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    weights = topk_weights.reshape(-1).float().contiguous()  # [P]
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    block_n, block_k = _block(hidden, 64), _block(inter, 64)
    grid = (block_expert.numel(), triton.cdiv(hidden, block_n))
    _down_kernel[grid](act, down_proj, y, sorted_pairs, block_expert, weights,
                       num_pairs,
                       act.stride(0), *down_proj.stride(), y.stride(0),
                       hidden=hidden, inter=inter, UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)  # [T, H]
