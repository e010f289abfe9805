"""MXFP8 rows: e4m3 values with one UE8M0 (power-of-two) scale byte per 32 values.

Row layout (token-interleaved: a token's scales travel with its values, KVCacheFormat):

    [ e4m3 x0 .. x(E-1) | ue8m0 s0 .. s(E/32-1) ]      E + E/32 bytes (512 -> 528)

Scale choice: for a block of 32 values with absolute maximum a, the scale is the smallest power
of two 2^e with a / 2^e <= 448 (e4m3's largest finite value), i.e. e = ceil(log2(a / 448)).
Rounding the scale up keeps every value in range (no saturation); the price is at most one bit
of precision against an exact scale. The byte is e + 127 (UE8M0: exponent only, bias 127).
Dequantized values differ from the input by at most half an e4m3 step at that scale:
|x - q(x)| <= 2^(floor(log2|x|) - 4) for normal values, and <= 2^(e - 10) in the subnormal range.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
BLOCK = 32
_BIAS = 127


def mxfp8_row_bytes(num_elements: int) -> int:
    if num_elements % BLOCK:
        raise ValueError(f"an MXFP8 row needs a multiple of {BLOCK} elements, got {num_elements}")
    return num_elements + num_elements // BLOCK


def block_exponents(x: torch.Tensor) -> torch.Tensor:
    """x [N, E] -> e [N, E/32] int32: the power of two each 32-value block is scaled by."""
    amax = x.float().abs().unflatten(-1, (-1, BLOCK)).amax(-1)  # [N, E/32]
    e = torch.ceil(torch.log2(amax / E4M3_MAX))  # -inf for an all-zero block
    return e.nan_to_num(0.0, neginf=-_BIAS, posinf=127).clamp(-_BIAS, 127).to(torch.int32)  # [N, E/32]


def quantize_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """x [N, E] (any float dtype) -> rows [N, E + E/32] uint8."""
    n, num = x.shape
    mxfp8_row_bytes(num)
    e = block_exponents(x)  # [N, E/32]
    scaled = x.float().unflatten(-1, (-1, BLOCK)) * torch.exp2(-e.float()).unsqueeze(-1)  # [N, E/32, 32]
    values = scaled.flatten(-2).to(torch.float8_e4m3fn).view(torch.uint8)  # [N, E]
    scales = (e + _BIAS).to(torch.uint8)  # [N, E/32]
    return torch.cat((values, scales), dim=-1)  # [N, E + E/32]


def dequantize_mxfp8(rows: torch.Tensor, num_elements: int, dtype: torch.dtype) -> torch.Tensor:
    """rows [..., E + E/32] uint8 -> [..., E] in dtype."""
    values = rows[..., :num_elements].contiguous().view(torch.float8_e4m3fn).float()  # [..., E]
    e = rows[..., num_elements:].to(torch.int32) - _BIAS  # [..., E/32]
    scale = torch.exp2(e.float()).repeat_interleave(BLOCK, dim=-1)  # [..., E]
    return (values * scale).to(dtype)  # [..., E]
