"""Every slot and index formula of the cache, in one place (book listings 3.9 and 3.10).

A flat slot names one row of one layer in a cache group: unit u (a paged block, or a ring's
state slot) times rows per unit R, plus the row inside the unit.

    ring group     token p of state b            slot = b*S + p mod S
    paged group    row r, block table T          slot = T[r // B]*B + r mod B
                   full attention: r = p; compressed groups: one row per m tokens,
                   rows 0 .. (p+1)//m - 1 visible to query p (r = p when m = 1)
    cache line     slot u*R + r of layer l       line = u*(L*R) + l*R + r   (L layers per unit)

    ring read index of a query (W columns):   b*S + (start + c) mod S  for c < length, else -1
    paged read index of a query (L columns):  slot of row c            for c < visible, else -1

Scalar functions take Python ints or tensors alike; the *_index functions build [N, L] tensors.
The worker's input builder, the book's decode-metadata functions, the scalar ring reference and
the cache's row lines all call these; models and attention layers only read the indices.
The scalar formulas need no torch (the book's pure-Python ring reference imports this module),
so the tensor builders import it where they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def ring_slot(state_id, pos, ring_rows: int):
    """Flat slot of token `pos` of state `state_id` in rings of S = ring_rows rows: b*S + p mod S."""
    return state_id * ring_rows + pos % ring_rows


def paged_slot(block_table, row, block_size: int):
    """Flat slot of row `row` (int or [n] tensor) in one block table (list or [B] tensor)."""
    return block_table[row // block_size] * block_size + row % block_size


def table_slots(tables: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of row ids rows [n, L] in each one's block table tables [n, B]; -1 stays -1."""
    safe = rows.clamp(min=0)  # [n, L]
    slots = tables.gather(1, safe // block_size) * block_size + safe % block_size  # [n, L]
    return slots.masked_fill(rows < 0, -1)


def num_rows(num_tokens, ratio: int):
    """Rows a paged group holds after `num_tokens` tokens: one per `ratio` (complete windows only)."""
    return num_tokens // ratio


def visible_rows(pos, ratio: int):
    """Rows query `pos` may read: (p + 1) // m; p + 1 for full attention (m = 1)."""
    return (pos + 1) // ratio


def cache_line(slot, rows_per_unit: int, lines_per_unit: int, layer_offset: int):
    """Line of flat slot u*R + r in a unit-major allocation whose units hold several layers."""
    return slot // rows_per_unit * lines_per_unit + slot % rows_per_unit + layer_offset


def ring_read_index(offset: torch.Tensor, length: torch.Tensor, window_size: int, ring_rows: int) -> torch.Tensor:
    """(offset, length) [N] -> read indices [N, W]: wrap inside the state's ring, -1 past length.

    offset is the flat slot of the first position read; its state is offset // S.
    """
    import torch

    cols = torch.arange(window_size, device=offset.device)  # [W]
    index = ring_slot(offset[:, None] // ring_rows, offset[:, None] + cols, ring_rows)  # [N, W]
    return index.masked_fill(cols >= length[:, None], -1)  # [N, W]


def paged_read_index(tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                     ratio: int = 1) -> torch.Tensor:
    """Read indices [N, L] of queries at positions [N] over their tables [N, B]: the slots of
    rows 0 .. visible - 1, then -1. L is the largest visible count (at least 0)."""
    import torch

    seen = visible_rows(positions, ratio)  # [N]
    width = int(seen.max()) if seen.numel() else 0
    cols = torch.arange(width, device=positions.device).expand(positions.shape[0], -1)  # [N, L]
    return table_slots(tables, cols.masked_fill(cols >= seen[:, None], -1), block_size)  # [N, L]


def padded_tables(tables: list[list[int]], device=None) -> torch.Tensor:
    """Block tables of several requests -> [n, max blocks] (0-padded: padding is never addressed)."""
    import torch

    width = max(1, max((len(t) for t in tables), default=0))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)  # [n, B]
