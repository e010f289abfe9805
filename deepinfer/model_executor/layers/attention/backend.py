"""The attention backend contract: what a step's metadata holds and what a backend must do.

Packed token axis T: decode queries first (one row each; a verification step of k+1 tokens is
k+1 decode queries), then prefill segments (a chunk of one request each).

Order inside one layer, for every backend (DESIGN.md invariants 1, 2, 4):

    1. load   the cached rows each prefill segment attends to   (before anything is written)
    2. store  the new rows at their slots
    3. decode queries read through their index rows (their own new rows included)
    4. prefill queries attend over [loaded rows | the chunk's rows]

No backend applies a causal mask of its own to a cache read: an index row lists exactly the
slots a query may see, and -1 marks padding. Metadata comes per cache group, since a paged
group and a ring group address the same token differently.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSegment:
    token_start: int  # first row of this segment on the packed token axis
    token_end: int  # one past its last row
    load_slots: torch.Tensor  # [n_old] flat slots of the cached rows the chunk attends to
    load_positions: torch.Tensor  # [n_old] their positions

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass
class GroupMetadata:
    """One cache group's addresses for this step."""

    window: int | None  # W for a ring group; None: full attention
    store_slots: torch.Tensor  # [M] flat slot of each stored row
    store_rows: torch.Tensor | None  # [M] which packed rows are stored (None: all T, in order)
    decode_index: torch.Tensor | None  # [N_decode, L] slots each decode query reads, -1 pad
    prefills: list[PrefillSegment] = field(default_factory=list)


@dataclass
class RequestSpan:
    """One request's rows on the packed token axis, for layers that keep per-request state
    (DeepSeek-V4's compressors) or address rows that are not tokens (compressed rows)."""

    token_start: int
    token_end: int
    start_pos: int  # position of the span's first token
    state_ids: tuple[int, ...]  # one per ring group
    block_tables: tuple[torch.Tensor, ...]  # [num_blocks] one per paged group


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] position of each new row
    num_decode_tokens: int  # rows [0, num_decode_tokens) are decode queries
    groups: list[GroupMetadata | None]  # None for a compressed group: its rows are not tokens
    spans: list[RequestSpan] = field(default_factory=list)  # packed order
    span_tables: tuple[torch.Tensor, ...] = ()  # [num_spans, max blocks] per paged group, 0-padded

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


class AttentionBackend(abc.ABC):
    """Interface: one call per layer per step."""

    name = "abstract"

    @abc.abstractmethod
    def forward(self, cache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata, group: GroupMetadata, scale: float) -> torch.Tensor:
        """cache: the layer's LayerCache; q [T, H, D]; k, v [T, H_kv, D] -> [T, H, D]."""
