"""Sliding-window ring addressing and its overwrite hazards (book §3.4.4-§3.5), on Python ints.

These are the scalar semantics of the decode-metadata and kv-index kernels (book listings 3.9
and 3.10): the reference the kernels are tested against, and what the labs print.

Each state id b owns one ring of S = swa_block_size rows in a flat array of rows:

    flat slot:  0 .. S-1 | S .. 2S-1 | ... | b·S .. b·S+S-1 | ...
                state 0  | state 1   |     | state b        |

Token p of state b lives at slot b·S + p mod S. Query p reads the logical positions
max(0, p-W+1) .. p (W = window_size <= S). The read-index row has W columns; column c holds
b·S + (start + c) mod S while c < min(p+1, W), then -1. With W=128, S=134, b=2, p=134:

    logical   7    8  ...  133  134
    slot    275  276  ...  401  268      <- wraps to the start of state 2's block

Slot 268 held position 0, which left the window six steps earlier: with S > W, window eviction
and physical overwrite are different events.
"""

from __future__ import annotations

from typing import NamedTuple

from deepinfer.model_executor.layers.ops.addressing import ring_slot
from deepinfer.model_executor.layers.ops.cache_common import check_int


class DecodeMetadata(NamedTuple):
    """Per-query decode metadata, as listing 3.9 computes it."""

    swa_len: int  # rows the query reads: min(pos + 1, W)
    window_start: int  # first logical position read
    offset: int  # flat slot of window_start
    length: int  # valid columns of the read-index row (== swa_len)
    write_slot: int  # flat slot the query's own row is stored to


class StoreHazard(NamedTuple):
    """An old cached row that a prefill chunk's store overwrites."""

    position: int  # logical position of the old row
    slot: int  # its flat slot
    overwritten_by: int  # chunk position whose store lands on that slot
    needed_by: tuple[int, ...]  # chunk queries whose window contains the old row

    @property
    def harmful(self) -> bool:
        """True when some query of the chunk still needs the destroyed row."""
        return bool(self.needed_by)


def _check_ring(window_size: int, swa_block_size: int) -> None:
    check_int("window_size", window_size, 1)
    check_int("swa_block_size", swa_block_size, 1)
    if swa_block_size < window_size:
        raise ValueError(f"swa_block_size={swa_block_size} is smaller than window_size={window_size}: "
                         "one ring cannot hold one window")


def state_slots(state_id: int, swa_block_size: int) -> range:
    """The flat slots state `state_id` owns: b·S .. b·S + S - 1."""
    check_int("state_id", state_id)
    start = ring_slot(state_id, 0, check_int("swa_block_size", swa_block_size, 1))
    return range(start, start + swa_block_size)


def logical_range(pos: int, window_size: int) -> tuple[int, int]:
    """First and last logical position query `pos` may read: (max(0, pos-W+1), pos)."""
    check_int("pos", pos)
    return max(0, pos - check_int("window_size", window_size, 1) + 1), pos


def write_slot(state_id: int, pos: int, swa_block_size: int) -> int:
    """Flat slot of token `pos` of state `state_id`: b·S + pos mod S."""
    check_int("pos", pos)
    check_int("state_id", state_id)
    return ring_slot(state_id, pos, check_int("swa_block_size", swa_block_size, 1))


def decode_metadata(pos: int, state_id: int, window_size: int, swa_block_size: int) -> DecodeMetadata:
    """Read bounds and write slot of one decode query (listing 3.9)."""
    _check_ring(window_size, swa_block_size)
    swa_len = min(check_int("pos", pos) + 1, window_size)
    window_start = pos - swa_len + 1
    offset = write_slot(state_id, window_start, swa_block_size)
    return DecodeMetadata(swa_len, window_start, offset, swa_len,
                          write_slot(state_id, pos, swa_block_size))


def kv_index_row(offset: int, length: int, window_size: int, swa_block_size: int) -> list[int]:
    """Expand (offset, length) into W read indices (listing 3.10).

    Column c holds base + (offset + c) mod S, where base = offset // S · S is the start of the
    state's block, for c < length; -1 after. The modulo wraps inside that block.
    """
    _check_ring(window_size, swa_block_size)
    check_int("offset", offset)
    if not 0 <= check_int("length", length) <= window_size:
        raise ValueError(f"length={length} must lie in 0..window_size={window_size}")
    state = offset // swa_block_size
    return [ring_slot(state, offset + c, swa_block_size) if c < length else -1 for c in range(window_size)]


def read_index_row(pos: int, state_id: int, window_size: int, swa_block_size: int) -> list[int]:
    """The expanded read-index row of decode query `pos` of state `state_id` (W columns)."""
    meta = decode_metadata(pos, state_id, window_size, swa_block_size)
    return kv_index_row(meta.offset, meta.length, window_size, swa_block_size)


