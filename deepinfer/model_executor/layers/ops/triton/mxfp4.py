"""Routed experts with MXFP4 weights (GPT-OSS), as two grouped GEMM launches in Triton.

The weights stay packed (ops/mxfp4.py: E2M1 nibbles, one UE8M0 scale byte per 32 values); each
program decodes the tiles it reads. The experts are GPT-OSS's:

    gate_up   [E, 2I, H]  (blocks [E, 2I, H/32, 16], scales [E, 2I, H/32], bias [E, 2I]):
              rows interleaved, gate at 2c, up at 2c + 1
    down      [E, H, I]   (blocks [E, H, I/32, 16], scales [E, H, I/32], bias [E, H])
    act       g = min(gate, L), u = clamp(up, -L, L), act = (u + 1) * g * sigmoid(alpha * g)

Pairs (token, slot) are sorted by expert and padded per expert to BLOCK_M rows
(`ops/triton/moe.align_pairs_by_expert`, no host sync), then:

1. `_gate_up_kernel`: a tile of 2 * BN interleaved rows of x[token] @ W1[e]^T + b1, split into its
   gate and up columns, activated, written as act [R_pad, I] at the pair's padded row.
2. `_down_kernel`: y[pair] = weight[pair] * (act[row] @ W2[e]^T + b2), fp32, at the pair's own row, so
   the per-token sum `y.view(T, k, H).sum(1)` needs no atomics.

A K step of BK values reads BK / 2 bytes per weight row: the low nibbles hold the even values and
the high nibbles the odd ones, so the inputs are read as their even and odd columns, and one step
is two dots: x_even @ lo^T + x_odd @ hi^T. A nibble becomes a float by bits (sign, exponent and one
mantissa bit; code 1 is 0.5), times the block's 2^(s - 127); every such value is exact in bf16 as
in fp32, so a dot in the activation dtype multiplies exact weights. Dots run in IEEE fp32 for fp32
inputs; under the interpreter their operands are widened to fp32 (see ops/triton/moe.py).
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.ops.mxfp4 import check_mxfp4
from deepinfer.model_executor.layers.ops.triton import PIP_HINT, triton_available

if not triton_available():
    raise ImportError(f"the Triton MXFP4 kernels need triton: {PIP_HINT}")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from deepinfer.model_executor.layers.ops.triton.moe import _dot, align_pairs_by_expert, default_block_m  # noqa: E402

DOT_MIN = 16  # tl.dot needs every block dimension >= 16 on a GPU


def _block(n: int, cap: int, low: int = DOT_MIN) -> int:
    return max(low, min(cap, triton.next_power_of_2(max(n, 1))))


@triton.jit
def _e2m1(code, scale):
    """4-bit codes (int32) -> fp32 values times `scale`: sign bit 3, exponent bits 2..1, mantissa bit 0."""
    exp = (code >> 1) & 3
    man = code & 1
    normal = ((exp + 126) << 23) | (man << 22)  # 2^(e-1) * (1 + m/2) for e > 0
    sub = man * 0x3F000000  # e == 0: 0.5 or 0
    bits = tl.where(exp > 0, normal, sub) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * scale


@triton.jit
def _scale(s):
    """UE8M0 bytes (int32) -> 2^(s - 127) in fp32 (s = 0: the subnormal 2^-127)."""
    bits = tl.where(s == 0, 0x00400000, s << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mx_step(x_base, x_rows, x_ok, w_base, s_base, w_rows, w_ok, k0, K: tl.constexpr, acc,
             UPCAST: tl.constexpr, BK: tl.constexpr):
    """acc [BM, BN] + x[:, k0 : k0 + BK] @ W[rows, k0 : k0 + BK]^T for W in MXFP4 rows of K values.

    x_base + x_rows [BM]: the input rows (element offsets); w_base + w_rows [BN]: the packed rows (byte
    offsets, K/2 per row); their scales start at s_base + w_rows / 16 (K/32 per row)."""
    j = tl.arange(0, BK // 2)  # [BK/2] byte j of the step: values k0 + 2j, k0 + 2j + 1
    k_ok = k0 + 2 * j < K  # [BK/2]
    x_mask = x_ok[:, None] & k_ok[None, :]  # [BM, BK/2]
    x_even = tl.load(x_base + x_rows[:, None] + (k0 + 2 * j)[None, :], mask=x_mask, other=0.0)  # [BM, BK/2]
    x_odd = tl.load(x_base + x_rows[:, None] + (k0 + 2 * j + 1)[None, :], mask=x_mask, other=0.0)  # [BM, BK/2]
    w_mask = w_ok[:, None] & k_ok[None, :]  # [BN, BK/2]
    packed = tl.load(w_base + w_rows[:, None] + (k0 // 2 + j)[None, :], mask=w_mask, other=0).to(tl.int32)
    s = tl.load(s_base + (w_rows // 16)[:, None] + ((k0 + 2 * j) // 32)[None, :], mask=w_mask,
                other=0).to(tl.int32)  # [BN, BK/2]: each byte's block scale
    scale = _scale(s)  # [BN, BK/2]
    lo = _e2m1(packed & 15, scale).to(x_even.dtype)  # [BN, BK/2] even values
    hi = _e2m1(packed >> 4, scale).to(x_even.dtype)  # [BN, BK/2] odd values
    acc = _dot(x_even, tl.trans(lo), acc, UPCAST)  # [BM, BN]
    return _dot(x_odd, tl.trans(hi), acc, UPCAST)  # [BM, BN]


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, b_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr,
                    num_pairs, top_k, alpha, limit,
                    stride_xt, stride_ar,
                    hidden: tl.constexpr, inter: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[row, c] for one expert's row block and BLOCK_N channels c (2 * BLOCK_N interleaved weight rows)."""
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM] padded sorted rows
    pairs = tl.load(sorted_pairs_ptr + rows)  # [BM]
    row_ok = pairs < num_pairs  # [BM]
    tokens = tl.where(row_ok, pairs // top_k, 0).to(tl.int64)  # [BM]
    w_rows = (2 * tl.program_id(1) * BLOCK_N + tl.arange(0, 2 * BLOCK_N)).to(tl.int64)  # [2BN] interleaved
    w_ok = w_rows < 2 * inter  # [2BN]
    w_base = w_ptr + expert * (inter * hidden)  # 2I rows of H/2 bytes
    s_base = s_ptr + expert * (2 * inter * hidden // 32)
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        acc = _mx_step(x_ptr, tokens * stride_xt, row_ok, w_base, s_base, w_rows * (hidden // 2), w_ok, k0,
                       hidden, acc, UPCAST, BLOCK_K)  # [BM, 2BN]
    bias = tl.load(b_ptr + expert * 2 * inter + w_rows, mask=w_ok, other=0.0).to(tl.float32)  # [2BN]
    gate, up = tl.split(tl.reshape(acc + bias[None, :], (BLOCK_M, BLOCK_N, 2)))  # [BM, BN] each
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))  # [BM, BN]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    tl.store(act_ptr + rows[:, None] * stride_ar + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=(cols < inter)[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, b_ptr, y_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr,
                 num_pairs, stride_ar, stride_yp,
                 hidden: tl.constexpr, inter: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[pair, cols] = weight[pair] * (act[row] @ W2[e]^T + b2)[cols], fp32, for one expert's row block."""
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    pairs = tl.load(sorted_pairs_ptr + rows)  # [BM]
    row_ok = pairs < num_pairs  # [BM]
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BN] hidden columns
    col_ok = cols < hidden  # [BN]
    w_base = w_ptr + expert * (hidden * inter // 2)  # H rows of I/2 bytes
    s_base = s_ptr + expert * (hidden * inter // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        acc = _mx_step(act_ptr, rows * stride_ar, row_ok, w_base, s_base, cols * (inter // 2), col_ok, k0,
                       inter, acc, UPCAST, BLOCK_K)  # [BM, BN]
    bias = tl.load(b_ptr + expert * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BN]
    safe_pairs = tl.where(row_ok, pairs, 0).to(tl.int64)  # [BM]
    weight = tl.load(weights_ptr + safe_pairs, mask=row_ok, other=0.0)  # [BM] fp32
    tl.store(y_ptr + safe_pairs[:, None] * stride_yp + cols[None, :], (acc + bias[None, :]) * weight[:, None],
             mask=row_ok[:, None] & col_ok[None, :])


def _check_experts(x, topk_ids, topk_weights, gate_up, down) -> tuple[int, int, int]:
    """(E, H, I) after checking every argument's shape (ValueError naming the first that does not fit)."""
    (gu_blocks, gu_scales, gu_bias), (d_blocks, d_scales, d_bias) = gate_up, down
    two_inter, hidden = check_mxfp4(gu_blocks, gu_scales, "gate_up")
    out, inter = check_mxfp4(d_blocks, d_scales, "down")
    num_experts = gu_blocks.shape[0]
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}], got {tuple(x.shape)}")
    if two_inter != 2 * inter or out != hidden or gu_blocks.dim() != 4 or d_blocks.shape[0] != num_experts:
        raise ValueError(f"down must be [{num_experts}, {hidden}, {two_inter // 2}] for gate_up "
                         f"[{num_experts}, {two_inter}, {hidden}], got blocks {tuple(d_blocks.shape)}")
    if tuple(gu_bias.shape) != (num_experts, two_inter) or tuple(d_bias.shape) != (num_experts, hidden):
        raise ValueError(f"biases must be [{num_experts}, {two_inter}] and [{num_experts}, {hidden}], got "
                         f"{tuple(gu_bias.shape)} and {tuple(d_bias.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must be [{x.shape[0]}, k], got {tuple(topk_ids.shape)} and "
                         f"{tuple(topk_weights.shape)}")
    return num_experts, hidden, inter


