"""Cache bookkeeping on the CPU: which blocks and state slots each request holds. Pure Python.

Two kinds of cache group, each described by a small frozen spec:

- `PagedGroupSpec` (full attention, or compressed rows): a request holds a block table, one
  block per `block_size` rows, grown as its tokens are computed. A group with
  `compress_ratio` m holds one row per m tokens (DeepSeek-V4's compressed rows: after t
  tokens there are t // m of them), so a block covers `block_size * m` tokens. All paged groups draw from one
  shared `BlockPool`, so `num_blocks` is the budget of the whole cache.
- `RingGroupSpec` (sliding window): a request holds one state slot of `ring_size` rows for
  its whole life; token p lives at row `state_id * ring_size + p % ring_size`. Each ring
  group has its own pool of `num_state_slots` slots.

    request "a":  block_tables = ([7, 2, 9],)   state_ids = (0,)
                   paged group 0 ^               ^ ring group 0

Invariant (no leaks): every block and state slot returns to its pool when the request is
freed, whether it finished, was aborted or was preempted; `check_no_leaks()` verifies it.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class PagedGroupSpec:
    """A paged cache group: blocks of `block_size` rows, one row per `compress_ratio` tokens."""

    name: str
    block_size: int
    compress_ratio: int = 1

    def __post_init__(self):
        _check_positive(f"{self.name}.block_size", self.block_size)
        _check_positive(f"{self.name}.compress_ratio", self.compress_ratio)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-(num_tokens // self.compress_ratio) // self.block_size)


@dataclass(frozen=True)
class RingGroupSpec:
    """A sliding-window cache group: one state slot of `ring_size` rows per request."""

    name: str
    ring_size: int

    def __post_init__(self):
        _check_positive(f"{self.name}.ring_size", self.ring_size)


@dataclass(eq=False)
class KVBlock:
    """One physical block. `ref_cnt` counts the block tables holding it (0: on the free list).

    `block_hash` is reserved for prefix caching (hash chained over parent hash and tokens);
    nothing sets it yet, and a block loses it when it is handed out again.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """A fixed set of ref-counted blocks and an LRU free list.

    Allocation takes from the head of the free list, freed blocks go to the tail, so the
    block freed longest ago is reused first (the order a prefix cache wants for eviction).
    """

    def __init__(self, num_blocks: int):
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)

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
            block.ref_cnt, block.block_hash = 1, None
            blocks.append(block)
        return blocks

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


class StateSlotPool:
    """`num_slots` state slots of one ring group; a request holds at most one."""

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
        self._free.append(state_id)


@dataclass
class _RequestCache:
    block_tables: tuple[list[KVBlock], ...]  # one per paged group
    state_ids: tuple[int, ...]  # one per ring group


