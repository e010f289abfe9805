"""One allocation per cache group; each layer sees an as_strided view of it (book listing 3.8).

A group's allocation holds, per unit (a paged block, or a ring's state slot), the rows of all
its layers one after another:

    blocks [num_units, num_layers * rows_per_unit * row_bytes]   uint8
             unit u:  | layer 0: rows 0..R-1 | layer 1: rows 0..R-1 | ...
    layer l's view:   (num_units, rows_per_unit, 1, row_bytes)
                      strides (blocks.stride(0), row_bytes, row_bytes, 1)

R is the block size of a paged group, or the ring size S of a ring group. A flat slot
u * R + r (the book's b * S + p mod S) addresses view[u, r]. No second copy of the cache exists:
every view aliases the group's one allocation. The row codec and the layer view (`RowCodec`,
`LayerCache`) live with the attention layer (model_executor/layers/attention/layer_cache.py).
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.model_executor.layers.attention.layer_cache import LayerCache, RowCodec


def make_codecs(groups: list[CacheGroupSpec], dtype: torch.dtype, kv_cache_dtype: str) -> list[RowCodec]:
    """One codec per group, from the row each group declares."""
    return [RowCodec.for_row(g.row, dtype, kv_cache_dtype) for g in groups]


def size_groups(groups: list[CacheGroupSpec], block_size: int, ring_rows) -> list[CacheGroupSpec]:
    """Declared groups -> sized ones: paged groups get `block_size` rows per block, ring groups
    S = ring_rows(W) rows per state slot."""
    return [g.sized(ring_rows(g.window) if g.is_ring else block_size) for g in groups]


def page_rows(groups: list[CacheGroupSpec], block_size: int, codecs: list[RowCodec]) -> list[CacheGroupSpec]:
    """Give every paged group the same page size in bytes, so all of them can share one pool.

    The page P holds `block_size` rows of the widest paged group (all its layers), rounded up to
    a multiple of every row size; each paged group then takes as many rows per block as fill P:

        V4, MXFP8 rows:  csa 2 layers x 528 B, hca 1 x 528 B, index 2 x 132 B, block_size 16
        P = 16 x 1,056 = 16,896 B  ->  csa 16 rows, hca 32 rows, index 64 rows per block

    A block id then means the same bytes in every paged group, and one allocation serves them all.
    """
    paged = [(g, c.row_bytes) for g, c in zip(groups, codecs, strict=True) if not g.is_ring]
    if len(paged) < 2:
        return groups
    page = block_size * max(len(g.layer_ids) * r for g, r in paged)
    step = math.lcm(*(r for _, r in paged))
    page = -(-page // step) * step
    sized = {g.name: g.sized(page // (len(g.layer_ids) * r)) for g, r in paged}
    return [sized.get(g.name, g) for g in groups]


def zeroed_bytes(num_units: int, unit_bytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed [num_units, unit_bytes] uint8 allocation. On the CPU it is an anonymous mapping:
    the kernel's zero pages, committed as blocks are first written, so a cache sized for many
    long requests costs resident memory only for the rows in use."""
    if torch.device(device).type != "cpu" or num_units * unit_bytes == 0:
        return torch.zeros(num_units, unit_bytes, dtype=torch.uint8, device=device)
    pages = mmap.mmap(-1, num_units * unit_bytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=torch.uint8).view(num_units, unit_bytes)  # [units, unit_bytes]


def resident_bytes(t: torch.Tensor) -> int | None:
    """Bytes of CPU tensor `t`'s pages that are in physical memory (mincore(2) over its range); None
    for a GPU tensor or where mincore fails."""
    if t.device.type != "cpu":
        return None
    n = t.numel() * t.element_size()
    if n == 0:
        return 0
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + n - start
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        return None
    return min(n, sum(b & 1 for b in bytes(vec)) * page)


class CacheEngine:
    """One uint8 allocation per ring group, and one shared by all paged groups (one page size:
    see `page_rows`; a block id addresses the same page bytes in each of them)."""

    def __init__(self, groups: list[CacheGroupSpec], num_units: list[int], codecs: list[RowCodec],
                 device: torch.device):
        self.groups, self.num_units, self.codecs = groups, num_units, codecs
        if any(c.int8 for c in codecs) and torch.device(device).type != "cpu":
            raise ValueError(f"kv_cache_dtype='int8' is a CPU row format; the cache is on {device}")
        paged = [i for i, g in enumerate(groups) if not g.is_ring]
        page = max((self.unit_bytes(i) for i in paged), default=0)
        shared = zeroed_bytes(num_units[paged[0]], page, device) if paged else None
        self.allocations = [zeroed_bytes(n, self.unit_bytes(gi), device) if g.is_ring
                            else shared for gi, (g, n) in enumerate(zip(groups, num_units, strict=True))]
        # [units, unit_bytes] each

    def unit_bytes(self, gi: int) -> int:
        """Bytes of one block (paged) or one state slot (ring) of group gi."""
        group = self.groups[gi]
        return len(group.layer_ids) * group.rows_per_unit * self.codecs[gi].row_bytes

    def group_caches(self, gi: int) -> dict[int, LayerCache]:
        """layer id -> its LayerCache in group gi."""
        blocks, codec = self.allocations[gi], self.codecs[gi]
        return {layer: LayerCache(self.layer_view(gi, li), self.rows2d(blocks, codec), li, codec)
                for li, layer in enumerate(self.groups[gi].layer_ids)}

    def layer_caches(self) -> dict[int, tuple[int, LayerCache]]:
        """layer id -> (group index, its LayerCache), for stacks with one cache group per layer."""
        return {layer: (gi, cache) for gi in range(len(self.groups)) for layer, cache in self.group_caches(gi).items()}

    def layer_view(self, gi: int, index_in_group: int) -> torch.Tensor:
        """The book's (units, rows_per_unit, 1, bytes per row) view of one layer's region of group gi."""
        blocks, row, rows = self.allocations[gi], self.codecs[gi].row_bytes, self.groups[gi].rows_per_unit
        start = index_in_group * rows * row
        return blocks[:, start:start + rows * row].as_strided(
            (blocks.shape[0], rows, 1, row), (blocks.stride(0), row, row, 1))

    @staticmethod
    def rows2d(blocks: torch.Tensor, codec: RowCodec) -> torch.Tensor:
        """The group's allocation as one row per line, typed as the rows' element type."""
        lines = blocks.view(-1, codec.row_bytes)  # [units * layers * R, row_bytes]
        return lines if codec.quantized else lines.view(codec.row_dtype)

    @property
    def num_bytes(self) -> int:
        unique = {id(a): a for a in self.allocations}
        return sum(a.numel() for a in unique.values())

    @property
    def resident_bytes(self) -> int | None:
        """Bytes of the allocations in physical memory now (CPU: the pages written so far, by
        mincore(2)); None where that cannot be known (a GPU, or no mincore)."""
        unique = {id(a): a for a in self.allocations}.values()
        counts = [resident_bytes(a) for a in unique]
        return None if None in counts else sum(counts)

    def group_bytes(self, gi: int) -> int:
        """Bytes of group gi's allocation (for paged groups: the pool they share)."""
        return self.allocations[gi].numel()
