"""y = x @ W^T for a GGUF block weight W [N, K] (qmatmul.py's `QuantWeight`), decoded in-kernel.

The weight stays in the file's blocks; each program decodes the tiles it multiplies
(`gguf_decode.decode`: a tile of BN weight rows by a slab of BK values, every value from its
block's bytes with bit operations, IQ4's 16 values and the grid rows from one small table tensor
per device) and never writes a dense weight. Two launches:

    M <= FEW_ROWS (decode, verification)   _gemv_kernel: BN rows per program, the whole K; for each
                                           slab, each activation row m: y[m] += sum_k W[n, k] x[m, k]
    M > FEW_ROWS (prefill)                 _mm_kernel: a BM x BN output tile; per slab tl.dot of
                                           x [BM, BK] and the decoded tile [BK, BN]

Numerics, the same in both launches: the decoded fp32 weight is rounded to x's dtype (bf16, fp16 or
fp32: a dot's operands in that dtype, as F.linear on the dequantized weight cast to x's dtype
multiplies), products and sums in fp32, the output rounded once to x's dtype. fp32 inputs take
IEEE fp32 dots (no TF32). In the GEMV launch a row's result is the same bits whatever the other
rows (each row is summed on its own); between the launches only the fp32 summation order differs.
Under the interpreter (no CUDA) dot operands are widened to fp32 and bf16 is rounded by bits
(`moe._dot`, `moe._round_to`); a GPU's compiler may fuse a decoder's q * A + B into one FMA.

Every type of `qdot.KINDS` has a decoder (`COVERED`). `gguf_dequantize` writes the decoded weight
(tests: the decoders against `gguf.quants.dequantize`). Nothing is allocated but the output; the
table is built on a device's first call (a warm-up, before any CUDA graph capture). K is a
compile-time constant: one compilation per (type, K, tile), a handful per model.
"""

from __future__ import annotations

import functools

import torch

from deepinfer.model_executor.layers.ops import iq_blocks, qdot
from deepinfer.model_executor.layers.ops.triton import PIP_HINT, interpreted, triton_available

if not triton_available():
    raise ImportError(f"the Triton GGUF kernels need triton: {PIP_HINT}")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from deepinfer.model_executor.layers.ops.triton.gguf_decode import decode  # noqa: E402
from deepinfer.model_executor.layers.ops.triton.moe import _dot, _round_to  # noqa: E402

COVERED = frozenset(qdot.KINDS)  # the ggml types the kernels decode
FEW_ROWS = 8  # up to this many activation rows: the GEMV launch
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Tiles. GEMV: BN = gemv_rows(N) rows by 256 values (one super-block, eight 32-value blocks), 4 warps.
# Prefill: BM = M's power of two up to 128, by 64 rows by 32 values, 8 warps. Both compile for sm_90
# without spills (80-128 registers for the mm tile, 40-60 for the GEMV one; ptxas -v).
GEMV_BK = 256
MM_BN, MM_BK = 64, 32


@functools.cache
def tables(device: torch.device) -> tuple[torch.Tensor, dict[str, int]]:
    """(uint8 table on `device`, {kind: byte offset of its grid}): IQ4's 16 int8 values at 0, then
    iq_blocks' grids row-major (IQ1_M reads IQ1_S's). Built once per device."""
    parts, offsets, at = [torch.tensor(qdot.IQ4_VALUES, dtype=torch.int8).view(torch.uint8)], {}, 16
    for name in iq_blocks.GRID_KINDS:
        rows = iq_blocks.grid(name).reshape(-1).view(torch.uint8)  # [entries * width]
        parts.append(rows)
        offsets[name], at = at, at + rows.numel()
    offsets["IQ1_M"] = offsets["IQ1_S"]
    return torch.cat(parts).to(device), offsets