class KVCacheManager:
    """Per-request block tables (paged groups) and state slots (ring groups) over shared pools.

    `allocate_slots` is all-or-nothing: it either covers the asked number of tokens in every
    group or changes nothing. A request's state slots are taken on its first allocation and,
    like its blocks, given back by `free`.
    """

    def __init__(self, group_specs: tuple[PagedGroupSpec | RingGroupSpec, ...], num_blocks: int,
                 num_state_slots: int = 0):
        self.group_specs = tuple(group_specs)
        self.paged_specs = tuple(s for s in self.group_specs if isinstance(s, PagedGroupSpec))
        self.ring_specs = tuple(s for s in self.group_specs if isinstance(s, RingGroupSpec))
        _check_group_specs(self.group_specs, self.paged_specs, self.ring_specs)
        if self.paged_specs:
            _check_positive("num_blocks", num_blocks)
        if self.ring_specs:
            _check_positive("num_state_slots", num_state_slots)
        self.block_pool = BlockPool(num_blocks if self.paged_specs else 0)
        self.slot_pools = tuple(StateSlotPool(num_state_slots) for _ in self.ring_specs)
        self._requests: dict[str, _RequestCache] = {}
        self.max_num_tokens = self._max_num_tokens()

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_allocated_requests(self) -> int:
        return len(self._requests)

    def _max_num_tokens(self) -> int:
        """The most tokens one request can hold when it has the whole cache to itself."""
        if not self.paged_specs:
            return sys.maxsize
        low, high = 0, self.num_total_blocks * max(s.block_size * s.compress_ratio for s in self.paged_specs)
        while low < high:
            mid = (low + high + 1) // 2
            if self._num_blocks_for(mid) <= self.num_total_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def _num_blocks_for(self, num_tokens: int) -> int:
        return sum(spec.num_blocks_for(num_tokens) for spec in self.paged_specs)

    # ---- allocation ---------------------------------------------------------------------
    def _num_new_blocks(self, request_id: str, num_tokens_total: int) -> list[int]:
        cache = self._requests.get(request_id)
        held = [len(t) for t in cache.block_tables] if cache else [0] * len(self.paged_specs)
        return [max(0, spec.num_blocks_for(num_tokens_total) - n)
                for spec, n in zip(self.paged_specs, held, strict=True)]

    def can_allocate(self, request_id: str, num_tokens_total: int) -> bool:
        """Could `allocate_slots(request_id, num_tokens_total)` succeed now?"""
        if sum(self._num_new_blocks(request_id, num_tokens_total)) > self.num_free_blocks:
            return False
        return request_id in self._requests or all(p.num_free_slots > 0 for p in self.slot_pools)

    def allocate_slots(self, request_id: str, num_tokens_total: int) -> bool:
        """Grow the request's block tables to cover `num_tokens_total` tokens (never shrinks).

        Returns False, changing nothing, when the free blocks or state slots do not suffice.
        """
        if not self.can_allocate(request_id, num_tokens_total):
            return False
        num_new_blocks = self._num_new_blocks(request_id, num_tokens_total)
        cache = self._requests.get(request_id) or self._register(request_id)
        for table, num_new in zip(cache.block_tables, num_new_blocks, strict=True):
            table.extend(self.block_pool.allocate(num_new))
        return True

    def trim(self, request_id: str, num_tokens_total: int) -> int:
        """Shrink the request's block tables to what `num_tokens_total` tokens need, freeing the
        tail blocks (e.g. those only rejected draft positions used). Returns the blocks freed."""
        cache = self._cache(request_id)
        freed = 0
        for spec, table in zip(self.paged_specs, cache.block_tables, strict=True):
            keep = spec.num_blocks_for(num_tokens_total)
            if len(table) > keep:
                self.block_pool.free(reversed(table[keep:]))
                freed += len(table) - keep
                del table[keep:]
        return freed

    def _register(self, request_id: str) -> _RequestCache:
        cache = _RequestCache(tuple([] for _ in self.paged_specs),
                              tuple(pool.allocate() for pool in self.slot_pools))
        self._requests[request_id] = cache
        return cache

    def free(self, request_id: str) -> None:
        """Give back all blocks and state slots of the request; a no-op if it holds none.

        Blocks are freed last-first, so a request's tail blocks are reused before its head.
        """
        cache = self._requests.pop(request_id, None)
        if cache is None:
            return
        for table in cache.block_tables:
            self.block_pool.free(reversed(table))
        for pool, state_id in zip(self.slot_pools, cache.state_ids, strict=True):
            pool.free(state_id)

    # ---- lookups ------------------------------------------------------------------------
    def _cache(self, request_id: str) -> _RequestCache:
        cache = self._requests.get(request_id)
        if cache is None:
            raise KeyError(f"request {request_id!r} holds no cache (never allocated or freed)")
        return cache

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """One block table (list of block ids, a fresh copy) per paged group."""
        return tuple([b.block_id for b in table] for table in self._cache(request_id).block_tables)

    def state_ids(self, request_id: str) -> tuple[int, ...]:
        """One state slot per ring group."""
        return self._cache(request_id).state_ids

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    # ---- checks for tests ---------------------------------------------------------------
    def check_consistency(self) -> None:
        """Each block's ref_cnt equals the number of tables holding it; free means ref_cnt 0."""
        holders = [0] * self.num_total_blocks
        for cache in self._requests.values():
            for table in cache.block_tables:
                for block in table:
                    holders[block.block_id] += 1
        free_block_ids = set(self.block_pool.free_block_ids())
        for block in self.block_pool.blocks:
            on_free_list = block.block_id in free_block_ids
            if block.ref_cnt != holders[block.block_id] or on_free_list != (block.ref_cnt == 0):
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                                     f"{holders[block.block_id]} holders, free={on_free_list}")
        for i, pool in enumerate(self.slot_pools):
            held, free = [cache.state_ids[i] for cache in self._requests.values()], pool.free_state_ids()
            if sorted(held + free) != list(range(pool.num_slots)):
                raise AssertionError(f"ring group {self.ring_specs[i].name}: state slots "
                                     f"held {sorted(held)}, free {sorted(free)}")

    def check_no_leaks(self) -> None:
        """Raise AssertionError unless every block and state slot is back in its pool."""
        self.check_consistency()
        leaks = []
        if self._requests:
            leaks.append(f"requests still holding cache: {sorted(self._requests)}")
        if self.num_free_blocks != self.num_total_blocks:
            leaks.append(f"{self.num_total_blocks - self.num_free_blocks} blocks not free")
        for spec, pool in zip(self.ring_specs, self.slot_pools, strict=True):
            if pool.num_free_slots != pool.num_slots:
                leaks.append(f"{pool.num_slots - pool.num_free_slots} state slots of {spec.name} not free")
        if leaks:
            raise AssertionError("; ".join(leaks))


def _check_group_specs(specs, paged_specs, ring_specs) -> None:
    if not specs:
        raise ValueError("group_specs must name at least one cache group, got ()")
    if len(paged_specs) + len(ring_specs) != len(specs):
        bad = [s for s in specs if not isinstance(s, PagedGroupSpec | RingGroupSpec)]
        raise ValueError(f"group_specs must be PagedGroupSpec or RingGroupSpec, got {bad!r}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"cache group names must be unique, got {names!r}")
