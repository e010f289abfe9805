"""Which replica serves a request: the one most likely to hold its prefix, else the least loaded.

A request's routing key is a token list (`routing_key.py`). Its first `max_blocks` full blocks of
`block_size` tokens get chained hashes, as the engine's prefix cache chains its block hashes:

    tokens  [t0 .. t15][t16 .. t31][t32 .. t47] ...
    hashes   h0 = H(t0..15)   h1 = H(h0, t16..31)   h2 = H(h1, t32..47)

`hi` names the whole prefix up to block i, so a match of hi means the first i+1 blocks are the
same. The router remembers, for each hash it routed, the replica it sent it to (a bounded LRU
table). A request goes to the replica of its deepest remembered hash when that replica is up and
not overloaded (at most `max_imbalance` requests in flight more than the least loaded one);
otherwise to the least loaded replica (ties: the one with fewer requests routed so far). Either
way its hashes are then recorded as that replica's: the blocks it computes are cached there.

Plain data: no I/O, no clock; the front end feeds it replica states and loads.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ROUTING_POLICIES = ("prefix", "least-load", "random")
DEFAULT_MAX_BLOCKS = 32
DEFAULT_TABLE_SIZE = 200_000
DEFAULT_MAX_IMBALANCE = 4


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS) -> list[bytes]:
    """Chained hashes of the first `max_blocks` full blocks of `token_ids` (a partial block has none)."""
    hashes, parent = [], b""
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        block = ",".join(str(t) for t in token_ids[start:start + block_size]).encode()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class Route:
    """Where a request goes and why: `matched_blocks` of its prefix were routed to `rank` before."""

    rank: int
    matched_blocks: int
    reason: str  # "prefix", "least-load" or "random"


class PrefixRouter:
    """Prefix-affine, load-aware choice among the replicas that are up (module docstring)."""

    def __init__(self, policy: str = "prefix", *, table_size: int = DEFAULT_TABLE_SIZE,
                 max_imbalance: int = DEFAULT_MAX_IMBALANCE, seed: int | None = None):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"--data-parallel-routing {policy!r} is not one of {', '.join(ROUTING_POLICIES)}")
        self.policy = policy
        self.table_size = table_size
        self.max_imbalance = max_imbalance
        self._owner: OrderedDict[bytes, int] = OrderedDict()  # block hash -> rank, least recent first
        self._routed: dict[int, int] = {}  # rank -> requests routed to it so far
        self._random = random.Random(seed)

    def route(self, hashes: Sequence[bytes], loads: dict[int, int]) -> Route:
        """The replica for a request with these block hashes; `loads` maps each replica that is up to
        its requests in flight. ValueError when none is up."""
        if not loads:
            raise ValueError("no data-parallel replica is up")
        route = self._choose(hashes, loads)
        self._routed[route.rank] = self._routed.get(route.rank, 0) + 1
        if self.policy == "prefix":
            self._remember(hashes, route.rank)
        return route

    def forget(self, rank: int) -> None:
        """Drop what was routed to `rank` (it went down: its cache is gone)."""
        for h in [h for h, r in self._owner.items() if r == rank]:
            del self._owner[h]

    def _choose(self, hashes: Sequence[bytes], loads: dict[int, int]) -> Route:
        if self.policy == "random":
            return Route(self._random.choice(sorted(loads)), 0, "random")
        least = min(sorted(loads), key=lambda r: (loads[r], self._routed.get(r, 0)))
        if self.policy == "prefix":
            rank, depth = self._deepest_owner(hashes, loads)
            if depth and loads[rank] <= loads[least] + self.max_imbalance:
                return Route(rank, depth, "prefix")
        return Route(least, 0, "least-load")

    def _deepest_owner(self, hashes: Sequence[bytes], loads: dict[int, int]) -> tuple[int, int]:
        """(rank, blocks) of the deepest hash owned by a replica that is up; (-1, 0) for none."""
        for depth in range(len(hashes), 0, -1):
            rank = self._owner.get(hashes[depth - 1])
            if rank is not None and rank in loads:
                return rank, depth
        return -1, 0

    def _remember(self, hashes: Sequence[bytes], rank: int) -> None:
        for h in hashes:
            self._owner[h] = rank
            self._owner.move_to_end(h)
        while len(self._owner) > self.table_size:
            self._owner.popitem(last=False)