@triton.jit
def _weight_tile(w_ptr, tab, row_off, row_ok, kk, k_ok, KIND: tl.constexpr, GRID: tl.constexpr,
                 QK: tl.constexpr, BB: tl.constexpr):
    """W[rows, kk] in fp32 [BN, BK]: row_off [BN] the rows' byte offsets, kk [BK] the columns."""
    b = w_ptr + row_off[:, None] + ((kk // QK) * BB)[None, :]  # [BN, BK] each value's block
    return decode(b, (kk % QK)[None, :], row_ok[:, None] & k_ok[None, :], tab, KIND, GRID)


@triton.jit
def _as_operand(w, DT: tl.constexpr, UPCAST: tl.constexpr):
    """The decoded fp32 tile rounded to DT: in DT, or (UPCAST, the interpreter) kept in fp32."""
    if UPCAST:
        return _round_to(w, DT)
    return w.to(DT)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, tab, y_ptr, M, N, stride_wn, stride_xm, stride_ym, K: tl.constexpr,
                 KIND: tl.constexpr, GRID: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr,
                 MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    """y[:M, rows] for BN weight rows; MB (a power of two >= M) activation rows at most."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN]
    row_ok = rows < N
    row_off = rows.to(tl.int64) * stride_wn  # [BN]
    ms = tl.arange(0, MB)  # [MB]
    acc = tl.zeros((MB, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)  # [BK]
        k_ok = kk < K
        w = _weight_tile(w_ptr, tab, row_off, row_ok, kk, k_ok, KIND, GRID, QK, BB)  # [BN, BK]
        w = _as_operand(w, x_ptr.dtype.element_ty, UPCAST).to(tl.float32)  # [BN, BK]
        for m in tl.static_range(MB):
            xm = tl.load(x_ptr + m * stride_xm + kk, mask=k_ok & (m < M), other=0.0).to(tl.float32)  # [BK]
            part = tl.sum(w * xm[None, :], axis=1)  # [BN]
            acc += tl.where(ms[:, None] == m, part[None, :], 0.0)  # [MB, BN]
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], _round_to(acc, out_ty).to(out_ty),
             mask=(ms < M)[:, None] & row_ok[None, :])


@triton.jit
def _mm_kernel(x_ptr, w_ptr, tab, y_ptr, M, N, stride_wn, stride_xm, stride_ym, K: tl.constexpr,
               KIND: tl.constexpr, GRID: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    """y[BM rows, BN columns]; program_id(0) walks M, so neighbouring programs share a weight tile."""
    ms = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)  # [BM]
    m_ok = ms < M
    rows = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    row_ok = rows < N
    row_off = rows.to(tl.int64) * stride_wn  # [BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)  # [BK]
        k_ok = kk < K
        x = tl.load(x_ptr + ms[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        w = _weight_tile(w_ptr, tab, row_off, row_ok, kk, k_ok, KIND, GRID, QK, BB)  # [BN, BK]
        acc = _dot(x, tl.trans(_as_operand(w, x_ptr.dtype.element_ty, UPCAST)), acc, UPCAST)  # [BM, BN]
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], _round_to(acc, out_ty).to(out_ty),
             mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _dequant_kernel(w_ptr, tab, y_ptr, N, K, stride_wn, KIND: tl.constexpr, GRID: tl.constexpr,
                    QK: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN]
    kk = tl.program_id(1) * BK + tl.arange(0, BK)  # [BK]
    row_ok, k_ok = rows < N, kk < K
    w = _weight_tile(w_ptr, tab, rows.to(tl.int64) * stride_wn, row_ok, kk, k_ok, KIND, GRID, QK, BB)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :], w, mask=row_ok[:, None] & k_ok[None, :])


def _kind_args(w: qdot.BlockWeight, device: torch.device) -> tuple[torch.Tensor, dict]:
    """(the table tensor, the constexprs naming w's type) after checking w's bytes and type."""
    name = qdot.ALIASES.get(w.kind, w.kind)
    if name not in COVERED:
        raise ValueError(f"gguf_matmul: no Triton decoder for weight kind {w.kind!r}")
    kind = qdot.check_weight(w)
    if device.type != "cuda" and not interpreted():
        raise ValueError(f"gguf_matmul: tensors on {device} run only under the Triton interpreter (TRITON_INTERPRET=1)")
    if w.data.device != device:
        raise ValueError(f"gguf_matmul: the weight is on {w.data.device}, the activations on {device}")
    if w.data.stride(1) != 1:
        raise ValueError(f"gguf_matmul: weight rows must be contiguous bytes, got strides {w.data.stride()}")
    table, offsets = tables(device)
    return table, {"KIND": kind.ggml_id, "GRID": offsets.get(name, 0), "QK": kind.block_values,
                   "BB": kind.block_bytes}


def gemv_rows(n: int) -> int:
    """Weight rows per GEMV program: fewer for narrow weights, so that their launch still fills a GPU."""
    return 4 if n < 2048 else 8


def gguf_matmul(x: torch.Tensor, w: qdot.BlockWeight) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or fp32) @ W^T -> [M, N] in x's dtype, W a block weight of a COVERED
    type on x's device (ValueError naming what does not fit otherwise)."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"gguf_matmul: x must be a 2-D fp16, bf16 or fp32 tensor, got {x.dtype} {tuple(x.shape)}")
    table, kind = _kind_args(w, x.device)
    (m, k), n = x.shape, w.shape[0]
    if k != w.shape[1]:
        raise ValueError(f"gguf_matmul: x has K={k}, the {w.kind} weight K={w.shape[1]}")
    if k == 0:
        return x.new_zeros(m, n)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return y
    args = (x, w.data, table, y, m, n, w.data.stride(0), x.stride(0), y.stride(0), k)
    upcast = interpreted()  # the interpreter: dot operands widened, bf16 rounded by bits
    if m <= FEW_ROWS:
        bn = gemv_rows(n)
        _gemv_kernel[(triton.cdiv(n, bn),)](*args, **kind, MB=triton.next_power_of_2(m), BN=bn, BK=GEMV_BK,
                                            UPCAST=upcast)
    else:
        bm = min(128, triton.next_power_of_2(m))
        _mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, MM_BN))](*args, **kind, BM=bm, BN=MM_BN, BK=MM_BK,
                                                                 UPCAST=upcast, num_warps=8)
    return y


def gguf_dequantize(w: qdot.BlockWeight) -> torch.Tensor:
    """The weight decoded by the kernels' decoders: fp32 [N, K] on its device."""
    table, kind = _kind_args(w, w.data.device)
    n, k = w.shape
    y = torch.empty(n, k, dtype=torch.float32, device=w.data.device)  # [N, K]
    if n and k:
        _dequant_kernel[(triton.cdiv(n, 16), triton.cdiv(k, 256))](w.data, table, y, n, k, w.data.stride(0), **kind,
                                                                   BN=16, BK=256)
    return y
