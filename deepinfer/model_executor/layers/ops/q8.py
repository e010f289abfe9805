"""q8 rows (`--kv-cache-dtype int8`): int8 values with one fp32 scale per 32 values, symmetric.

Row layout: blocks of 32 values in row order, each the fp32 scale then the 32 int8 values:

    [ s0 (4 B) | q0 .. q31 | s1 | q32 .. q63 | ... ]      E / 32 * 36 bytes (a 128-value head: 144)

Per block with absolute maximum a: scale = a / 127, q = round-half-even(x * (127 / a)) in -127 .. 127
(all 0 when a = 0); the value read back is q * scale, one fp32 product. |x - q * scale| <= a / 254
(half a step) up to the rounding of the fp32 operations. A head of D values (D a multiple of 32)
is D / 32 whole blocks, so a kernel finds a head's blocks from its first one.

These are the torch reference of the C++ store (`fused_cpu.cpp` quantize_q8) and of the C++
attention's reads (`invariant_cpu.cpp` Q8Block): the same operations, the same bits.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
BLOCK_BYTES = 4 + BLOCK  # fp32 scale + 32 int8 values


def q8_row_bytes(num_elements: int) -> int:
    """Bytes of a q8 row of `num_elements` values; ValueError unless a multiple of 32."""
    if num_elements % BLOCK:
        raise ValueError(f"an int8 (q8) row needs a multiple of {BLOCK} elements, got {num_elements}")
    return num_elements // BLOCK * BLOCK_BYTES


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """x [N, E] (any float dtype) -> rows [N, E / 32 * 36] uint8."""
    q8_row_bytes(x.shape[-1])
    blocks = x.float().unflatten(-1, (-1, BLOCK))  # [N, E/32, 32]
    amax = blocks.abs().amax(-1, keepdim=True)  # [N, E/32, 1]
    # element-wise fp32 divisions, as the C++ store computes them (torch turns `127 / t` into a
    # reciprocal and a product, and `t / 127` may become a product by 1/127: other bits)
    full = torch.full_like(amax, 127.0)  # [N, E/32, 1]
    scale = amax / full  # [N, E/32, 1]
    inv = torch.where(amax > 0, full / amax, torch.zeros_like(amax))  # [N, E/32, 1]
    q = torch.round(blocks * inv).clamp(-127, 127).to(torch.int8)  # [N, E/32, 32]
    return torch.cat((scale.view(torch.uint8), q.view(torch.uint8)), dim=-1).flatten(-2)  # [N, E/32 * 36]


def dequantize_q8(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [..., E / 32 * 36] uint8 -> [..., E] in dtype."""
    blocks = rows.contiguous().unflatten(-1, (-1, BLOCK_BYTES))  # [..., E/32, 36]
    scale = blocks[..., :4].contiguous().view(torch.float32)  # [..., E/32, 1]
    values = blocks[..., 4:].contiguous().view(torch.int8).float()  # [..., E/32, 32]
    return (values * scale).flatten(-2).to(dtype)  # [..., E]
