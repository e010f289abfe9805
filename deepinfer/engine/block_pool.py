"""Cache group specs as the engine sees them, the block pool (paged groups) and state slot
pools (ring groups). Pure Python.

    free list (head first):  [ 7 | 5 | 9 | 2* | 0* ]     * = cached: rows kept, findable by hash
    allocate -> 7, 5, 9, then 2* (evicted: its hash is dropped)
    free(b)  -> a cached block to the tail (it keeps its hash and rows: LRU); a block with no
                hash (nothing findable: caching off, or a partial block) to the head
    touch(b) -> a prefix hit takes a cached block back off the free list
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    """One physical block. `ref_cnt` counts the block tables holding it (0: on the free list).

    `block_hash` is its prefix-cache key, (paged group index, chained hash of every token up to
    the block's end), once its rows are computed and registered; a cached block with ref_cnt 0
    stays on the free list with its rows and loses the key when it is handed out again.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: tuple | None = None


class BlockPool:
    """A fixed set of ref-counted blocks, a free list and the cached-block map.

    Allocation takes from the head of the free list. A freed cached block goes to the tail, so
    of the cached blocks the one freed longest ago is reused first: an unreferenced cached block
    stays where it is, rows intact, findable in `cached`, until allocation evicts it (least
    recently used first; a request frees its blocks last-first, so of one prefix the longest goes
    first). A freed block with no hash holds nothing anyone can find: it goes to the head and is
    reused before any never-used block and before any cached block is evicted. So a cache hit is
    never lost to make room while such a block is free, and the rows written next are in pages
    already resident (the CPU cache is an anonymous mapping, committed as it is first written)
    and often still in the CPU's caches.
    """

    def __init__(self, num_blocks: int):
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[tuple, KVBlock] = {}  # block_hash -> the block holding those rows
        self.num_evicted = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.blocks else 0.0

    def free_block_ids(self) -> list[int]:
        """The free list, head (next to be allocated) first."""
        return list(self._free)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the head of the free list, each with ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self.num_evicted += 1
            block.block_hash = None

    def cache(self, block: KVBlock, key: tuple) -> bool:
        """Register a computed block under `key`; False (nothing changes) if the key or the block
        is cached already (e.g. another request computed the same prefix at the same time)."""
        if key in self.cached or block.block_hash is not None:
            return False
        block.block_hash = key
        self.cached[key] = block
        return True

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a holder to each block (sharing), taking it off the free list if it was free."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one holder from each block; a block nobody holds goes to the free-list tail."""
        for block in blocks:
            if block.ref_cnt < 1:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)


class StateSlotPool:
    """`num_slots` state slots of one ring group; a request holds at most one. A freed slot holds
    nothing of use: the slot freed last is handed out first (its pages resident and warm)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def free_state_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise ValueError(f"no free state slot (all {self.num_slots} in use)")
        return self._free.popleft()

    def free(self, state_id: int) -> None:
        if state_id in self._free or not 0 <= state_id < self.num_slots:
            raise RuntimeError(f"state slot {state_id} freed twice or never allocated")
        self._free.appendleft(state_id)


def check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class PagedGroupSpec:
    """A paged cache group: blocks of `block_size` rows, one row per `compress_ratio` tokens."""

    name: str
    block_size: int
    compress_ratio: int = 1

    def __post_init__(self):
        check_positive(f"{self.name}.block_size", self.block_size)
        check_positive(f"{self.name}.compress_ratio", self.compress_ratio)

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.compress_ratio

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-(num_tokens // self.compress_ratio) // self.block_size)


@dataclass(frozen=True)
class RingGroupSpec:
    """A sliding-window cache group: one state slot of `ring_size` rows per request."""

    name: str
    ring_size: int

    def __post_init__(self):
        check_positive(f"{self.name}.ring_size", self.ring_size)


def check_group_specs(specs, paged_specs, ring_specs) -> None:
    if not specs:
        raise ValueError("group_specs must name at least one cache group, got ()")
    if len(paged_specs) + len(ring_specs) != len(specs):
        bad = [s for s in specs if not isinstance(s, PagedGroupSpec | RingGroupSpec)]
        raise ValueError(f"group_specs must be PagedGroupSpec or RingGroupSpec, got {bad!r}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"cache group names must be unique, got {names!r}")
