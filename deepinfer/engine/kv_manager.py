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

Prefix caching (`engine/prefix_cache.py` has the keys and the rules): a computed full block is
registered under its chained hash (`commit`); a new request takes the longest run of cached
units (`find_prefix`, then `allocate_slots(..., hit)`): shared blocks (touched), blocks read from
the cache directory (`CacheLoad`), and for ring models the snapshot at the hit boundary, which
the worker restores into the request's fresh state slots before its first step.

Parallel sampling: a sibling sample starts from the full prompt blocks of the sibling that
computed the prompt (`sibling_prefix`), shared like a prefix hit, also with prefix caching off.

Invariant (no leaks): every block and state slot returns to its pool when the request is
freed, whether it finished, was aborted or was preempted; `check_no_leaks()` verifies it.
Cached blocks wait on the free list (ref_cnt 0) and snapshots in their own pool: both count as
free, and allocation evicts them least recently used first.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field

from deepinfer.contracts.plan import CacheLoad, CachePersist
from deepinfer.engine.block_pool import (
    BlockPool,
    KVBlock,
    PagedGroupSpec,
    RingGroupSpec,
    StateSlotPool,
    check_group_specs,
    check_positive,
)
from deepinfer.engine.prefix_cache import (
    SNAPSHOT,
    DiskIndex,
    KnownPrefixes,
    PrefixCacheStats,
    PrefixHit,
    PrefixSettings,
    Snapshot,
    SnapshotPool,
    chain_hash,
    chain_root,
    snapshot_boundaries,
)

__all__ = ["BlockPool", "KVBlock", "KVCacheManager", "PagedGroupSpec", "PrefixHit", "RingGroupSpec", "StateSlotPool"]


@dataclass
class _RequestCache:
    block_tables: tuple[list[KVBlock], ...]  # one per paged group
    state_ids: tuple[int, ...]  # one per ring group
    num_committed: list[int] = field(default_factory=list)  # per paged group: blocks cached or hit
    loads: list[CacheLoad] = field(default_factory=list)  # saved units its next step reads
    restore_from: int | None = None  # snapshot slot its next step restores from
    pinned: Snapshot | None = None  # the in-memory snapshot restored from (kept until commit)
    loaded_snapshot: tuple | None = None  # (slot, key, boundary) of a snapshot read from disk
    capture: tuple | None = None  # (slot, key, boundary) its step copies into a snapshot slot
    stamp_ns: int = field(default_factory=time.time_ns)  # wall clock at admission: its saved units' recency

    def held_snapshot_slots(self) -> list[int]:
        return [t[0] for t in (self.loaded_snapshot, self.capture) if t is not None]


