"""Per-request block tables and state slots over shared pools: allocate, grow, trim, free, and the
no-leak checks. Pure Python; knows nothing of prefix caching (`kv_manager.KVCacheManager` adds it).

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
from dataclasses import dataclass

from deepinfer.engine.block_pool import (
    BlockPool,
    KVBlock,
    PagedGroupSpec,
    RingGroupSpec,
    StateSlotPool,
    check_group_specs,
    check_positive,
)


@dataclass
class RequestCache:
    """What one request holds: a block table per paged group, a state slot per ring group."""

    block_tables: tuple[list[KVBlock], ...]  # one per paged group
    state_ids: tuple[int, ...]  # one per ring group


class KVAllocator:
    """Per-request block tables (paged groups) and state slots (ring groups) over shared pools.

    `allocate_slots` is all-or-nothing: it either covers the asked number of tokens in every
    group or changes nothing. A request's state slots are taken on its first allocation and,
    like its blocks, given back by `free`. Subclasses keep more per request by setting
    `_record_type` to a subclass of `RequestCache`.
    """

    _record_type: type[RequestCache] = RequestCache

    def __init__(self, group_specs: tuple[PagedGroupSpec | RingGroupSpec, ...], num_blocks: int,
                 num_state_slots: int = 0):
        self.group_specs = tuple(group_specs)
        self.paged_specs = tuple(s for s in self.group_specs if isinstance(s, PagedGroupSpec))
        self.ring_specs = tuple(s for s in self.group_specs if isinstance(s, RingGroupSpec))
        check_group_specs(self.group_specs, self.paged_specs, self.ring_specs)
        if self.paged_specs:
            check_positive("num_blocks", num_blocks)
        if self.ring_specs:
            check_positive("num_state_slots", num_state_slots)
        self.block_pool = BlockPool(num_blocks if self.paged_specs else 0)
        self.slot_pools = tuple(StateSlotPool(num_state_slots) for _ in self.ring_specs)
        self._requests: dict[str, RequestCache] = {}
        self.max_num_tokens = self._max_num_tokens()

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.block_pool.cached)

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
        low, high = 0, self.num_total_blocks * max(s.tokens_per_block for s in self.paged_specs)
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

    def _register(self, request_id: str) -> RequestCache:
        cache = self._record_type(tuple([] for _ in self.paged_specs),
                                  tuple(pool.allocate() for pool in self.slot_pools))
        self._requests[request_id] = cache
        return cache

    def free(self, request_id: str) -> None:
        """Give back all blocks and state slots of the request; a no-op if it holds none.

        Blocks are freed last-first, so a request's tail blocks are reused before its head.
        Cached blocks keep their rows and hashes on the free list (a later request may hit them).
        """
        cache = self._requests.pop(request_id, None)
        if cache is None:
            return
        for table in cache.block_tables:
            self.block_pool.free(reversed(table))
        for pool, state_id in zip(self.slot_pools, cache.state_ids, strict=True):
            pool.free(state_id)

    # ---- lookups ------------------------------------------------------------------------
    def _cache(self, request_id: str) -> RequestCache:
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
        """Each block's ref_cnt equals the number of tables holding it; free means ref_cnt 0;
        every cached block is registered under its own hash; state slots add up."""
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
        for key, block in self.block_pool.cached.items():
            if block.block_hash != key:
                raise AssertionError(f"cached block {block.block_id} is registered under another key")
        for i, pool in enumerate(self.slot_pools):
            held, free = [cache.state_ids[i] for cache in self._requests.values()], pool.free_state_ids()
            if sorted(held + free) != list(range(pool.num_slots)):
                raise AssertionError(f"ring group {self.ring_specs[i].name}: state slots "
                                     f"held {sorted(held)}, free {sorted(free)}")

    def check_no_leaks(self) -> None:
        """Raise AssertionError unless every block and state slot is back in its pool (cached
        blocks count as free: nobody holds them)."""
        self.check_consistency()
        leaks = self._leaks()
        if leaks:
            raise AssertionError("; ".join(leaks))

    def _leaks(self) -> list[str]:
        """What is still held, one line per kind ([] when nothing)."""
        leaks = []
        if self._requests:
            leaks.append(f"requests still holding cache: {sorted(self._requests)}")
        if self.num_free_blocks != self.num_total_blocks:
            leaks.append(f"{self.num_total_blocks - self.num_free_blocks} blocks not free")
        for spec, pool in zip(self.ring_specs, self.slot_pools, strict=True):
            if pool.num_free_slots != pool.num_slots:
                leaks.append(f"{pool.num_slots - pool.num_free_slots} state slots of {spec.name} not free")
        return leaks
