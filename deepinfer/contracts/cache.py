"""Cache groups as plain data: which layers share one kind of cache and what one row holds.

A model declares its groups (`CachedModel.cache_groups`); the runner sizes them (block size,
ring size S, page rows) and allocates them; the engine's block manager sees only their sizes.

    kind "paged": a request holds a table of blocks; one row per `compress_ratio` tokens
                  (1 for full attention, m for DeepSeek-V4's compressed rows and index keys)
    kind "ring":  a request holds one state slot of S = rows_per_unit rows for window W
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PAGED, RING = "paged", "ring"


@dataclass(frozen=True)
class RowSpec:
    """What one layer caches for one token: K|V of `num_kv_heads` heads of `head_dim`, or with
    `shared_kv` one row that serves as both K and V (DeepSeek-V4's latent row, its index keys).
    `field` names the config field the width comes from, for errors when a row format cannot
    hold it (e.g. MXFP8 needs a multiple of 32 elements)."""

    num_kv_heads: int
    head_dim: int
    shared_kv: bool = False
    field: str = "head_dim"

    @property
    def num_elements(self) -> int:
        return (1 if self.shared_kv else 2) * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheGroupSpec:
    """Which layers share one kind of cache, and how a request's rows are addressed.

    kind PAGED: rows_per_unit = rows per block, one row per `compress_ratio` tokens.
    kind RING: rows_per_unit = S (ring rows per state slot), window = W.
    A model declares groups with rows_per_unit = 0; the runner sizes them (`sized`).
    """

    name: str
    kind: str
    layer_ids: tuple[int, ...]
    rows_per_unit: int = 0
    window: int | None = None
    compress_ratio: int = 1
    row: RowSpec | None = None

    def __post_init__(self):
        if self.kind not in (PAGED, RING):
            raise ValueError(f"cache group {self.name!r}: kind must be {PAGED!r} or {RING!r}, got {self.kind!r}")
        if self.kind == RING and self.window is None:
            raise ValueError(f"cache group {self.name!r}: a ring group needs a window")

    @property
    def is_ring(self) -> bool:
        return self.kind == RING

    def sized(self, rows_per_unit: int) -> CacheGroupSpec:
        return dataclasses.replace(self, rows_per_unit=rows_per_unit)