def mxfp4_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  down: tuple[torch.Tensor, torch.Tensor, torch.Tensor], alpha: float, limit: float,
                  *, block_m: int | None = None) -> torch.Tensor:
    """GPT-OSS experts on MXFP4 weights: x [T, H], topk_ids [T, k] (ids in [0, E), not checked here),
    topk_weights [T, k], gate_up = (blocks, scales, bias), down = (blocks, scales, bias) as in the
    module docstring -> [T, H] in x's dtype: sum_j w[t, j] * expert_{ids[t, j]}(x[t])."""
    num_experts, hidden, inter = _check_experts(x, topk_ids, topk_weights, gate_up, down)
    (num_tokens, top_k), num_pairs = topk_ids.shape, topk_ids.numel()
    if num_pairs == 0:
        return torch.zeros_like(x)  # [T, H]
    block_m = block_m or default_block_m(num_pairs, num_experts)
    x = x.contiguous()  # [T, H]
    sorted_pairs, block_expert, _ = align_pairs_by_expert(topk_ids, num_experts, block_m)  # [NB*BM], [NB]
    upcast = not x.is_cuda  # interpreted: widen the dot operands
    act = torch.empty(sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)  # [NB*BM, I]
    block_n = _block(inter, 64)
    grid = (block_expert.numel(), triton.cdiv(inter, block_n))
    (gu_blocks, gu_scales, gu_bias), (d_blocks, d_scales, d_bias) = gate_up, down
    _gate_up_kernel[grid](x, gu_blocks.contiguous(), gu_scales.contiguous(), gu_bias.contiguous(), act,
                          sorted_pairs, block_expert, num_pairs, top_k, float(alpha), float(limit),
                          x.stride(0), act.stride(0), hidden=hidden, inter=inter, UPCAST=upcast,
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block(hidden, 128, 2 * DOT_MIN))
    weights = topk_weights.reshape(-1).float().contiguous()  # [P]
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    block_n = _block(hidden, 64)
    grid = (block_expert.numel(), triton.cdiv(hidden, block_n))
    _down_kernel[grid](act, d_blocks.contiguous(), d_scales.contiguous(), d_bias.contiguous(), y, sorted_pairs,
                       block_expert, weights, num_pairs, act.stride(0), y.stride(0), hidden=hidden, inter=inter,
                       UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block(inter, 128, 2 * DOT_MIN))
    return y.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)  # [T, H]
