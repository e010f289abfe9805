"""Automatic prefix caching: chained unit hashes, boundary snapshots, the saved-cache lookup.
Pure Python.

A cached unit is reused only for identical model inputs (seed 004: never because shapes
coincide). Its key chains over every earlier token from a root that fingerprints everything that
changes K/V (`StepRunner.cache_identity`: weights' content, attention config, dtype, row format,
cache layout) and the request's `cache_salt`:

    root = blake2b(identity ‖ salt ‖ adapter)      adapter: the LoRA adapter's content key, if any
    h_1  = blake2b(root ‖ tokens[0 : u])           u = the hash unit in tokens
    h_i  = blake2b(h_{i-1} ‖ tokens[(i-1)u : iu] ‖ pictures_i)
                                                   a paged block ending at token iu is keyed (group, h_i)

`pictures_i` names every picture whose placeholder run shares a position with unit i: its content
hash and its run's offset (`picture_key`; empty for a unit of text). The placeholder tokens of two
pictures are the same ids, so without it two different pictures would share blocks; with it the
same picture at the same place in a later request does. Every key derived from the chain (paged
blocks, snapshots, the saved files of the cache directory) follows.

A hit at boundary b needs, per cache group:
- paged (full attention, V4 compressed rows and index keys): every full block below b, shared;
- ring (sliding window): the last W rows before b; plus per-request state beside the rings (V4's
  compressor: open window, CSA half A, counts) and the rows of a paged block b falls inside.
  Those come from a *snapshot* taken when a request's computed count reached exactly b.

Snapshots are taken at chosen boundaries (`SnapshotPlanner`): every `interval` tokens, the last
unit boundary of the prompt, and the point where a new prompt leaves the longest prefix seen
before (so the next request with the same prefix hits all of it).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from deepinfer.contracts.kv_files import SNAPSHOT, unit_file

_DIGEST = 16
_MAX_KNOWN = 1 << 16  # unit hashes remembered as computed (for snapshot placement)


def chain_root(identity: str, cache_salt: str | None, adapter_key: str | None = None) -> bytes:
    """The root a request's hash chain starts from: the cache identity, its salt and its LoRA
    adapter's content key (`LoRAAdapter.cache_key`; None: the base model, whose root is unchanged)."""
    salt = b"\x00nosalt" if cache_salt is None else b"\x01" + cache_salt.encode()
    adapter = b"" if adapter_key is None else b"\x02lora\0" + adapter_key.encode()
    return hashlib.blake2b(b"deepinfer-prefix\0" + identity.encode() + salt + adapter, digest_size=_DIGEST).digest()


def chain_hash(parent: bytes, token_ids, extra: bytes = b"") -> bytes:
    """The key of the unit `token_ids` following the prefix keyed `parent`; `extra` is what else
    the unit's rows depend on (its pictures, `picture_key`)."""
    packed = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.blake2b(parent + packed + extra, digest_size=_DIGEST).digest()


def picture_key(pictures, start: int, stop: int) -> bytes:
    """What unit [start, stop) adds to its key for the pictures whose run overlaps it: each one's
    content hash and run offset (b"" when none does, so a text unit's key is unchanged)."""
    return b"".join(b"\x03pic\0" + p.content_hash.encode() + struct.pack("<q", p.offset)
                    for p in pictures if p.overlaps(start, stop))


@dataclass(eq=False)
class Snapshot:
    """Ring rows, per-request state and partial pages at `boundary`, held in snapshot slot `slot`.
    `ref_cnt` counts requests restoring from it this step (it cannot be evicted meanwhile)."""

    slot: int
    key: bytes
    boundary: int
    ref_cnt: int = 0


