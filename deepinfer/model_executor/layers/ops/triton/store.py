"""Store one step's K/V rows into a token-group cache, as one Triton kernel.

The rows land where `LayerCache.store` puts them (worker/cache_engine.py): flat slot s of layer l
is line `cache_line(s, R, lines_per_unit, layer_offset)` of the group's line-per-row allocation.
A row holds K | V of all KV heads (or one shared K = V part):

    plain row   [ k(h0) .. k(hH-1) | v(h0) .. v(hH-1) ]        E elements of the row dtype
    MXFP8 row   [ e4m3 x0 .. x(E-1) | ue8m0 s0 .. s(E/32-1) ]  E + E/32 bytes (ops/mxfp8.py)

MXFP8 rows are quantized in the kernel with integer arithmetic only, so GPU and interpreter give
the same bytes as `quantize_mxfp8`:

- the block exponent e = ceil(log2(amax / 448)) is read off amax's fp32 bits: amax = M * 2^E with
  M in [1, 2) needs e = E - 8, or E - 7 when M > 1.75 (448 = 1.75 * 2^8); 0 -> -127, inf -> 127,
  NaN -> 0, clamped to [-127, 127] as the reference does. (The reference computes the same value
  through a float log2, which can round to an integer within one ulp above a power of two; there
  alone the two may differ, by one scale step.)
- x * 2^-e is rounded to e4m3 (round to nearest even, >= 480 -> NaN, no saturation) by the bit
  recipe torch's own fp32 -> float8_e4m3fn conversion uses.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.ops.triton import PIP_HINT, triton_available

if not triton_available():
    raise ImportError(f"the Triton store kernel needs triton: {PIP_HINT}")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MX_BLOCK = 32  # values per UE8M0 scale byte
GROUPS_PER_PROGRAM = 8  # at most this many scale groups (of 32 values) of one row per program
TILE = 1024  # elements per program: several rows when rows are short


@triton.jit
def _load_flat(k_ptr, v_ptr, m, e, E_HALF: tl.constexpr, D: tl.constexpr, SHARED: tl.constexpr,
               skm, skh, skd, svm, svh, svd, mask):
    """Elements e of rows m (broadcast together) of the flattened K | V (or of the shared K) -> fp32."""
    part = e // E_HALF
    within = e % E_HALF
    h = within // D
    d = within % D
    x = tl.load(k_ptr + m * skm + h * skh + d * skd, mask=mask & (part == 0), other=0.0).to(tl.float32)
    if not SHARED:
        xv = tl.load(v_ptr + m * svm + h * svh + d * svd, mask=mask & (part == 1), other=0.0).to(tl.float32)
        x = tl.where(part == 0, x, xv)
    return x


@triton.jit
def _slot_of(slots_ptr, m, M):
    """Flat slots of rows m; -1 (write nothing) for rows past M and where the caller gave -1."""
    return tl.load(slots_ptr + m, mask=m < M, other=-1).to(tl.int64)


@triton.jit
def _line_of(slot, R, LPU, LAYER_OFFSET):
    """Cache lines of flat slots (ops/addressing.cache_line); a negative slot is read as slot 0,
    so the caller must mask it out of the store."""
    safe = tl.maximum(slot, 0)
    return safe + safe // R * (LPU - R) + LAYER_OFFSET


@triton.jit
def _to_bf16_bits(x):
    """fp32 [...] -> bf16 bit patterns [...] int16, rounded to nearest even (NaN -> 0x7FC0) as
    torch rounds; written out because the interpreter's own cast truncates."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _store_plain_kernel(rows_ptr, slots_ptr, k_ptr, v_ptr, M, R, LPU, LAYER_OFFSET,
                        skm, skh, skd, svm, svh, svd,
                        E: tl.constexpr, E_HALF: tl.constexpr, D: tl.constexpr, SHARED: tl.constexpr,
                        BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Program (a, b): elements b*BLOCK .. of rows a*BLOCK_M .., cast to the row dtype (BF16:
    rows_ptr is the bf16 rows seen as int16)."""
    m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]  # [BM, 1]
    e = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]  # [1, B]
    slot = _slot_of(slots_ptr, m, M)  # [BM, 1]
    mask = (slot >= 0) & (e < E)  # [BM, B]; slot -1: a padding row, not written
    x = _load_flat(k_ptr, v_ptr, m, e, E_HALF, D, SHARED, skm, skh, skd, svm, svh, svd, mask)  # [BM, B]
    line = _line_of(slot, R, LPU, LAYER_OFFSET)  # [BM, 1]
    if BF16:
        tl.store(rows_ptr + line * E + e, _to_bf16_bits(x), mask=mask)
    else:
        tl.store(rows_ptr + line * E + e, x.to(rows_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _block_exponent(amax):
    """ceil(log2(amax / 448)) for amax >= 0 from its fp32 bits, clamped to [-127, 127]."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    e = biased - 127 - 8 + (mant > 0x600000).to(tl.int32)
    e = tl.where(biased == 0, -127, e)  # zero or subnormal: far below 448 * 2^-127
    e = tl.where(biased == 255, tl.where(mant == 0, 127, 0), e)  # inf -> 127, NaN -> 0
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _to_e4m3_bits(x):
    """fp32 [...] -> e4m3fn bit patterns [...] int32 (RNE; |x| >= 480 or NaN -> 0x7F | sign)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # subnormal e4m3 (|x| < 2^-6): adding 2^14 rounds to the 2^-9 grid; its low bits are the code
    sub = ((mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)) & 0xFF
    clipped = tl.minimum(mag, 1087 << 20)  # no int32 overflow for inf / NaN (replaced below)
    odd = (clipped >> 20) & 1
    normal = ((clipped + ((7 - 127) << 23) + 0x7FFFF + odd) >> 20) & 0xFF
    code = tl.where(mag < (121 << 23), sub, normal)
    code = tl.where(mag >= (1087 << 20), 0x7F, code)
    return code | sign


@triton.jit
def _store_mxfp8_kernel(rows_ptr, slots_ptr, k_ptr, v_ptr, M, R, LPU, LAYER_OFFSET,
                        skm, skh, skd, svm, svh, svd,
                        E: tl.constexpr, E_HALF: tl.constexpr, D: tl.constexpr, SHARED: tl.constexpr,
                        BLOCK_M: tl.constexpr, GROUPS: tl.constexpr):
    """Program (a, b): scale groups b*GROUPS .. of rows a*BLOCK_M .. -> e4m3 bytes and UE8M0
    scale bytes. Tile row i is (row a*BLOCK_M + i // GROUPS, group b*GROUPS + i % GROUPS)."""
    i = tl.arange(0, BLOCK_M * GROUPS)
    m = tl.program_id(0) * BLOCK_M + i // GROUPS  # [BM*G]
    g = tl.program_id(1) * GROUPS + i % GROUPS  # [BM*G]
    e = g[:, None] * 32 + tl.arange(0, 32)[None, :]  # [BM*G, 32]
    slot = _slot_of(slots_ptr, m, M)  # [BM*G]
    ok = (slot >= 0) & (g < E // 32)  # [BM*G]; slot -1: a padding row, not written
    mask = ok[:, None] & (e < E)  # [BM*G, 32]
    x = _load_flat(k_ptr, v_ptr, m[:, None], e, E_HALF, D, SHARED, skm, skh, skd, svm, svh, svd, mask)
    exp = _block_exponent(tl.max(tl.abs(x), axis=1))  # [BM*G]
    scale = ((127 - exp) << 23).to(tl.float32, bitcast=True)  # [BM*G] 2^-e, exact
    codes = _to_e4m3_bits(x * scale[:, None])  # [BM*G, 32]
    base = rows_ptr + _line_of(slot, R, LPU, LAYER_OFFSET) * (E + E // 32)  # [BM*G]
    tl.store(base[:, None] + e, codes.to(tl.uint8), mask=mask)
    tl.store(base + E + g, (exp + 127).to(tl.uint8), mask=ok)


def store_rows(rows2d: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               rows_per_unit: int, lines_per_unit: int, layer_offset: int, fp8: bool) -> None:
    """Write k, v [M, H_kv, D] (v None: one shared K = V part) as the rows of flat slots [M];
    a row whose slot is -1 is not written (the padding rows of a CUDA-graph decode batch).

    rows2d: the group's allocation, one row per line: [lines, E] of the row dtype for plain rows,
    [lines, E + E/32] uint8 for MXFP8 rows (E = parts * H_kv * D)."""
    num_rows, num_kv_heads, head_dim = k.shape
    shared = v is None
    e_half = num_kv_heads * head_dim
    e = e_half if shared else 2 * e_half
    if num_rows == 0:
        return
    v = k if shared else v
    bf16 = rows2d.dtype == torch.bfloat16
    rows2d = rows2d.view(torch.int16) if bf16 else rows2d  # bf16 rows are written as rounded bits
    args = (rows2d, slots, k, v, num_rows, rows_per_unit, lines_per_unit, layer_offset, *k.stride(), *v.stride())
    if fp8:
        if e % MX_BLOCK:
            raise ValueError(f"an MXFP8 row needs a multiple of {MX_BLOCK} elements, got {e}")
        groups = min(GROUPS_PER_PROGRAM, triton.next_power_of_2(e // MX_BLOCK))
        block_m = max(1, TILE // (groups * MX_BLOCK))
        grid = (triton.cdiv(num_rows, block_m), triton.cdiv(e // MX_BLOCK, groups))
        _store_mxfp8_kernel[grid](*args, E=e, E_HALF=e_half, D=head_dim, SHARED=shared, BLOCK_M=block_m, GROUPS=groups)
    else:
        block = min(TILE, triton.next_power_of_2(e))
        block_m = TILE // block
        grid = (triton.cdiv(num_rows, block_m), triton.cdiv(e, block))
        _store_plain_kernel[grid](*args, E=e, E_HALF=e_half, D=head_dim, SHARED=shared, BF16=bf16,
                                  BLOCK_M=block_m, BLOCK=block)


def store_layer_rows(cache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
    """`LayerCache.store` through the kernel: k, v [M, H_kv, D] at flat slots [M] of this layer.
    A shared-row cache (codec.shared_kv) stores k alone."""
    codec = cache.codec
    store_rows(cache.rows2d, slots, k, None if codec.shared_kv else v, cache.rows_per_unit,
               cache.lines_per_unit, cache.layer_offset, codec.fp8)
