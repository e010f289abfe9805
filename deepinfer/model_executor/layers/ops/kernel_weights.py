"""Weights checked once per load for the CPU kernels, in the kernels' tile layout where one exists.

`qdot.qlinear` checks its weight on every call (kind, shape, device, contiguity): a few microseconds,
per layer and step. A layer that calls once per step (`quant_linear.QuantLinear`, a tied head) checks
its parts once instead (`kernel_weight` -> `KernelWeight`) and calls `qlinear_checked`: the calls
`qmatmul` makes, the same bits. Q4_K, Q5_K and Q6_K parts are then copied into the tile layout
(`TILED_KINDS`, qdot_cpu.cpp's `pack_tiles`): the same bytes, the R rows of a tile interleaved so
that the one-row kernel reads them with plain loads rather than loads and transposes. The same bits;
the copy is anonymous memory, and the file's pages under it are handed back (`release_pages`) unless
the layer still reads them (an embedding's rows). DEEPINFER_QDOT_TILES=0 keeps the file's layout
alone.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import NamedTuple

import torch

from deepinfer.model_executor.layers.ops import iq_blocks
from deepinfer.model_executor.layers.ops.cpu_kernels import qdot_level
from deepinfer.model_executor.layers.ops.few_rows import few_row_level
from deepinfer.model_executor.layers.ops.qdot import _GRID_IDS, BlockWeight, _resolve, check_weight


class KernelWeight(NamedTuple):
    """A CPU weight checked once (`kernel_weight`): what each `qlinear_checked` call hands the kernel."""

    data: torch.Tensor  # uint8 [N, bytes per row], or the tile layout: [N rounded up to R, bytes per row]
    ggml_id: int
    k: int
    rows: int = -1  # N when `data` is the tile layout, else -1


TILED_KINDS = frozenset({"Q4_K", "Q5_K", "Q6_K"})  # kinds with a tile layout (qdot_cpu.cpp's pack_tiles)
_LANES = {2: 8, 3: 8, 4: 16}  # weight rows per tile of each SIMD variant


def tile_level() -> int:
    """The variant whose tile layout checked weights take, 0 for none: this process's variant when
    its few-row calls run one with the same lanes (the layout is per lane count), unless
    DEEPINFER_QDOT_TILES=0."""
    level = qdot_level()
    if os.environ.get("DEEPINFER_QDOT_TILES", "1").strip() == "0" or level not in _LANES:
        return 0
    return level if _LANES[few_row_level(level)] == _LANES[level] else 0


def kernel_weight(w: BlockWeight, release: bool = True) -> KernelWeight | None:
    """w checked as `qlinear` checks it on every call, or None where the kernels cannot take it
    (no library, or not on the CPU): a layer that calls once per step checks once per load. A
    TILED_KINDS weight is copied into the tile layout when `tile_level()` has one; with `release`
    (the caller reads w's own bytes no more) its pages then leave the resident set (`release_pages`)."""
    if not w.data.is_cpu or not qdot_level():
        return None
    kind = check_weight(w)
    if kind.ggml_id in _GRID_IDS:
        iq_blocks.hand_over_tables()
    level = tile_level()
    if level and w.kind in TILED_KINDS and w.data.is_contiguous():
        tiles = torch.ops.deepinfer_cpu.pack_tiles.default(w.data, kind.ggml_id, level)  # [N up to R, bytes]
        if release:
            release_pages(w.data)
        return KernelWeight(tiles, kind.ggml_id, w.shape[1], w.shape[0])
    return KernelWeight(w.data, kind.ggml_id, w.shape[1])


_MADV_PAGEOUT = 21  # Linux 5.4+


@functools.cache
def _libc() -> ctypes.CDLL | None:
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def release_pages(t: torch.Tensor) -> None:
    """Hands the pages under t's bytes back to the OS (madvise MADV_PAGEOUT; nothing where the OS has
    no such call). Pages of a mapped file leave this process's resident set, and are read from the
    file again if touched; anonymous pages are swapped out, or stay where there is no swap. No byte
    ever changes: a hint about residency, safe on any memory (a page shared with a neighbour too)."""
    libc = _libc()
    if libc is None or t.numel() == 0:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_PAGEOUT)  # an error: left resident


def qlinear_checked(x: torch.Tensor, parts: tuple[KernelWeight, ...], levels: int) -> torch.Tensor:
    """qlinear for fp32 x [M, K] on the CPU and checked weights (the parts of a merged one, stacked
    on the output axis): the calls `qmatmul` makes, the same bits, without the per-call checks (a few
    microseconds each, per layer and step). Several parts share one activation quantization."""
    level = _resolve(None, x.shape[0] * levels)
    if len(parts) == 1:
        w = parts[0]
        return torch.ops.deepinfer_cpu.qlinear.default(x, w.data, w.ggml_id, w.k, level, levels, w.rows)  # [M, N]
    q, d, sums = torch.ops.deepinfer_cpu.quantize_acts.default(x, level, levels)  # [levels * M, K] ...
    return torch.cat([torch.ops.deepinfer_cpu.qdot.default(q, d, sums, w.data, w.ggml_id, w.k, level, levels, w.rows)
                      for w in parts], dim=-1)  # [M, N]