class SnapshotPool:
    """`num_slots` snapshot slots. A registered snapshot keeps its slot until the slot is needed;
    then the least recently used one nobody restores from is evicted."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self.by_key: OrderedDict[bytes, Snapshot] = OrderedDict()  # LRU first

    def get(self, key: bytes) -> Snapshot | None:
        snap = self.by_key.get(key)
        if snap is not None:
            self.by_key.move_to_end(key)
        return snap

    def can_take(self) -> bool:
        return bool(self._free) or any(s.ref_cnt == 0 for s in self.by_key.values())

    def take_slot(self) -> int | None:
        """A free slot, evicting the least recently used unpinned snapshot if none is free."""
        if not self._free:
            victim = next((s for s in self.by_key.values() if s.ref_cnt == 0), None)
            if victim is None:
                return None
            del self.by_key[victim.key]
            return victim.slot
        return self._free.popleft()

    def give_back(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"snapshot slot {slot} given back twice or never taken")
        self._free.append(slot)

    def register(self, slot: int, key: bytes, boundary: int) -> Snapshot | None:
        """Keep what slot holds as the snapshot of `key`; None (slot given back) if one exists."""
        if key in self.by_key:
            self.give_back(slot)
            return None
        snap = self.by_key[key] = Snapshot(slot, key, boundary)
        return snap

    def check(self, held: list[int]) -> None:
        """Every slot is free, registered or in `held` (pending captures), exactly once."""
        slots = list(self._free) + [s.slot for s in self.by_key.values()] + held
        if sorted(slots) != list(range(self.num_slots)):
            raise AssertionError(f"snapshot slots: free {sorted(self._free)}, registered "
                                 f"{sorted(s.slot for s in self.by_key.values())}, held {sorted(held)}")


@dataclass
class PrefixCacheStats:
    """Counters since start, in tokens (queries: prompt tokens looked up; hits: tokens not
    recomputed; disk_hits: those of them read from the cache directory)."""

    queries: int = 0
    hits: int = 0
    disk_hits: int = 0
    num_snapshots_taken: int = 0
    num_load_failures: int = 0

    def observe(self, num_tokens: int, num_hit: int, num_disk: int) -> None:
        """One admission: `num_tokens` looked up, `num_hit` of them cached (`num_disk` read from disk)."""
        self.queries += num_tokens
        self.hits += num_hit
        self.disk_hits += num_disk

    def retract(self, num_hit: int) -> None:
        """A disk hit of `num_hit` tokens that failed to load (the request started over)."""
        self.hits -= num_hit
        self.disk_hits -= num_hit

    def as_dict(self) -> dict:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_disk_hits": self.disk_hits,
                "prefix_cache_hit_rate": self.hits / self.queries if self.queries else 0.0,
                "prefix_cache_snapshots": self.num_snapshots_taken,
                "prefix_cache_load_failures": self.num_load_failures}


@dataclass
class PrefixSettings:
    """What the engine's prefix cache is built from (see `CacheConfig`)."""

    enabled: bool = True
    identity: str = ""  # StepRunner.cache_identity
    kv_cache_dir: str | None = None
    snapshot_interval: int = 512  # tokens between snapshots of a long prefill (ring models)
    num_snapshot_slots: int = 0


@dataclass
class DiskIndex:
    """Which saved units exist in the cache directory (a stat per lookup; no index to go stale)
    and which files failed to load (never tried again in this process)."""

    directory: str | None
    identity: str
    bad_paths: set[str] = field(default_factory=set)

    def path(self, key: bytes, kind: str) -> str | None:
        """The file of unit `key` of `kind` (a group name or SNAPSHOT) if it exists and is not bad."""
        if self.directory is None:
            return None
        path = unit_file(self.directory, self.identity, key.hex(), kind)
        return path if path not in self.bad_paths and os.path.exists(path) else None

    def target(self, key: bytes, kind: str) -> str | None:
        """Where unit `key` would be saved (None without a directory)."""
        return None if self.directory is None else unit_file(self.directory, self.identity, key.hex(), kind)


class KnownPrefixes:
    """Unit hashes some request computed in this process (bounded, LRU): where a new prompt
    leaves the longest prefix seen before, a snapshot there lets the next one hit all of it."""

    def __init__(self, max_entries: int = _MAX_KNOWN):
        self.max_entries = max_entries
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def add(self, hashes) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.max_entries:
            self._hashes.popitem(last=False)

    def longest(self, hashes: list[bytes]) -> int:
        """How many leading units of `hashes` were computed before."""
        n = 0
        while n < len(hashes) and hashes[n] in self._hashes:
            n += 1
        return n


def snapshot_boundaries(num_tokens: int, num_prompt: int, unit: int, interval: int, hit: int,
                        known: int) -> list[int]:
    """Where a ring model's request takes snapshots, ascending, all past its hit and below its
    last token: every `interval` tokens, the prompt's last unit boundary, and `known` (the end of
    the longest prefix computed before, where this prompt leaves it)."""
    last = (num_tokens - 1) // unit * unit
    points = set(range(interval, last + 1, interval))
    points.add((num_prompt - 1) // unit * unit)
    points.add(known)
    return sorted(p for p in points if hit < p <= last)


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a request: `num_tokens` tokens (a unit boundary, 0 for none),
    per paged group the full blocks below it (a cached `KVBlock`, or the path of a saved block),
    and the snapshot at the boundary (in memory, a saved file's path, or None when the model
    needs none). `key` is the boundary's unit hash."""

    num_tokens: int = 0
    blocks: tuple[list, ...] = ()
    snapshot: Snapshot | str | None = None
    key: bytes | None = None

    @property
    def num_disk_tokens(self) -> int:
        """Tokens of the hit whose rows come from the cache directory (0 or all of them)."""
        on_disk = isinstance(self.snapshot, str) or any(isinstance(b, str) for g in self.blocks for b in g)
        return self.num_tokens if on_disk else 0


__all__ = ["SNAPSHOT", "DiskIndex", "KnownPrefixes", "PrefixCacheStats", "PrefixHit", "PrefixSettings", "Snapshot",
           "SnapshotPool", "chain_hash", "chain_root", "picture_key", "snapshot_boundaries"]
