"""The grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and the ternary types
(TQ1_0, TQ2_0), read in plain torch: each block's values as signed integers and its unit scales,
so that value * scale is `gguf.quants.dequantize`'s float bit for bit (qdot.py's unit model).

All are 256-value blocks. A group of 8 (IQ3: 4) values is one row of a grid (the gguf package's
tables), its signs from a sign byte (or a 7-bit index into `ksigns`, whose 8th bit is parity):

    IQ2_XXS  A = d (0.5 + ls) / 4 per 32     value = grid2xxs[i] * sign        8, 25, 43
    IQ2_XS   A = d (0.5 + ls) / 4 per 16     9-bit index                       as IQ2_XXS
    IQ2_S    A = d (0.5 + ls) / 4 per 16     10-bit index, a sign byte         as IQ2_XXS
    IQ3_XXS  A = d (0.5 + ls) / 2 per 32     grid3xxs[i] (4 values) * sign     4 .. 62
    IQ3_S    A = d (1 + 2 ls) per 32         9-bit index, a sign byte          1 .. 15
    IQ1_S    A = d (2 ls + 1) / 8 per 32     8 grid1[i] +- 1 (the delta sign)  -9 .. 9
    IQ1_M    A = d (2 ls + 1) / 8 per 16     as IQ1_S, d spread over 4 nibbles
    TQ1_0    A = d per 32                    base-3 digits - 1                 -1 .. 1
    TQ2_0    A = d per 32                    2-bit codes - 1                   -1 .. 2

(IQ1's delta of 1/8: value (g +- 1/8) dl = (8 g +- 1) (dl / 8), the same real product, so the
same fp32 rounding.) `grid_tables()` hands the kernels the same tables as bytes. The decoders run
on the blocks' device: their tables and constants are built there once (`grid`, `ksigns`, `constant`).
"""

from __future__ import annotations

import functools

import gguf.quants as gq
import numpy as np
import torch

GRID_KINDS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S")  # table order in grid_tables()
_GGUF = {"IQ2_XXS": gq.IQ2_XXS, "IQ2_XS": gq.IQ2_XS, "IQ2_S": gq.IQ2_S, "IQ3_XXS": gq.IQ3_XXS, "IQ3_S": gq.IQ3_S,
         "IQ1_S": gq.IQ1_S, "IQ1_M": gq.IQ1_S}  # IQ1_M reads IQ1_S's grid


CPU = torch.device("cpu")


@functools.cache
def grid(name: str, device: torch.device = CPU) -> torch.Tensor:
    """The gguf package's grid for kind `name` (IQ1_M shares IQ1_S's): int8 [entries, 8 or 4] on `device`."""
    if device != CPU:
        return grid(name).to(device)
    cls = _GGUF[name]
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).astype(np.int8))


@functools.cache
def ksigns(device: torch.device = CPU) -> torch.Tensor:
    """uint8 [128] on `device`: 7 sign bits -> the 8 with even parity."""
    if device != CPU:
        return ksigns().to(device)
    return torch.frombuffer(bytearray(gq.IQ2_XXS.ksigns), dtype=torch.uint8)


@functools.cache
def constant(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant of the decoders (shifts, powers), built once per device."""
    return torch.tensor(values, dtype=dtype, device=device)


def shifts(step: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[0, step, 2 step, ..] (count values) on `device`."""
    return constant(tuple(range(0, step * count, step)), dtype, device)


def grid_tables() -> torch.Tensor:
    """uint8: the GRID_KINDS' grids in order, each row-major as int8 bytes, then ksigns (the
    kernel library's copy; its layout is checked there)."""
    parts = [grid(name).reshape(-1).view(torch.uint8) for name in GRID_KINDS]
    return torch.cat([*parts, ksigns()])


@functools.cache
def hand_over_tables() -> None:
    """The kernel library's copy of grid_tables() (once per process; before its first grid-kind call)."""
    torch.ops.deepinfer_cpu.iq_tables.default(grid_tables())


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0].float()


def _words(blocks: torch.Tensor, start: int, count: int, size: int) -> torch.Tensor:
    """count little-endian unsigned words of `size` bytes (2 or 4) from byte `start`, as int64
    [..., count] (assembled from the bytes: a view would need the offset aligned)."""
    b = blocks[..., start:start + size * count].to(torch.int64).reshape(*blocks.shape[:-1], count, size)
    return sum(b[..., i] << (8 * i) for i in range(size))