def read_slot_bounds(pos: int, state_id: int, window_size: int, swa_block_size: int) -> tuple[int, int]:
    """First and last flat slot query `pos` reads (the last is its own write slot)."""
    meta = decode_metadata(pos, state_id, window_size, swa_block_size)
    return meta.offset, meta.write_slot


# --- Hazard (a): a verification step stores k + 1 rows, then reads ----------------------------

def overwrite_free_ring_size(window_size: int, num_drafts: int) -> int:
    """Smallest S at which storing rows p..p+k destroys no row query p still reads: W + k.

    Query p reads from p-W+1; the store of p+k lands on the row of p+k-S, so p+k-S < p-W+1.
    """
    return check_int("window_size", window_size, 1) + check_int("num_drafts", num_drafts)


def required_swa_block_size(window_size: int, num_drafts: int) -> int:
    """The ring the engine requires for k drafts: W + k + 1.

    One row above `overwrite_free_ring_size`: the backtracking allowance the default ring
    keeps (DEEPINFER_USE_NEXTN_DECODE + 1 rows for k = USE_NEXTN_DECODE drafts).
    """
    return overwrite_free_ring_size(window_size, num_drafts) + 1


def ring_fits_drafts(window_size: int, swa_block_size: int, num_drafts: int) -> bool:
    """True when S >= W + k + 1."""
    return check_int("swa_block_size", swa_block_size, 1) >= required_swa_block_size(window_size, num_drafts)


def check_ring_fits_drafts(window_size: int, swa_block_size: int, num_drafts: int) -> None:
    """Refuse a ring too small for k drafts per step (S < W + k + 1), naming W, S and k."""
    if not ring_fits_drafts(window_size, swa_block_size, num_drafts):
        need = required_swa_block_size(window_size, num_drafts)
        raise ValueError(
            f"swa_block_size S={swa_block_size} is too small for window_size W={window_size} with "
            f"num_drafts k={num_drafts}: need S >= W + k + 1 = {need}, or verification stores "
            "overwrite rows that its queries still read")


def overwritten_rows_per_query(window_size: int, swa_block_size: int, num_drafts: int,
                               pos: int | None = None) -> list[int]:
    """For queries pos..pos+k, how many visible rows hold another position after the k+1 stores.

    Decode stores all k+1 new rows, then reads. The ring is simulated token by token from
    position 0 through pos+k; `pos` defaults to W + S, where window and ring are both full.
    W=128, k=5: S=128 -> [5, 4, 3, 2, 1, 0]; S=133 or 134 -> all zeros.
    """
    check_int("window_size", window_size, 1)
    check_int("num_drafts", num_drafts)
    pos = window_size + swa_block_size if pos is None else check_int("pos", pos)
    last = pos + num_drafts
    holder = {write_slot(0, q, swa_block_size): q for q in range(last + 1)}  # later q wins
    counts = []
    for query in range(pos, last + 1):
        first, _ = logical_range(query, window_size)
        counts.append(sum(holder[write_slot(0, q, swa_block_size)] != q for q in range(first, query + 1)))
    return counts


# --- Hazard (b): a prefill chunk stored before the old window is loaded -----------------------

def prefill_store_hazards(window_size: int, swa_block_size: int, chunk_start: int,
                          chunk_end: int, state_id: int = 0) -> list[StoreHazard]:
    """Old rows destroyed if chunk chunk_start..chunk_end were stored before the old rows load.

    The cached prefix is 0..chunk_start-1; its last min(chunk_start, S) rows are in the ring.
    Every old row the chunk's stores land on is listed, with the chunk queries that read it.
    Book §3.5, W=3, S=5, state 0, chunk 4..7 (stores after 4 wrap to slots 0, 1, 2):

        slot       0  1  2  3  4
        old row    0  1  2  3  .        query 4 reads 2, 3, 4
        chunk      5  6  7  .  4        -> position 2 destroyed, needed by query 4

    Listing 3.13 therefore loads the old rows before storing the chunk.
    """
    _check_ring(window_size, swa_block_size)
    check_int("chunk_start", chunk_start)
    if check_int("chunk_end", chunk_end) < chunk_start:
        raise ValueError(f"chunk_end={chunk_end} must be >= chunk_start={chunk_start}")
    old = {write_slot(state_id, q, swa_block_size): q
           for q in range(max(0, chunk_start - swa_block_size), chunk_start)}
    hazards = []
    for writer in range(chunk_start, chunk_end + 1):
        slot = write_slot(state_id, writer, swa_block_size)
        if slot in old:
            victim = old.pop(slot)
            needed_by = tuple(q for q in range(chunk_start, chunk_end + 1)
                              if logical_range(q, window_size)[0] <= victim)
            hazards.append(StoreHazard(victim, slot, writer, needed_by))
    return hazards
