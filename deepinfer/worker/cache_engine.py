"""One allocation per cache group; each layer sees an as_strided view of it (book listing 3.8).

A group's allocation holds, per unit (a paged block, or a ring's state slot), the rows of all
its layers one after another:

    blocks [num_units, num_layers * rows_per_unit * row_bytes]   uint8
             unit u:  | layer 0: rows 0..R-1 | layer 1: rows 0..R-1 | ...
    layer l's view:   (num_units, rows_per_unit, 1, row_bytes)
                      strides (blocks.stride(0), row_bytes, row_bytes, 1)

R is the block size of a paged group, or the ring size S of a ring group. A flat slot
u * R + r (the book's b * S + p mod S) addresses view[u, r]. No second copy of the cache exists:
every view aliases the group's one allocation.
"""

from __future__ import annotations

import math
import mmap

import torch

from deepinfer.contracts.cache import CacheGroupSpec, RowSpec
from deepinfer.model_executor.layers.ops import fused
from deepinfer.model_executor.layers.ops.addressing import cache_line
from deepinfer.model_executor.layers.ops.cache_common import KVCacheFormat, mxfp8_format, unquantized_format
from deepinfer.model_executor.layers.ops.mxfp8 import dequantize_mxfp8, quantize_mxfp8

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class RowCodec:
    """One layer's cached state of one token <-> one row of bytes.

    Separate K and V (Llama family): the row is K|V of all KV heads, 2 * H_kv * D elements.
    Shared K = V (a latent row, as DeepSeek-V4 stores one 512-element row per token): the row is
    H_kv * D elements and serves as both K and V; a 512-element MXFP8 row is 528 bytes.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str,
                 shared_kv: bool = False):
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.row_dtype = torch.bfloat16 if kv_cache_dtype == "bfloat16" else dtype  # plain rows' element type
        self.shared_kv = shared_kv
        self.num_parts = 1 if shared_kv else 2
        self.num_elements = self.num_parts * num_kv_heads * head_dim
        self.fp8 = kv_cache_dtype == "fp8"
        what = "K=V latent row" if shared_kv else "K|V row"
        self.format: KVCacheFormat = (mxfp8_format(self.num_elements, f"MXFP8 {what}") if self.fp8 else
                                      unquantized_format(self.num_elements, _DTYPE_NAMES[self.row_dtype], what))

    @classmethod
    def for_row(cls, row: RowSpec, dtype: torch.dtype, kv_cache_dtype: str) -> RowCodec:
        """The codec of a declared row; a width the format cannot hold is refused naming row.field."""
        try:
            return cls(row.num_kv_heads, row.head_dim, dtype, kv_cache_dtype, shared_kv=row.shared_kv)
        except ValueError as exc:
            raise ValueError(f"{row.field}={row.head_dim} cannot be cached in this row format: {exc}") from exc

    @property
    def row_bytes(self) -> int:
        return self.format.bytes_per_row

    def encode(self, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        """k, v [T, H_kv, D] -> rows [T, row_bytes] uint8 (v is not stored when K = V)."""
        flat = k.flatten(1) if self.shared_kv else torch.cat((k.flatten(1), v.flatten(1)), dim=1)  # [T, E]
        if self.fp8:
            return quantize_mxfp8(flat)  # [T, row_bytes]
        return flat.to(self.row_dtype).contiguous().view(torch.uint8)  # [T, row_bytes]

    def as_kv(self, flat: torch.Tensor) -> torch.Tensor:
        """[..., E] -> [..., 2, H_kv, D]; a shared row is the same memory seen as K and as V."""
        kv = flat.unflatten(-1, (self.num_parts, self.num_kv_heads, self.head_dim))  # [..., 1|2, H_kv, D]
        return kv.expand(*kv.shape[:-3], 2, -1, -1) if self.shared_kv else kv

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., row_bytes] uint8 -> [..., 2, H_kv, D] in the compute dtype."""
        if self.fp8:
            return self.as_kv(dequantize_mxfp8(rows, self.num_elements, self.dtype))  # [..., 2, H_kv, D]
        return self.as_kv(rows.contiguous().view(self.row_dtype).to(self.dtype))  # [..., 2, H_kv, D]


class LayerCache:
    """One layer's view of its group: load rows at flat slots, store rows at flat slots.

    `view` is the book's (units, rows_per_unit, 1, row_bytes) view. Reads and writes go through
    the same memory seen as one row per line, `rows2d` [units * layers * R, row], where the
    row of flat slot u * R + r of layer l is line u * layers * R + l * R + r: one index_select
    (a memcpy per row) instead of a two-index gather.
    """

    def __init__(self, view: torch.Tensor, rows2d: torch.Tensor, index_in_group: int, codec: RowCodec):
        self.view = view  # (units, rows_per_unit, 1, row_bytes) uint8
        self.rows2d = rows2d  # [units * layers * R, row] uint8, or the compute dtype for plain rows
        self.codec = codec
        self.rows_per_unit = view.shape[1]
        self.lines_per_unit = rows2d.shape[0] // view.shape[0]
        self.layer_offset = index_in_group * self.rows_per_unit

    def _lines(self, slots: torch.Tensor) -> torch.Tensor:
        return cache_line(slots, self.rows_per_unit, self.lines_per_unit, self.layer_offset)

    def load(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [...] (-1 reads some row: the caller masks it) -> [..., 2, H_kv, D]."""
        lines = self._lines(slots.clamp(min=0))
        rows = self.rows2d.index_select(0, lines.flatten()).view(*slots.shape, self.rows2d.shape[1])  # [..., row]
        return self.codec.decode(rows) if self.codec.fp8 else self.codec.as_kv(rows)  # [..., 2, H_kv, D]

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rows for k, v [T, H_kv, D] at distinct flat slots [T]."""
        if fused.store_rows(self, slots, k, v):
            return
        rows = self.codec.encode(k, v)  # [T, row_bytes] uint8
        if not self.codec.fp8:
            rows = rows.view(self.rows2d.dtype)  # [T, row]
        self.rows2d.index_copy_(0, self._lines(slots), rows)


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


class CacheEngine:
    """One uint8 allocation per ring group, and one shared by all paged groups (one page size:
    see `page_rows`; a block id addresses the same page bytes in each of them)."""

    def __init__(self, groups: list[CacheGroupSpec], num_units: list[int], codecs: list[RowCodec],
                 device: torch.device):
        self.groups, self.num_units, self.codecs = groups, num_units, codecs
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
        return lines if codec.fp8 else lines.view(codec.row_dtype)

    @property
    def num_bytes(self) -> int:
        unique = {id(a): a for a in self.allocations}
        return sum(a.numel() for a in unique.values())

    def group_bytes(self, gi: int) -> int:
        """Bytes of group gi's allocation (for paged groups: the pool they share)."""
        return self.allocations[gi].numel()