def _sign_bits(byte: torch.Tensor) -> torch.Tensor:
    """Sign bytes [...] -> +1 / -1 int16 [..., 8] (bit j set: value j negative)."""
    bits = (byte.to(torch.int32)[..., None] >> shifts(1, 8, torch.int32, byte.device)) & 1
    return (1 - 2 * bits).to(torch.int16)


def _signed_grid(name: str, index: torch.Tensor, sign_bytes: torch.Tensor) -> torch.Tensor:
    """Grid rows at `index` [..., G] times the signs of `sign_bytes` [..., G * width / 8]."""
    rows = grid(name, index.device)[index.long()].to(torch.int16)  # [..., G, width]
    signs = _sign_bits(sign_bytes).reshape(*rows.shape)  # [..., G, width]
    return rows * signs


def _iq2_scales(d: torch.Tensor, ls: torch.Tensor, quarter: bool = True) -> torch.Tensor:
    """d (0.5 + ls) / 4 (IQ2) or / 2 (IQ3_XXS), in gguf's order of fp32 operations."""
    return d[..., None] * (ls.float() + 0.5) * (0.25 if quarter else 0.5)


def _nibble_scales(s: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> their low and high nibbles in turn [..., 2n]."""
    return torch.stack([s & 0xF, s >> 4], dim=-1).reshape(*s.shape[:-1], -1)


def _iq2_xxs(blocks):
    lead = blocks.shape[:-1]
    words = _words(blocks, 2, 16, 4).reshape(*lead, 8, 2)  # per 32 values: 4 grid indices, then signs | ls
    index = words[..., 0:1] >> shifts(8, 4, torch.int64, blocks.device) & 0xFF  # [N, nb, 8, 4]
    signs = ksigns(blocks.device)[(words[..., 1:2] >> shifts(7, 4, torch.int64, blocks.device) & 0x7F)]  # [N, nb, 8, 4]
    values = _signed_grid("IQ2_XXS", index, signs)  # [N, nb, 8, 4, 8]
    return values.reshape(*lead, 256), _iq2_scales(_f16(blocks, 0), words[..., 1] >> 28), None


def _iq2_xs(blocks):
    lead = blocks.shape[:-1]
    qs = _words(blocks, 2, 32, 2)  # [N, nb, 32]: 9-bit index | 7-bit signs
    values = _signed_grid("IQ2_XS", qs & 511, ksigns(blocks.device)[qs >> 9])
    return values.reshape(*lead, 256), _iq2_scales(_f16(blocks, 0), _nibble_scales(blocks[..., 66:74])), None


def _iq2_s(blocks):
    lead = blocks.shape[:-1]
    qh = blocks[..., 66:74].to(torch.int32)  # 2 high index bits per group, 4 groups per byte
    high = (qh[..., None] >> shifts(2, 4, torch.int32, qh.device) & 3).reshape(*lead, 32)
    index = blocks[..., 2:34].to(torch.int32) | (high << 8)  # [N, nb, 32]
    values = _signed_grid("IQ2_S", index, blocks[..., 34:66])
    return values.reshape(*lead, 256), _iq2_scales(_f16(blocks, 0), _nibble_scales(blocks[..., 74:82])), None


def _iq3_xxs(blocks):
    lead = blocks.shape[:-1]
    aux = _words(blocks, 66, 8, 4)  # [N, nb, 8]: per 32 values, 4 x 7 sign bits | ls
    signs = ksigns(blocks.device)[(aux[..., None] >> shifts(7, 4, torch.int64, aux.device) & 0x7F)]  # [N, nb, 8, 4]
    values = _signed_grid("IQ3_XXS", blocks[..., 2:66].reshape(*lead, 8, 8), signs)  # [N, nb, 8, 8, 4]
    return values.reshape(*lead, 256), _iq2_scales(_f16(blocks, 0), aux >> 28, quarter=False), None


def _iq3_s(blocks):
    lead = blocks.shape[:-1]
    qh = blocks[..., 66:74].to(torch.int32)  # the ninth index bit of each group of 4, 8 groups per byte
    high = (qh[..., None] >> shifts(1, 8, torch.int32, qh.device) & 1).reshape(*lead, 64)
    index = blocks[..., 2:66].to(torch.int32) | (high << 8)  # [N, nb, 64]
    values = _signed_grid("IQ3_S", index, blocks[..., 74:106])
    ls = _nibble_scales(blocks[..., 106:110]).to(torch.int32)  # [N, nb, 8]
    return values.reshape(*lead, 256), _f16(blocks, 0)[..., None] * (1 + 2 * ls).float(), None


def _iq1_values(index: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """8 grid + 1, or - 1 where `minus`: grid rows at index [..., G] -> int16 [..., G, 8]."""
    rows = grid("IQ1_S", index.device)[index.long()].to(torch.int16) * 8
    return rows + (1 - 2 * minus.to(torch.int16))[..., None]


def _iq1_s(blocks):
    lead = blocks.shape[:-1]
    qh = _words(blocks, 34, 8, 2)  # [N, nb, 8]: per 32 values 4 x 3 high index bits, ls, delta sign
    high = (qh[..., None] >> shifts(3, 4, torch.int32, qh.device) & 7).reshape(*lead, 32)
    index = blocks[..., 2:34].to(torch.int32) | (high << 8)
    minus = ((qh >> 15) & 1).repeat_interleave(4, dim=-1)  # [N, nb, 32]
    dl = _f16(blocks, 0)[..., None] * (2 * ((qh >> 12) & 7) + 1).float()
    return _iq1_values(index, minus).reshape(*lead, 256), dl * 0.125, None


def _iq1_m(blocks):
    lead = blocks.shape[:-1]
    sc = _words(blocks, 48, 4, 2)  # [N, nb, 4]: 4 x 3-bit scales each, and a nibble of d on top
    d_bits = (sc[..., 0] >> 12) | ((sc[..., 1] >> 8) & 0xF0) | ((sc[..., 2] >> 4) & 0xF00) | (sc[..., 3] & 0xF000)
    d = d_bits.to(torch.int16).view(torch.float16).float()  # [N, nb]
    ls = (sc[..., None] >> shifts(3, 4, torch.int32, sc.device) & 7).reshape(*lead, 16)
    qh = _nibble_scales(blocks[..., 32:48]).to(torch.int32)  # [N, nb, 32]: 3 high bits | delta sign
    index = blocks[..., 0:32].to(torch.int32) | ((qh & 7) << 8)
    dl = d[..., None] * (2 * ls + 1).float()
    return _iq1_values(index, (qh >> 3) & 1).reshape(*lead, 256), dl * 0.125, None


def _ternary_digits(qs: torch.Tensor, powers: list[int]) -> torch.Tensor:
    """Bytes [..., L] of base-3 digits -> digits [..., len(powers) * L] (digit j of all bytes in turn)."""
    scaled = (qs[..., None, :].to(torch.int32) * constant(tuple(powers), torch.int32, qs.device)[:, None]) & 0xFF
    return ((scaled * 3) >> 8).reshape(*qs.shape[:-1], -1)


def _tq1_0(blocks):
    powers = [1, 3, 9, 27, 81]
    digits = torch.cat([_ternary_digits(blocks[..., 0:32], powers), _ternary_digits(blocks[..., 32:48], powers),
                        _ternary_digits(blocks[..., 48:52], powers[:4])], dim=-1)  # [N, nb, 256]
    return (digits - 1).to(torch.int16), _f16(blocks, 52)[..., None].expand(*blocks.shape[:-1], 8), None


def _tq2_0(blocks):
    lead = blocks.shape[:-1]
    qs = blocks[..., 0:64].reshape(*lead, 2, 1, 32).to(torch.int16)
    codes = (qs >> shifts(2, 4, torch.int16, qs.device)[:, None] & 3).reshape(*lead, 256)
    return codes - 1, _f16(blocks, 64)[..., None].expand(*lead, 8), None


DECODERS = {"IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s, "IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s,
            "IQ1_S": _iq1_s, "IQ1_M": _iq1_m, "TQ1_0": _tq1_0, "TQ2_0": _tq2_0}
