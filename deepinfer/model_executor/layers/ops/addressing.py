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


def paged_slots(tables: torch.Tensor, owner: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of rows [T] (each >= 0) of requests owner [T] (row indices of tables [n, B]):
    `paged_slot` for a whole packed batch in one gather."""
    return tables[owner, rows // block_size] * block_size + rows % block_size  # [T]


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
    """Line of flat slot u*R + r in a unit-major allocation whose units hold several layers:
    u*(L*R) + r + offset, computed as slot + u*(L*R - R) + offset (one tensor op fewer)."""
    line = slot + slot // rows_per_unit * (lines_per_unit - rows_per_unit)
    return line + layer_offset if layer_offset else line


def ring_read_index(offset: torch.Tensor, length: torch.Tensor, window_size: int, ring_rows: int) -> torch.Tensor:
    """(offset, length) [N] -> read indices [N, W]: wrap inside the state's ring, -1 past length.

    offset is the flat slot of the first position read; its state is offset // S.
    """
    import torch

    cols = torch.arange(window_size, device=offset.device)  # [W]
    index = ring_slot(offset[:, None] // ring_rows, offset[:, None] + cols, ring_rows)  # [N, W]
    return index.masked_fill(cols >= length[:, None], -1)  # [N, W]


def paged_read_index(tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                     ratio: int = 1, width: int | None = None) -> torch.Tensor:
    """Read indices [N, L] of queries at positions [N] over their tables [N, B]: the slots of
    rows 0 .. visible - 1, then -1. L = `width` when the caller knows the largest visible count
    (no host sync), else that count is read from `positions`.

    Rows of one block are consecutive slots, so each table entry t expands to t*B .. t*B + B-1:

        table [3, 7]  B = 4  ->  12 13 14 15 | 28 29 30 31  -> cut to L columns, -1 from `visible`
    """
    import torch

    seen = visible_rows(positions, ratio)  # [N]
    if width is None:
        width = int(seen.max()) if seen.numel() else 0
    num_blocks = -(-width // block_size)
    if tables.shape[1] < num_blocks:  # a table narrower than the widest row (padding only)
        tables = torch.nn.functional.pad(tables, (0, num_blocks - tables.shape[1]))  # [N, B']
    first = tables[:, :num_blocks, None] * block_size  # [N, b, 1]
    rows = (first + torch.arange(block_size, device=tables.device)).flatten(1)[:, :width]  # [N, L]
    cols = torch.arange(width, device=positions.device)  # [L]
    return rows.masked_fill(cols >= seen[:, None], -1)  # [N, L]


def padded_tables(tables: list[list[int]], device=None) -> torch.Tensor:
    """Block tables of several requests -> [n, max blocks] (0-padded: padding is never addressed)."""
    import torch

    width = max(1, max((len(t) for t in tables), default=0))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)  # [n, B]


def run_horizons(positions: torch.Tensor, rows: torch.Tensor, breaks: torch.Tensor | None = None) -> torch.Tensor:
    """[T] the last position each packed row's query sees: its own, or, for a row of a run, the
    run's last position (a picture's placeholder run seen whole, as Gemma 3 reads it).

    positions [T]; rows [P]: the packed rows that belong to runs; a run is a maximal stretch of
    consecutive packed rows of `rows` that does not cross a row of `breaks` (the first packed row
    of each request: two requests' runs never join). A run cut by a prefill chunk boundary is seen
    whole only within its chunk: the scheduler keeps a run in one chunk.
    """
    import torch

    horizons = positions.clone()  # [T]
    if rows.numel() == 0:
        return horizons
    rows = rows.sort().values  # [P]
    starts = torch.ones_like(rows, dtype=torch.bool)  # [P] True where a run begins
    starts[1:] = rows[1:] != rows[:-1] + 1
    if breaks is not None:
        starts |= torch.isin(rows, breaks)
    ends = torch.ones_like(starts)  # [P] True where a run ends
    ends[:-1] = starts[1:]
    run = starts.cumsum(0) - 1  # [P] which run each row is in
    horizons[rows] = positions[rows[ends]][run]  # [P]: the position of its run's last row
    return horizons