class KVCacheManager:
    """Per-request block tables (paged groups) and state slots (ring groups) over shared pools,
    and the prefix cache over them.

    `allocate_slots` is all-or-nothing: it either covers the asked number of tokens in every
    group or changes nothing. A request's state slots are taken on its first allocation and,
    like its blocks, given back by `free`.
    """

    def __init__(self, group_specs: tuple[PagedGroupSpec | RingGroupSpec, ...], num_blocks: int,
                 num_state_slots: int = 0, prefix: PrefixSettings | None = None, unit: int = 16):
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
        self._requests: dict[str, _RequestCache] = {}
        self.max_num_tokens = self._max_num_tokens()
        self.prefix = prefix or PrefixSettings(enabled=False)
        # the hash unit: every paged block ends on a unit boundary
        self.unit = math.gcd(*(s.tokens_per_block for s in self.paged_specs)) if self.paged_specs else unit
        self.needs_snapshots = bool(self.ring_specs)  # a hit must restore ring rows and state
        # without snapshots a hit ends where every paged group's block ends (no partial block)
        self.hit_align = math.lcm(*(s.tokens_per_block for s in self.paged_specs)) if self.paged_specs else unit
        self.snapshots = SnapshotPool(self.prefix.num_snapshot_slots if self.needs_snapshots else 0)
        self.snapshot_interval = max(self.unit, self.prefix.snapshot_interval // self.unit * self.unit)
        self.known = KnownPrefixes()
        self.disk = DiskIndex(self.prefix.kv_cache_dir, self.prefix.identity)
        self.stats = PrefixCacheStats()
        self._persist: list[CachePersist] = []

    @property
    def caching(self) -> bool:
        """Prefix caching is on and can hit (ring models need snapshot slots)."""
        return self.prefix.enabled and (not self.needs_snapshots or self.snapshots.num_slots > 0)

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

    # ---- prefix lookup ------------------------------------------------------------------
    def block_hashes(self, req) -> list[bytes]:
        """The request's unit hashes over its full units so far (kept on the request)."""
        hashes, u = req.block_hashes, self.unit
        parent = hashes[-1] if hashes else chain_root(self.prefix.identity, req.cache_salt)
        for i in range(len(hashes), req.num_tokens // u):
            parent = chain_hash(parent, req.token_ids[i * u:(i + 1) * u])
            hashes.append(parent)
        return hashes

    def find_prefix(self, req) -> PrefixHit:
        """The longest cached prefix of req's tokens, leaving at least its last token to compute.
        None for a request asking for prompt_logprobs: every prompt position must be computed."""
        if not self.caching or req.sampling_params.prompt_logprobs is not None:
            return PrefixHit(blocks=tuple([] for _ in self.paged_specs))
        hashes = self.block_hashes(req)
        blocks: tuple[list, ...] = tuple([] for _ in self.paged_specs)
        best, sizes, snap = 0, [0] * len(blocks), None
        for i in range(1, (req.num_tokens - 1) // self.unit + 1):
            if not self._extend(blocks, hashes, i * self.unit):
                break
            found = self._snapshot_at(hashes[i - 1]) if self.needs_snapshots else None
            if found is not None or (not self.needs_snapshots and i * self.unit % self.hit_align == 0):
                best, sizes, snap = i * self.unit, [len(g) for g in blocks], found
        return PrefixHit(best, tuple(g[:n] for g, n in zip(blocks, sizes, strict=True)), snap,
                         hashes[best // self.unit - 1] if best else None)

    def sibling_prefix(self, req, source) -> PrefixHit:
        """The prompt blocks req may share with `source`, a sibling sample of the same prompt that
        still holds its cache: its full blocks below both its computed count and req's last token.
        Works without the prefix cache (the blocks are ref-counted, not looked up by hash).

        Nothing for ring models (a state slot holds one sequence's rows; their siblings share
        through snapshots when prefix caching is on) or a request asking for prompt_logprobs."""
        empty = PrefixHit(blocks=tuple([] for _ in self.paged_specs))
        cache = self._requests.get(source.request_id)
        if (cache is None or self.ring_specs or req.prompt_token_ids != source.prompt_token_ids
                or getattr(req.sampling_params, "prompt_logprobs", None) is not None):
            return empty
        limit = min(source.num_computed_tokens, req.num_prompt_tokens, req.num_tokens - 1)
        boundary = limit // self.hit_align * self.hit_align
        if boundary == 0:
            return empty
        return PrefixHit(boundary, tuple(table[:spec.num_blocks_for(boundary)]
                                         for spec, table in zip(self.paged_specs, cache.block_tables, strict=True)))

    def _extend(self, blocks: tuple[list, ...], hashes: list[bytes], boundary: int) -> bool:
        """Add each paged group's block that ends at `boundary` (cached, or a saved file); False
        if one is nowhere."""
        key = hashes[boundary // self.unit - 1]
        for gi, spec in enumerate(self.paged_specs):
            if boundary % spec.tokens_per_block:
                continue
            found = self.block_pool.cached.get((gi, key)) or self.disk.path(key, spec.name)
            if found is None:
                return False
            blocks[gi].append(found)
        return True

    def _snapshot_at(self, key: bytes) -> Snapshot | str | None:
        snap = self.snapshots.get(key)
        if snap is not None:
            return snap
        path = self.disk.path(key, SNAPSHOT)
        return path if path is not None and self.snapshots.can_take() else None

    def snapshot_boundaries(self, req, start: int) -> list[int]:
        """Where req (admitted with `start` tokens cached) takes snapshots; [] without rings."""
        if not self.caching or not self.needs_snapshots:
            return []
        hashes = self.block_hashes(req)
        known = self.known.longest(hashes[:(req.num_tokens - 1) // self.unit]) * self.unit
        return snapshot_boundaries(req.num_tokens, req.num_prompt_tokens, self.unit, self.snapshot_interval,
                                   start, known)

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

    def allocate_slots(self, request_id: str, num_tokens_total: int, hit: PrefixHit | None = None) -> bool:
        """Grow the request's block tables to cover `num_tokens_total` tokens (never shrinks);
        a new request may start from a prefix `hit` (its blocks are shared or read from disk).

        Returns False, changing nothing, when the free blocks or state slots do not suffice.
        """
        if hit is not None and hit.num_tokens:
            return self._allocate_hit(request_id, num_tokens_total, hit)
        if not self.can_allocate(request_id, num_tokens_total):
            return False
        num_new_blocks = self._num_new_blocks(request_id, num_tokens_total)
        cache = self._requests.get(request_id) or self._register(request_id)
        for table, num_new in zip(cache.block_tables, num_new_blocks, strict=True):
            table.extend(self.block_pool.allocate(num_new))
        return True

    def _allocate_hit(self, request_id: str, num_tokens_total: int, hit: PrefixHit) -> bool:
        if request_id in self._requests:
            raise RuntimeError(f"request {request_id!r} already holds cache; a prefix hit needs a new one")
        revived = sum(1 for g in hit.blocks for b in g if isinstance(b, KVBlock) and b.ref_cnt == 0)
        from_disk = sum(1 for g in hit.blocks for b in g if isinstance(b, str))
        fresh = sum(spec.num_blocks_for(num_tokens_total) - len(g) for spec, g in zip(self.paged_specs, hit.blocks,
                                                                                     strict=True))
        if revived + from_disk + fresh > self.num_free_blocks or not all(p.num_free_slots for p in self.slot_pools):
            return False
        if isinstance(hit.snapshot, str) and not self.snapshots.can_take():
            return False
        self.block_pool.touch(b for g in hit.blocks for b in g if isinstance(b, KVBlock))  # before any eviction
        cache = self._register(request_id)
        for gi, (spec, table, found) in enumerate(zip(self.paged_specs, cache.block_tables, hit.blocks, strict=True)):
            for j, b in enumerate(found):
                depth = (j + 1) * spec.tokens_per_block // self.unit
                table.append(b if isinstance(b, KVBlock) else self._load_block(cache, gi, b, depth))
            table.extend(self.block_pool.allocate(spec.num_blocks_for(num_tokens_total) - len(table)))
        self._restore(cache, hit)
        return True

    def _load_block(self, cache: _RequestCache, gi: int, path: str, depth: int) -> KVBlock:
        (block,) = self.block_pool.allocate(1)
        cache.loads.append(CacheLoad(gi, block.block_id, path, _key_of(path), _recency(cache.stamp_ns, depth)))
        return block

    def _restore(self, cache: _RequestCache, hit: PrefixHit) -> None:
        """Point the request's first step at the hit's snapshot (read from disk first if saved)."""
        if isinstance(hit.snapshot, Snapshot):
            hit.snapshot.ref_cnt += 1
            cache.pinned, cache.restore_from = hit.snapshot, hit.snapshot.slot
        elif isinstance(hit.snapshot, str):
            slot = self.snapshots.take_slot()
            recency = _recency(cache.stamp_ns, hit.num_tokens // self.unit)
            cache.loads.append(CacheLoad(-1, slot, hit.snapshot, hit.key.hex(), recency))
            cache.loaded_snapshot, cache.restore_from = (slot, hit.key, hit.num_tokens), slot

    def reserve_snapshot(self, req, boundary: int) -> None:
        """Ask req's step that ends at `boundary` to copy its rings and state into a snapshot
        slot (skipped when that snapshot exists or no slot can be had)."""
        cache = self._cache(req.request_id)
        key = self.block_hashes(req)[boundary // self.unit - 1]
        if cache.capture is not None or self.snapshots.get(key) is not None:
            return
        slot = self.snapshots.take_slot()
        if slot is not None:
            cache.capture = (slot, key, boundary)

    def step_ops(self, request_id: str) -> tuple[list[CacheLoad], int | None, int | None]:
        """(loads, restore_from, capture_to) for the request's step being scheduled."""
        cache = self._cache(request_id)
        return list(cache.loads), cache.restore_from, cache.capture[0] if cache.capture else None

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
                              tuple(pool.allocate() for pool in self.slot_pools),
                              [0] * len(self.paged_specs))
        self._requests[request_id] = cache
        return cache

    # ---- after a step ----------------------------------------------------------------------
    def commit(self, req) -> None:
        """After a step of req succeeded: register its newly full blocks and the snapshot its step
        took or read, and queue them for the cache directory."""
        cache = self._requests.get(req.request_id)
        if cache is None or not self.caching:
            return
        cache.loads, cache.restore_from = [], None
        if cache.pinned is not None:
            cache.pinned.ref_cnt -= 1
            cache.pinned = None
        if cache.loaded_snapshot is not None:
            self._keep_snapshot(*cache.loaded_snapshot, recency=None)
            cache.loaded_snapshot = None
        hashes = self.block_hashes(req)
        done = min(req.num_computed_tokens, len(hashes) * self.unit)
        for gi, spec in enumerate(self.paged_specs):
            self._cache_blocks(gi, spec, cache, hashes, done)
        if self.needs_snapshots:
            self.known.add(hashes[:done // self.unit])
        if cache.capture is not None:
            slot, key, boundary = cache.capture
            cache.capture = None
            if req.num_computed_tokens == boundary:
                self._keep_snapshot(slot, key, boundary, _recency(cache.stamp_ns, boundary // self.unit))
            else:
                self.snapshots.give_back(slot)

    def _cache_blocks(self, gi: int, spec: PagedGroupSpec, cache: _RequestCache, hashes, done: int) -> None:
        table, per_block = cache.block_tables[gi], spec.tokens_per_block
        full = min(done // per_block, len(table))
        for j in range(cache.num_committed[gi], full):
            depth = (j + 1) * per_block // self.unit
            key = hashes[depth - 1]
            if self.block_pool.cache(table[j], (gi, key)):
                self._queue_persist(gi, table[j].block_id, key, spec.name, _recency(cache.stamp_ns, depth))
        cache.num_committed[gi] = max(cache.num_committed[gi], full)

    def _keep_snapshot(self, slot: int, key: bytes, boundary: int, recency: int | None) -> None:
        """Register a snapshot; one just taken (`recency` set) is also queued for the directory."""
        if self.snapshots.register(slot, key, boundary) is not None and recency is not None:
            self.stats.num_snapshots_taken += 1
            self._queue_persist(-1, slot, key, SNAPSHOT, recency)

    def _queue_persist(self, gi: int, unit: int, key: bytes, kind: str, recency: int) -> None:
        path = self.disk.target(key, kind)
        if path is not None and not os.path.exists(path):
            self._persist.append(CachePersist(gi, unit, path, key.hex(), recency))

    def take_persist(self) -> list[CachePersist]:
        """Units registered since the last call that the cache directory lacks (for the next plan)."""
        persist, self._persist = self._persist, []
        return persist

    def forget_paths(self, paths, num_hit_tokens: int) -> None:
        """Saved files that failed to load: never looked up again in this process; the hit of
        `num_hit_tokens` they belonged to is not counted."""
        self.disk.bad_paths.update(paths)
        self.stats.num_load_failures += 1
        self.stats.retract(num_hit_tokens)

    def close_disk(self) -> None:
        """No more lookups in, or saves to, the cache directory (the runner closed it)."""
        self.disk.directory = None
        self._persist = []

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
        if cache.pinned is not None:
            cache.pinned.ref_cnt -= 1
        for slot in cache.held_snapshot_slots():
            self.snapshots.give_back(slot)

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
        """Each block's ref_cnt equals the number of tables holding it; free means ref_cnt 0;
        every cached block is registered under its own hash; snapshot slots add up."""
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
        self.snapshots.check([s for c in self._requests.values() for s in c.held_snapshot_slots()])

    def check_no_leaks(self) -> None:
        """Raise AssertionError unless every block and state slot is back in its pool (cached
        blocks and snapshots count as free: nobody holds them)."""
        self.check_consistency()
        leaks = []
        if self._requests:
            leaks.append(f"requests still holding cache: {sorted(self._requests)}")
        if self.num_free_blocks != self.num_total_blocks:
            leaks.append(f"{self.num_total_blocks - self.num_free_blocks} blocks not free")
        for spec, pool in zip(self.ring_specs, self.slot_pools, strict=True):
            if pool.num_free_slots != pool.num_slots:
                leaks.append(f"{pool.num_slots - pool.num_free_slots} state slots of {spec.name} not free")
        pinned = [s.slot for s in self.snapshots.by_key.values() if s.ref_cnt]
        if pinned:
            leaks.append(f"snapshots still pinned: slots {pinned}")
        if leaks:
            raise AssertionError("; ".join(leaks))


def _recency(stamp_ns: int, depth: int) -> int:
    """A saved unit's mtime: its request's admission time, less 1 µs per unit of depth, so that
    of one prefix the tail looks older than the head (evicted first, as in memory)."""
    return stamp_ns - depth * 1000


def _key_of(path: str) -> str:
    """The unit hash (hex) a saved file is named by."""
    return os.path.basename(path).split(".", 1)[0]
