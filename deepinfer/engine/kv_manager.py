"""The KV cache manager: `KVAllocator`'s block tables and state slots, plus prefix reuse over them.
Pure Python.

Prefix caching (`engine/prefix_cache.py` has the keys and the rules): a computed full block is
registered under its chained hash (`commit`); a new request takes the longest run of cached
units (`find_prefix`, then `allocate_slots(..., hit)`): shared blocks (touched), blocks read from
the cache directory (`CacheLoad`), and for ring models the snapshot at the hit boundary, which
the worker restores into the request's fresh state slots before its first step. A step's copies
(`step_ops`: loads, restore, capture) and the units the cache directory lacks (`take_persist`)
go out in the plan.

Parallel sampling: a sibling sample starts from the full prompt blocks of the sibling that
computed the prompt (`sibling_prefix`), shared like a prefix hit, also with prefix caching off.

Invariant (no leaks): every block, state slot and snapshot slot a request holds returns to its
pool when the request is freed (`free` extends `KVAllocator.free` with the snapshots);
`check_no_leaks()` verifies it. Cached blocks wait on the free list (ref_cnt 0) and snapshots in
their own pool: both count as free, and allocation evicts them least recently used first.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from deepinfer.contracts.plan import CacheLoad, CachePersist
from deepinfer.engine.block_pool import (
    BlockPool,
    KVBlock,
    PagedGroupSpec,
    RingGroupSpec,
    StateSlotPool,
)
from deepinfer.engine.kv_allocator import KVAllocator, RequestCache
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
    picture_key,
    snapshot_boundaries,
)

__all__ = ["BlockPool", "KVBlock", "KVCacheManager", "PagedGroupSpec", "PrefixHit", "RingGroupSpec", "StateSlotPool"]


@dataclass
class _ReusingRequest(RequestCache):
    """A request's cache plus its prefix-reuse state: what it committed, and its step's copies."""

    num_committed: list[int] = field(init=False)  # per paged group: blocks cached or hit
    loads: list[CacheLoad] = field(default_factory=list)  # saved units its next step reads
    restore_from: int | None = None  # snapshot slot its next step restores from
    pinned: Snapshot | None = None  # the in-memory snapshot restored from (kept until commit)
    loaded_snapshot: tuple | None = None  # (slot, key, boundary) of a snapshot read from disk
    capture: tuple | None = None  # (slot, key, boundary) its step copies into a snapshot slot
    stamp_ns: int = field(default_factory=time.time_ns)  # wall clock at admission: its saved units' recency

    def __post_init__(self):
        self.num_committed = [0] * len(self.block_tables)

    def held_snapshot_slots(self) -> list[int]:
        return [t[0] for t in (self.loaded_snapshot, self.capture) if t is not None]


class KVCacheManager(KVAllocator):
    """Per-request block tables (paged groups) and state slots (ring groups) over shared pools
    (`KVAllocator`), and the prefix cache over them.

    `allocate_slots` is all-or-nothing: it either covers the asked number of tokens in every
    group or changes nothing, also from a prefix hit.
    """

    _record_type = _ReusingRequest

    def __init__(self, group_specs: tuple[PagedGroupSpec | RingGroupSpec, ...], num_blocks: int,
                 num_state_slots: int = 0, prefix: PrefixSettings | None = None, unit: int = 16):
        super().__init__(group_specs, num_blocks, num_state_slots)
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

    # ---- prefix lookup ------------------------------------------------------------------
    def block_hashes(self, req) -> list[bytes]:
        """The request's unit hashes over its full units so far (kept on the request); a unit
        holding (part of) a picture's run keys that picture too (`picture_key`)."""
        hashes, u = req.block_hashes, self.unit
        adapter = req.lora.cache_key if req.lora is not None else None
        parent = hashes[-1] if hashes else chain_root(self.prefix.identity, req.cache_salt, adapter)
        for i in range(len(hashes), req.num_tokens // u):
            extra = picture_key(req.pictures, i * u, (i + 1) * u) if req.pictures else b""
            parent = chain_hash(parent, req.token_ids[i * u:(i + 1) * u], extra)
            hashes.append(parent)
        return hashes

    def find_prefix(self, req) -> PrefixHit:
        """The longest cached prefix of req's tokens, leaving at least its last token to compute.
        None for a request asking for prompt_logprobs or an embedding: every prompt position must be
        computed."""
        if not self.caching or req.sampling_params.prompt_logprobs is not None or req.pooling_params is not None:
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
                or req.sampling_params.prompt_logprobs is not None):
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
    def allocate_slots(self, request_id: str, num_tokens_total: int, hit: PrefixHit | None = None) -> bool:
        """Grow the request's block tables to cover `num_tokens_total` tokens (never shrinks);
        a new request may start from a prefix `hit` (its blocks are shared or read from disk).

        Returns False, changing nothing, when the free blocks or state slots do not suffice.
        """
        if hit is not None and hit.num_tokens:
            return self._allocate_hit(request_id, num_tokens_total, hit)
        return super().allocate_slots(request_id, num_tokens_total)

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

    def _load_block(self, cache: _ReusingRequest, gi: int, path: str, depth: int) -> KVBlock:
        (block,) = self.block_pool.allocate(1)
        cache.loads.append(CacheLoad(gi, block.block_id, path, _key_of(path), _recency(cache.stamp_ns, depth)))
        return block

    def _restore(self, cache: _ReusingRequest, hit: PrefixHit) -> None:
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

    # ---- after a step -------------------------------------------------------------------
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

    def _cache_blocks(self, gi: int, spec: PagedGroupSpec, cache: _ReusingRequest, hashes, done: int) -> None:
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
        """`KVAllocator.free`, and unpin the request's snapshot and give back the snapshot slots it
        held; a no-op if it holds nothing."""
        cache = self._requests.get(request_id)
        super().free(request_id)
        if cache is None:
            return
        if cache.pinned is not None:
            cache.pinned.ref_cnt -= 1
        for slot in cache.held_snapshot_slots():
            self.snapshots.give_back(slot)

    # ---- read-only views (the server's dashboard) -----------------------------------------
    def group_usage(self) -> tuple[tuple[tuple[str, int, int], ...], tuple[tuple[str, int, int], ...]]:
        """(paged, ring): per paged group (name, blocks its tables hold, blocks of the pool), per
        ring group (name, state slots held, slots in all). All paged groups draw from one pool, so
        each reports the pool's size as its total; with one group its used blocks are the pool's
        (no walk), with several each counts the distinct blocks its tables hold (shared once)."""
        total = self.num_total_blocks
        if len(self.paged_specs) == 1:
            paged = ((self.paged_specs[0].name, total - self.num_free_blocks, total),)
        else:
            tables = [c.block_tables for c in self._requests.values()]
            paged = tuple((spec.name, len(set().union(*(t[gi] for t in tables))), total)
                          for gi, spec in enumerate(self.paged_specs))
        rings = tuple((spec.name, pool.num_slots - pool.num_free_slots, pool.num_slots)
                      for spec, pool in zip(self.ring_specs, self.slot_pools, strict=True))
        return paged, rings

    def block_view(self, request_id: str) -> tuple[list[tuple[int, bool]], ...] | None:
        """Per paged group, the request's block table as (block id, registered in the prefix cache)
        pairs; None when it holds no cache (waiting, or freed)."""
        cache = self._requests.get(request_id)
        if cache is None:
            return None
        return tuple([(b.block_id, b.block_hash is not None) for b in table] for table in cache.block_tables)

    # ---- checks for tests ---------------------------------------------------------------
    def check_consistency(self) -> None:
        """`KVAllocator.check_consistency`, and snapshot slots add up."""
        super().check_consistency()
        self.snapshots.check([s for c in self._requests.values() for s in c.held_snapshot_slots()])

    def _leaks(self) -> list[str]:
        """Also snapshots still pinned (snapshots nobody pins count as free)."""
        leaks = super()._leaks()
        pinned = [s.slot for s in self.snapshots.by_key.values() if s.ref_cnt]
        if pinned:
            leaks.append(f"snapshots still pinned: slots {pinned}")
        return leaks



def _recency(stamp_ns: int, depth: int) -> int:
    """A saved unit's mtime: its request's admission time, less 1 µs per unit of depth, so that
    of one prefix the tail looks older than the head (evicted first, as in memory)."""
    return stamp_ns - depth * 1000


def _key_of(path: str) -> str:
    """The unit hash (hex) a saved file is named by."""
    return os.path.basename(path).split(".", 1)[0]
