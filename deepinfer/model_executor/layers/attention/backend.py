"""The attention backend contract: what a step's metadata holds and what a backend must do.

Packed token axis T: decode rows first (one query each), then prefill segments (a chunk of one
request each; a multi-query verification step is a segment too).

Order inside one layer, for every backend (DESIGN.md invariants 1, 2, 4):

    1. load   the cached rows each prefill segment attends to   (before anything is written)
    2. store  every new row at slot_mapping
    3. decode queries read through decode_kv_index (their own new row included)
    4. prefill queries attend over [loaded rows | the chunk's rows]

No backend applies a causal mask of its own to a cache read: an index row lists exactly the
slots a query may see, and -1 marks padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSegment:
    token_start: int  # first row of this segment on the packed token axis
    token_end: int  # one past its last row
    start_pos: int  # position of its first token = rows already in the cache
    load_index: torch.Tensor  # [start_pos] cache slots of positions 0..start_pos-1 (or the window's)
    load_positions: torch.Tensor  # [start_pos] their positions (for masking windows later)

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new row is written to
    positions: torch.Tensor  # [T] position of each new row
    num_decode_tokens: int  # rows [0, num_decode_tokens) are single-query decodes
    decode_kv_index: torch.Tensor | None  # [B_decode, L_max] slots each decode query reads, -1 pad
    prefills: list[PrefillSegment] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend:
    """Interface: one call per layer per step."""

    name = "abstract"

    def forward(self, kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """kv_cache [slots, 2, H_kv, D]; q [T, H, D]; k, v [T, H_kv, D] -> [T, H, D]."""
        raise NotImplementedError
