"""One allocation per cache group; each layer sees a view of it (no second copy of the cache).

Full-attention (paged) group, compute-dtype rows:

    kv_cache [num_layers, num_blocks * block_size, 2, H_kv, D]
    layer l's view: kv_cache[l]   ->  [slots, 2, H_kv, D]     slot = block_id * block_size + offset

A row (one token, one layer) holds K and V of all KV heads: 2 * H_kv * D elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def row_elements(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """All layers' rows for one token."""
        return self.num_layers * self.row_elements * dtype.itemsize

    def num_blocks_for(self, memory_bytes: int, dtype: torch.dtype) -> int:
        return memory_bytes // (self.block_size * self.bytes_per_token(dtype))


class CacheEngine:
    def __init__(self, shape: PagedCacheShape, num_blocks: int, dtype: torch.dtype, device: torch.device):
        self.shape, self.num_blocks, self.dtype = shape, num_blocks, dtype
        num_slots = num_blocks * shape.block_size
        self.kv_cache = torch.zeros(shape.num_layers, num_slots, 2, shape.num_kv_heads, shape.head_dim,
                                    dtype=dtype, device=device)  # [layers, slots, 2, H_kv, D]

    def layer_views(self) -> list[torch.Tensor]:
        return [self.kv_cache[i] for i in range(self.shape.num_layers)]  # each [slots, 2, H_kv, D]

    @property
    def num_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()
