"""Automatic prefix caching on the CPU side: chained hashes, shared blocks, LRU eviction, ring
snapshots, snapshot slots and no leaks. Pure engine tests (no torch model).

Most tests drive `KVCacheManager` the way the scheduler does (find_prefix, allocate_slots with
the hit, reserve_snapshot at a boundary, commit after each chunk, free). The scheduler tests use
a fake runner that keeps a physical cache (paged rows, compressed rows, rings, per-request state
and snapshot slots, all addressed as the plan says): every row it reads back must hold the
request's own tokens, so a hit on the wrong blocks, a missing restore or a stale snapshot fails
the test, and the sampled tokens must equal a cache-free reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.config import SchedulerConfig
from deepinfer.contracts.plan import ModelOutput, SampleResult, StepPlan
from deepinfer.engine.kv_manager import KVCacheManager, PagedGroupSpec, PrefixHit, RingGroupSpec
from deepinfer.engine.prefix_cache import (
    PrefixSettings,
    Snapshot,
    SnapshotPool,
    chain_hash,
    chain_root,
    snapshot_boundaries,
)
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams

FULL = PagedGroupSpec("full", block_size=4)  # 4 tokens per block
COMP = PagedGroupSpec("comp", block_size=2, compress_ratio=4)  # one row per 4 tokens, 8 tokens per block
SWA = RingGroupSpec("swa", ring_size=8)
IDENTITY = "tiny-test-model"

PROMPT = [(7 * i + 3) % 101 + 1 for i in range(64)]  # a long shared prefix source


def make_kv(specs=(FULL,), num_blocks=16, num_state_slots=0, enabled=True, **prefix) -> KVCacheManager:
    return KVCacheManager(specs, num_blocks, num_state_slots,
                          prefix=PrefixSettings(enabled=enabled, identity=IDENTITY, **prefix), unit=4)


def make_req(rid: str, tokens, salt: str | None = None, max_tokens: int = 4) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_salt=salt)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> PrefixHit:
    """What the scheduler does on admission: the longest hit, then blocks for its first chunk."""
    hit = kv.find_prefix(req)
    req.snapshot_at = kv.snapshot_boundaries(req, hit.num_tokens)
    end = req.num_tokens if num_new is None else hit.num_tokens + num_new
    assert kv.allocate_slots(req.request_id, end, hit)
    req.num_computed_tokens = hit.num_tokens
    return hit


def compute(kv: KVCacheManager, req: Request, upto: int | None = None, snapshots: bool = True) -> None:
    """Compute req's tokens up to `upto` in chunks cut at its snapshot boundaries, reserving a
    snapshot at each boundary and committing after each chunk (as the scheduler and runner do)."""
    upto = req.num_tokens if upto is None else upto
    while req.num_computed_tokens < upto:
        start = req.num_computed_tokens
        end = min([upto] + [b for b in req.snapshot_at if b > start]) if snapshots else upto
        assert kv.allocate_slots(req.request_id, end)
        if snapshots and end in req.snapshot_at:
            kv.reserve_snapshot(req, end)
        req.num_computed_tokens = end
        kv.commit(req)
        kv.check_consistency()


def block_objs(kv: KVCacheManager, rid: str, group: int = 0):
    return [kv.block_pool.blocks[b] for b in kv.block_ids(rid)[group]]


# ---- hash chain -----------------------------------------------------------------------------------

def test_chain_root_depends_on_identity_and_salt():
    roots = [chain_root(i, s) for i in ("model-a", "model-b") for s in (None, "", "tenant-1", "tenant-2")]
    assert len(set(roots)) == len(roots), "identity and salt (None, '' and any string) must all give distinct roots"
    assert chain_root("model-a", "tenant-1") == chain_root("model-a", "tenant-1")


def test_chain_hash_depends_on_parent_and_every_token():
    root = chain_root(IDENTITY, None)
    h = chain_hash(root, [1, 2, 3, 4])
    assert h == chain_hash(root, [1, 2, 3, 4]) and len(h) == 16
    assert h != chain_hash(chain_root(IDENTITY, "s"), [1, 2, 3, 4])
    for i in range(4):
        other = [1, 2, 3, 4]
        other[i] += 1
        assert chain_hash(root, other) != h
    assert chain_hash(root, [70000, 1]) != chain_hash(root, [70000 - 65536, 2])  # token ids >= 2**16 are not folded
    assert chain_hash(root, [1, 2]) != chain_hash(root, [1, 2, 0])


def test_request_hashes_differ_from_the_first_changed_unit_on():
    kv = make_kv()
    base = make_req("a", PROMPT[:24])
    hashes = kv.block_hashes(base)
    assert len(hashes) == 6 and len(set(hashes)) == 6
    assert kv.block_hashes(make_req("same", PROMPT[:24])) == hashes
    for changed in (0, 5, 11, 23):
        tokens = list(PROMPT[:24])
        tokens[changed] += 1000
        other = kv.block_hashes(make_req(f"c{changed}", tokens))
        unit = changed // 4
        assert other[:unit] == hashes[:unit]
        assert all(o != h for o, h in zip(other[unit:], hashes[unit:], strict=True)), changed
    assert all(a != b for a, b in zip(kv.block_hashes(make_req("s", PROMPT[:24], salt="x")), hashes, strict=True))


def test_request_hashes_grow_with_outputs_and_match_a_longer_prompt():
    kv = make_kv()
    req = make_req("a", PROMPT[:10])
    assert len(kv.block_hashes(req)) == 2
    req.append_output(PROMPT[10])
    req.append_output(PROMPT[11])
    assert kv.block_hashes(req) == kv.block_hashes(make_req("b", PROMPT[:12]))


@pytest.mark.subprocess
def test_hashes_are_stable_across_processes():
    """Saved files are named by these keys: they must not depend on the process (hash seeds)."""
    code = ("from deepinfer.engine.prefix_cache import chain_hash, chain_root; "
            "print(chain_hash(chain_root('id', 'salt'), [1, 2, 3, 70000]).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {chain_hash(chain_root("id", "salt"), [1, 2, 3, 70000]).hex()}


# ---- paged groups: hits on freed blocks --------------------------------------------------------------

def test_freed_full_blocks_are_found_by_the_same_prefix():
    kv = make_kv(num_blocks=16)
    a = make_req("a", PROMPT[:10])
    admit(kv, a)
    compute(kv, a)
    a_blocks = block_objs(kv, "a")
    assert kv.num_cached_blocks == 2, "the partial block (tokens 8, 9) must not be cached"
    assert a_blocks[2].block_hash is None
    kv.free("a")
    kv.check_no_leaks()  # cached blocks count as free

    b = make_req("b", PROMPT[:10])
    hit = admit(kv, b)
    assert hit.num_tokens == 8 and hit.blocks[0] == a_blocks[:2]
    assert b.num_computed_tokens == 8
    b_blocks = block_objs(kv, "b")
    # b's third block is a's partial one: holding nothing findable, it was reused first
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] is a_blocks[2]
    assert [blk.ref_cnt for blk in b_blocks] == [1, 1, 1]

    c = make_req("c", PROMPT[:8])  # exactly two blocks: the last token must be computed
    assert admit(kv, c).num_tokens == 4
    assert [blk.ref_cnt for blk in b_blocks[:2]] == [2, 1], "shared block counts both holders"
    assert block_objs(kv, "c")[0] is a_blocks[0] and block_objs(kv, "c")[1] is not a_blocks[1]
    assert kv.find_prefix(make_req("c9", PROMPT[:9])).num_tokens == 8
    assert kv.find_prefix(make_req("d", PROMPT[:6] + [999] * 10)).num_tokens == 4
    assert kv.find_prefix(make_req("e", PROMPT[:10], salt="other")).num_tokens == 0
    assert kv.find_prefix(make_req("f", [999] + PROMPT[1:10])).num_tokens == 0
    kv.check_consistency()
    for rid in ("b", "c"):
        kv.free(rid)
    kv.check_no_leaks()
    assert all(blk.ref_cnt == 0 for blk in a_blocks)


def test_partial_last_block_is_shared_only_once_full():
    kv = make_kv(num_blocks=16)
    a = make_req("a", PROMPT[:10], max_tokens=8)
    admit(kv, a)
    compute(kv, a)
    # while a is still running with a partial third block, another request gets two blocks only
    g = make_req("g", PROMPT[:16])
    assert kv.find_prefix(g).num_tokens == 8
    for t in PROMPT[10:12]:  # two decode steps fill the third block
        a.append_output(t)
    compute(kv, a, upto=12)
    assert kv.num_cached_blocks == 3
    hit = admit(kv, g)
    assert hit.num_tokens == 12 and block_objs(kv, "g")[:3] == block_objs(kv, "a")[:3]
    kv.free("a")
    kv.free("g")
    kv.check_no_leaks()


def test_running_requests_with_one_prefix_share_blocks():
    kv = make_kv(num_blocks=32)
    first = make_req("r0", PROMPT[:20])
    admit(kv, first)
    compute(kv, first)
    reqs = [make_req(f"r{i}", PROMPT[:16] + [500 + i] * 3) for i in range(1, 4)]
    for r in reqs:
        assert admit(kv, r).num_tokens == 16
    shared = block_objs(kv, "r0")[:4]
    assert [blk.ref_cnt for blk in shared] == [4] * 4
    assert kv.num_free_blocks == 32 - 5 - 3  # r0: 5 blocks; each other: one fresh block
    for r in [first] + reqs:
        kv.free(r.request_id)
    kv.check_no_leaks()


def test_no_hit_and_no_cached_blocks_when_disabled():
    kv = make_kv(enabled=False)
    a = make_req("a", PROMPT[:10])
    admit(kv, a)
    compute(kv, a)
    kv.free("a")
    assert kv.num_cached_blocks == 0 and not kv.caching
    assert kv.find_prefix(make_req("b", PROMPT[:10])).num_tokens == 0
    kv.check_no_leaks()


def test_compressed_group_hits_only_at_its_block_boundaries():
    """FULL (4 tokens/block) + COMP (8 tokens/block): without rings a hit must end where every
    paged group's block ends, or the compressed partial page would be missing."""
    kv = make_kv(specs=(FULL, COMP), num_blocks=32)
    assert kv.unit == 4
    a = make_req("a", PROMPT[:30])
    admit(kv, a)
    compute(kv, a)
    kv.free("a")
    hit = kv.find_prefix(make_req("b", PROMPT[:30]))
    assert hit.num_tokens == 24 and [len(g) for g in hit.blocks] == [6, 3]
    hit = kv.find_prefix(make_req("c", PROMPT[:13]))  # 12 is a FULL edge inside a COMP block
    assert hit.num_tokens % 8 == 0, f"hit at {hit.num_tokens}: inside a compressed block, with no snapshot"


# ---- LRU eviction ---------------------------------------------------------------------------------

def test_cached_blocks_are_evicted_only_when_needed_longest_prefix_first():
    kv = make_kv(num_blocks=8)
    a = make_req("a", PROMPT[:13])  # 4 blocks: 3 full (cached), 1 partial
    admit(kv, a)
    compute(kv, a)
    a_blocks = block_objs(kv, "a")
    kv.free("a")
    assert kv.num_cached_blocks == 3
    # a's partial block (nothing findable: reused first) and 3 never-used blocks: evicts nothing
    x = make_req("x", [900 + i for i in range(16)])
    admit(kv, x)
    assert block_objs(kv, "x")[0] is a_blocks[3] and a_blocks[3] not in block_objs(kv, "x")[1:]
    assert kv.num_cached_blocks == 3 and kv.block_pool.num_evicted == 0
    assert kv.find_prefix(make_req("probe", PROMPT[:13])).num_tokens == 12
    # the last never-used block before any cached one
    y = make_req("y", [800])
    admit(kv, y)
    assert block_objs(kv, "y")[0] not in a_blocks and kv.num_cached_blocks == 3
    z = make_req("z", [700] * 5)  # 2 blocks: evicts a's third, then second block
    admit(kv, z)
    assert block_objs(kv, "z") == [a_blocks[2], a_blocks[1]]
    assert kv.block_pool.num_evicted == 2 and kv.num_cached_blocks == 1
    assert a_blocks[1].block_hash is None and a_blocks[2].block_hash is None, "an evicted block drops its hash"
    assert kv.find_prefix(make_req("probe2", PROMPT[:13])).num_tokens == 4
    kv.check_consistency()
    for rid in ("x", "y", "z"):
        kv.free(rid)
    kv.check_no_leaks()


def test_least_recently_used_request_is_evicted_first():
    kv = make_kv(num_blocks=6)
    a, b = make_req("a", PROMPT[:9]), make_req("b", [300 + i for i in range(9)])
    for r in (a, b):
        admit(kv, r)
        compute(kv, r)
    kv.free("a")
    kv.free("b")  # a freed longest ago
    assert kv.num_cached_blocks == 4
    c = make_req("c", [5] * 7)  # 2 blocks: b's and a's partial blocks (nothing findable), no eviction
    admit(kv, c)
    assert kv.block_pool.num_evicted == 0
    assert kv.find_prefix(make_req("pa", PROMPT[:9])).num_tokens == 8
    assert kv.find_prefix(make_req("pb", [300 + i for i in range(9)])).num_tokens == 8
    kv.free("c")
    # a hit makes a block recently used again: b's blocks are reused by a later request, then freed
    d = make_req("d", [300 + i for i in range(9)])
    assert admit(kv, d).num_tokens == 8
    compute(kv, d)
    kv.free("d")
    # d took b's two cached blocks off the free list, and a partial one as its third
    e = make_req("e", [6] * 13)  # 4 blocks: the two partial ones, then a's cached (least recently used)
    admit(kv, e)
    assert kv.find_prefix(make_req("pa2", PROMPT[:9])).num_tokens == 0
    assert kv.find_prefix(make_req("pb2", [300 + i for i in range(9)])).num_tokens == 8
    kv.free("e")
    kv.check_no_leaks()


def test_hit_on_a_freed_block_takes_it_off_the_free_list():
    kv = make_kv(num_blocks=4)
    a = make_req("a", PROMPT[:9])
    admit(kv, a)
    compute(kv, a)
    kv.free("a")
    b = make_req("b", PROMPT[:9])
    admit(kv, b)  # 2 revived + 1 fresh
    assert kv.num_free_blocks == 1
    assert not kv.allocate_slots("c", 8)  # 2 blocks do not fit: nothing changes
    assert not kv.has_request("c") and kv.num_free_blocks == 1
    # a hit needing more blocks than are free is refused whole
    kv.free("b")
    kv.check_no_leaks()
    big = make_req("big", PROMPT[:8] + [1] * 12)  # hit 8, then 3 more blocks: 5 > 4
    hit = kv.find_prefix(big)
    assert hit.num_tokens == 8
    assert not kv.allocate_slots("big", big.num_tokens, hit)
    assert not kv.has_request("big") and kv.num_free_blocks == 4 and kv.num_cached_blocks == 2
    kv.check_no_leaks()


# ---- ring groups: snapshots ------------------------------------------------------------------------

def test_snapshot_boundaries():
    assert snapshot_boundaries(40, 40, 4, 16, 0, 0) == [16, 32, 36]
    assert snapshot_boundaries(40, 40, 4, 16, 16, 0) == [32, 36]
    assert snapshot_boundaries(40, 40, 4, 16, 0, 20) == [16, 20, 32, 36]
    assert snapshot_boundaries(41, 41, 4, 16, 0, 0) == [16, 32, 40]
    assert snapshot_boundaries(5, 5, 4, 16, 4, 4) == []
    assert snapshot_boundaries(52, 40, 4, 16, 0, 0) == [16, 32, 36, 48]  # a recompute: outputs too


def test_ring_model_needs_snapshot_slots():
    kv = make_kv(specs=(FULL, SWA), num_state_slots=2, num_snapshot_slots=0)
    assert not kv.caching
    a = make_req("a", PROMPT[:20])
    admit(kv, a)
    compute(kv, a)
    kv.free("a")
    assert kv.num_cached_blocks == 0
    assert kv.find_prefix(make_req("b", PROMPT[:20])).num_tokens == 0
    kv.check_no_leaks()


def test_ring_hit_only_at_a_snapshot():
    kv = make_kv(specs=(FULL, SWA), num_state_slots=2, num_snapshot_slots=4, snapshot_interval=8)
    assert kv.caching and kv.snapshot_interval == 8
    a = make_req("a", PROMPT[:20])
    admit(kv, a)
    compute(kv, a, snapshots=False)  # blocks cached, but no snapshot anywhere
    kv.free("a")
    assert kv.num_cached_blocks == 5
    assert kv.find_prefix(make_req("b", PROMPT[:20])).num_tokens == 0, "rings cannot be rebuilt from blocks"

    c = make_req("c", PROMPT[:20])
    admit(kv, c)
    assert c.snapshot_at == [8, 16]
    compute(kv, c)
    assert {s.boundary for s in kv.snapshots.by_key.values()} == {8, 16}
    assert kv.stats.num_snapshots_taken == 2
    kv.free("c")
    kv.check_no_leaks()

    d = make_req("d", PROMPT[:20])
    hit = admit(kv, d)
    assert hit.num_tokens == 16 and isinstance(hit.snapshot, Snapshot) and hit.snapshot.boundary == 16
    loads, restore_from, capture_to = kv.step_ops("d")
    assert loads == [] and restore_from == hit.snapshot.slot and capture_to is None
    assert hit.snapshot.ref_cnt == 1
    kv.free("never-admitted")  # a no-op
    with pytest.raises(AssertionError, match="snapshots still pinned"):
        kv.check_no_leaks()  # while d restores from the snapshot
    compute(kv, d)
    assert hit.snapshot.ref_cnt == 0 and kv.step_ops("d")[1] is None, "restored once, then unpinned"
    # a prompt that leaves the prefix between snapshots hits the last snapshot before it
    assert kv.find_prefix(make_req("e", PROMPT[:14] + [999] * 6)).num_tokens == 8
    assert kv.find_prefix(make_req("f", PROMPT[:7] + [999] * 6)).num_tokens == 0
    kv.free("d")
    kv.check_no_leaks()


def test_snapshot_where_a_new_prompt_leaves_a_known_prefix():
    """The second request with a prefix takes a snapshot where it leaves the first one's tokens,
    so the third request with that prefix hits all of it."""
    kv = make_kv(specs=(FULL, SWA), num_state_slots=2, num_snapshot_slots=8, snapshot_interval=64)
    first = make_req("a", PROMPT[:22] + [900] * 10)
    admit(kv, first)
    assert first.snapshot_at == [28]  # only the prompt's last unit boundary
    compute(kv, first)
    kv.free("a")
    second = make_req("b", PROMPT[:22] + [800] * 10)
    hit = admit(kv, second)
    assert hit.num_tokens == 0 and second.snapshot_at == [20, 28]  # 20: where it leaves a's tokens
    compute(kv, second)
    kv.free("b")
    third = make_req("c", PROMPT[:22] + [700] * 10)
    assert admit(kv, third).num_tokens == 20
    compute(kv, third)
    kv.free("c")
    kv.check_no_leaks()


def test_ring_only_model_hits_at_snapshots():
    kv = make_kv(specs=(SWA,), num_blocks=0, num_state_slots=2, num_snapshot_slots=2, snapshot_interval=8)
    assert kv.unit == 4 and kv.caching
    a = make_req("a", PROMPT[:18])
    admit(kv, a)
    assert a.snapshot_at == [8, 16]
    compute(kv, a)
    kv.free("a")
    b = make_req("b", PROMPT[:18])
    hit = admit(kv, b)
    assert hit.num_tokens == 16 and hit.blocks == ()
    compute(kv, b)
    kv.free("b")
    kv.check_no_leaks()


def test_compressed_partial_page_comes_with_the_snapshot():
    """Rings + a compressed group: a hit at 12 (inside the 8-token COMP block 1) is allowed, the
    COMP block itself is fresh (its rows come from the snapshot's partial page)."""
    kv = make_kv(specs=(SWA, FULL, COMP), num_blocks=32, num_state_slots=2, num_snapshot_slots=4,
                 snapshot_interval=64)
    a = make_req("a", PROMPT[:14])
    admit(kv, a)
    assert a.snapshot_at == [12]
    compute(kv, a)
    kv.free("a")
    b = make_req("b", PROMPT[:14])
    hit = admit(kv, b)
    assert hit.num_tokens == 12 and [len(g) for g in hit.blocks] == [3, 1]
    comp_blocks = kv.block_ids("b")[1]
    assert len(comp_blocks) == 2 and kv.block_pool.blocks[comp_blocks[1]].block_hash is None
    kv.free("b")
    kv.check_no_leaks()


# ---- snapshot slots ---------------------------------------------------------------------------------

def test_snapshot_pool_evicts_least_recently_used_unpinned():
    pool = SnapshotPool(3)
    slots = [pool.take_slot() for _ in range(3)]
    assert slots == [0, 1, 2] and pool.take_slot() is None and not pool.can_take()
    k = [bytes([i]) * 16 for i in range(5)]
    snaps = [pool.register(slot, k[i], 4 * (i + 1)) for i, slot in enumerate(slots)]
    assert pool.get(k[0]) is snaps[0]  # k0 is most recently used now: LRU order k1, k2, k0
    snaps[1].ref_cnt = 1  # pinned: restored from this step
    assert pool.can_take()
    assert pool.take_slot() == snaps[2].slot and k[2] not in pool.by_key
    assert pool.register(snaps[2].slot, k[3], 16) is not None
    assert pool.take_slot() == snaps[0].slot  # k0 before k3 (LRU), k1 pinned
    pool.check(held=[snaps[0].slot])
    pool.by_key[k[3]].ref_cnt = 1
    assert pool.take_slot() is None and not pool.can_take(), "every registered snapshot is pinned"
    assert pool.register(snaps[0].slot, k[1], 4) is None, "a duplicate key gives its slot back"
    pool.check(held=[])
    with pytest.raises(RuntimeError, match="given back twice"):
        pool.give_back(snaps[0].slot)
    with pytest.raises(AssertionError, match="snapshot slots"):
        pool.check(held=[0])


def test_pinned_snapshot_survives_other_captures():
    kv = make_kv(specs=(FULL, SWA), num_state_slots=4, num_snapshot_slots=2, snapshot_interval=8)
    a = make_req("a", PROMPT[:18])
    admit(kv, a)
    compute(kv, a)  # snapshots at 8 and 16 fill both slots
    kv.free("a")
    assert len(kv.snapshots.by_key) == 2
    b = make_req("b", PROMPT[:18])
    hit = admit(kv, b)  # restores (pins) the snapshot at 16
    assert hit.num_tokens == 16 and hit.snapshot.ref_cnt == 1
    # two other prompts capture: the first evicts the unpinned snapshot at 8, the second finds no slot
    c, d = make_req("c", [600 + i for i in range(18)]), make_req("d", [400 + i for i in range(18)])
    for r in (c, d):
        admit(kv, r, num_new=8)
        kv.reserve_snapshot(r, 8)
    assert kv.step_ops("c")[2] is not None and kv.step_ops("d")[2] is None
    assert hit.snapshot.key in kv.snapshots.by_key and len(kv.snapshots.by_key) == 1
    kv.check_consistency()
    for r in (c, d):
        r.num_computed_tokens = 8
        kv.commit(r)
    assert len(kv.snapshots.by_key) == 2
    kv.commit(b)  # b's first step ran: the pin is released
    assert hit.snapshot.ref_cnt == 0
    for rid in ("b", "c", "d"):
        kv.free(rid)
    kv.check_no_leaks()


def test_snapshot_slots_come_back_after_abort_before_commit():
    kv = make_kv(specs=(FULL, SWA), num_state_slots=4, num_snapshot_slots=2, snapshot_interval=8)
    a = make_req("a", PROMPT[:18])
    admit(kv, a)
    compute(kv, a)
    kv.free("a")
    # b restores from a snapshot and c reserves a capture; both are freed before their step commits
    b, c = make_req("b", PROMPT[:18]), make_req("c", [600 + i for i in range(18)])
    hit = admit(kv, b)
    admit(kv, c, num_new=8)
    kv.reserve_snapshot(c, 8)
    capture = kv.step_ops("c")[2]
    assert capture is not None and hit.snapshot.ref_cnt == 1
    kv.check_consistency()
    kv.free("b")
    kv.free("c")
    assert hit.snapshot.ref_cnt == 0 and capture in kv.snapshots._free
    kv.check_no_leaks()
    assert kv.find_prefix(make_req("b2", PROMPT[:18])).num_tokens == 16


def test_capture_not_at_its_boundary_gives_the_slot_back():
    """A step reserved a snapshot at 8 but the request ends up elsewhere (e.g. a verify step):
    the slot is returned, nothing is registered."""
    kv = make_kv(specs=(FULL, SWA), num_state_slots=2, num_snapshot_slots=2, snapshot_interval=8)
    a = make_req("a", PROMPT[:18])
    admit(kv, a, num_new=8)
    kv.reserve_snapshot(a, 8)
    a.num_computed_tokens = 12
    assert kv.allocate_slots("a", 12)
    kv.commit(a)
    assert len(kv.snapshots.by_key) == 0 and len(kv.snapshots._free) == 2
    kv.free("a")
    kv.check_no_leaks()


# ---- leaks -----------------------------------------------------------------------------------------

def test_check_no_leaks_counts_cached_blocks_as_free_and_catches_holders():
    kv = make_kv(num_blocks=8)
    a = make_req("a", PROMPT[:12])
    admit(kv, a)
    compute(kv, a)
    with pytest.raises(AssertionError, match=r"requests still holding cache: \['a'\]"):
        kv.check_no_leaks()
    kv.free("a")
    kv.free("a")  # a no-op
    assert kv.num_cached_blocks == 3 and kv.num_free_blocks == 8
    kv.check_no_leaks()
    kv.block_pool.touch([kv.block_pool.blocks[0]])  # someone holds a block outside any table
    with pytest.raises(AssertionError):
        kv.check_no_leaks()


def test_check_no_leaks_catches_a_held_state_slot():
    kv = make_kv(specs=(FULL, SWA), num_state_slots=2, num_snapshot_slots=2)
    a = make_req("a", PROMPT[:6])
    admit(kv, a)
    with pytest.raises(AssertionError, match="requests still holding cache"):
        kv.check_no_leaks()
    kv.free("a")
    kv.check_no_leaks()


# ---- the scheduler with a fake runner that keeps a physical cache ----------------------------------

S = SWA.ring_size


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic token from the whole context."""
    return 200 + zlib.crc32(repr(context).encode()) % 800


def reference(req: Request) -> list[int]:
    context, out = list(req.prompt_token_ids), []
    for _ in range(req.sampling_params.max_tokens):
        out.append(next_token(context))
        context.append(out[-1])
    return out


class PhysicalRunner:
    """Stores every computed token where the plan says (paged rows, compressed rows, ring rows,
    per-request open window), restores and captures snapshots, and checks on every sample that
    all it reads back is the request's own tokens."""

    def __init__(self, kv: KVCacheManager):
        self.specs = kv.group_specs
        self.paged = [s for s in self.specs if isinstance(s, PagedGroupSpec)]
        self.has_ring = any(isinstance(s, RingGroupSpec) for s in self.specs)
        self.first_snapshot = kv.slot_pools[0].num_slots if self.has_ring else 0
        self.pages: dict[tuple, dict[int, object]] = {}  # (paged index, block id) -> {row: content}
        self.ring: dict[tuple[int, int], tuple[int, int]] = {}  # (unit, row) -> (position, token)
        self.window: dict[int, list[int]] = {}  # unit -> open compressor window (tokens)
        self.snap_pages: dict[tuple[int, int], dict[int, object]] = {}  # (snapshot slot, paged index) -> page
        self.num_restores = self.num_captures = 0

    def _row(self, spec: PagedGroupSpec, pos: int) -> int:
        return pos // spec.compress_ratio

    def _write(self, s, pos: int, token: int) -> None:
        for pi, spec in enumerate(self.paged):
            if spec.compress_ratio == 1:
                self.pages.setdefault((pi, s.block_ids[pi][pos // spec.block_size]), {})[pos % spec.block_size] = \
                    (pos, token)
        if self.has_ring:
            sid = s.state_ids[0]
            self.ring[(sid, pos % S)] = (pos, token)
            window = self.window.setdefault(sid, [])
            window.append(token)
            if (pos + 1) % 4 == 0:
                for pi, spec in enumerate(self.paged):
                    if spec.compress_ratio == 4:
                        row = pos // 4
                        self.pages.setdefault((pi, s.block_ids[pi][row // spec.block_size]), {})[
                            row % spec.block_size] = (row, tuple(window))
                self.window[sid] = []

    def _partial(self, spec: PagedGroupSpec, boundary: int) -> int | None:
        rows = boundary // spec.compress_ratio
        return rows // spec.block_size if rows % spec.block_size else None

    def _restore(self, s) -> None:
        unit, sid = self.first_snapshot + s.restore_from, s.state_ids[0]
        for r in range(S):
            if (unit, r) in self.ring:
                self.ring[(sid, r)] = self.ring[(unit, r)]
            else:
                self.ring.pop((sid, r), None)
        self.window[sid] = list(self.window.get(unit, []))
        for pi, spec in enumerate(self.paged):
            j = self._partial(spec, s.start_pos)
            if j is not None:
                self.pages[(pi, s.block_ids[pi][j])] = dict(self.snap_pages[(s.restore_from, pi)])
        self.num_restores += 1

    def _capture(self, s) -> None:
        unit, sid = self.first_snapshot + s.capture_to, s.state_ids[0]
        for r in range(S):
            if (sid, r) in self.ring:
                self.ring[(unit, r)] = self.ring[(sid, r)]
        self.window[unit] = list(self.window.get(sid, []))
        boundary = s.start_pos + s.num_tokens
        for pi, spec in enumerate(self.paged):
            j = self._partial(spec, boundary)
            if j is not None:
                self.snap_pages[(s.capture_to, pi)] = dict(self.pages.get((pi, s.block_ids[pi][j]), {}))
        self.num_captures += 1

    def _check(self, s, tokens: list[int]) -> None:
        end = len(tokens)
        for pi, spec in enumerate(self.paged):
            rows = end // spec.compress_ratio
            for row in range(rows):
                page = self.pages.get((pi, s.block_ids[pi][row // spec.block_size]), {})
                got = page.get(row % spec.block_size)
                want = (row, tuple(tokens[4 * row:4 * row + 4])) if spec.compress_ratio == 4 else (row, tokens[row])
                assert got == want, f"{s.request_id}: {spec.name} row {row} holds {got}, expected {want}"
        if self.has_ring:
            sid = s.state_ids[0]
            for pos in range(max(0, end - S), end):
                assert self.ring.get((sid, pos % S)) == (pos, tokens[pos]), f"{s.request_id}: ring row of {pos}"
            if any(spec.compress_ratio == 4 for spec in self.paged):
                assert self.window.get(sid) == tokens[end // 4 * 4:end], f"{s.request_id}: open window"

    def execute(self, plan: StepPlan) -> ModelOutput:
        assert not plan.persist, "no cache directory here"
        for s in plan.scheduled:
            assert not s.loads
            if s.restore_from is not None:
                self._restore(s)
            elif self.has_ring and s.start_pos == 0:
                self.window[s.state_ids[0]] = []
        samples = {}
        for s in plan.scheduled:
            for pos, token in enumerate(s.token_ids, start=s.start_pos):
                self._write(s, pos, token)
            if s.do_sample:
                tokens = list(s.prompt_token_ids) + list(s.output_token_ids)
                assert len(tokens) == s.start_pos + s.num_tokens
                self._check(s, tokens)
                samples[s.request_id] = [SampleResult(next_token(tokens), -1.0)]
        for s in plan.scheduled:
            if s.capture_to is not None:
                self._capture(s)
        return ModelOutput(samples)


class Harness:
    def __init__(self, specs, num_blocks=64, num_state_slots=0, num_snapshot_slots=0, budget=7,
                 max_num_seqs=4, interval=8):
        self.kv = make_kv(specs, num_blocks, num_state_slots, num_snapshot_slots=num_snapshot_slots,
                          snapshot_interval=interval)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget), self.kv, 512)
        self.runner = PhysicalRunner(self.kv)
        self.reqs: dict[str, Request] = {}
        self.num_steps = 0

    def add(self, rid, tokens, salt=None, max_tokens=4) -> Request:
        req = make_req(rid, tokens, salt, max_tokens)
        self.sched.add_request(req)
        self.reqs[rid] = req
        return req

    def step(self) -> None:
        plan = self.sched.schedule()
        self.sched.update(plan, self.runner.execute(plan))
        self.kv.check_consistency()
        self.num_steps += 1

    def run(self, abort: dict[int, str] | None = None) -> None:
        while self.sched.has_unfinished_requests():
            assert self.num_steps < 5000, "no progress"
            if abort and self.num_steps in abort:
                self.sched.abort_request(abort[self.num_steps])
            self.step()
        self.kv.check_no_leaks()

    def check_outputs(self, aborted=()) -> None:
        for rid, req in self.reqs.items():
            if rid in aborted:
                assert req.status is RequestStatus.FINISHED_ABORTED
                continue
            assert req.status is RequestStatus.FINISHED_LENGTH, (rid, req.status)
            assert req.output_token_ids == reference(req), rid


CONFIGS = {
    "paged": dict(specs=(FULL,)),
    "ring": dict(specs=(SWA,), num_blocks=0, num_state_slots=3, num_snapshot_slots=4),
    "mixed": dict(specs=(FULL, SWA), num_state_slots=4, num_snapshot_slots=4),
    "v4like": dict(specs=(SWA, FULL, COMP), num_state_slots=4, num_snapshot_slots=4),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_scheduler_hits_give_reference_tokens_sequential_and_batched(name):
    h = Harness(**{**CONFIGS[name], "num_snapshot_slots": 16 if name != "paged" else 0})
    prompts = [PROMPT[:30] + [900 + i] * (3 + i) for i in range(3)] + [PROMPT[:30] + [900] * 3]
    for i, p in enumerate(prompts):  # one at a time: each later one hits
        h.add(f"s{i}", p)
        h.run()
    cached = [h.reqs[f"s{i}"].num_cached_tokens for i in range(4)]
    assert cached[0] == 0 and all(c >= 16 for c in cached[1:]), cached
    assert cached[3] == 32, "an identical prompt hits up to its last unit boundary"
    for i, p in enumerate(prompts):  # then as one batch, all hitting
        h.add(f"b{i}", p)
    h.run()
    assert all(h.reqs[f"b{i}"].num_cached_tokens >= 16 for i in range(4))
    if h.kv.needs_snapshots:
        assert h.runner.num_restores > 0 and h.runner.num_captures > 0
    h.check_outputs()
    assert h.kv.stats.hits == sum(r.num_cached_tokens for r in h.reqs.values())


@pytest.mark.parametrize("name", ["paged", "mixed", "v4like"])
def test_scheduler_preemption_and_abort_with_hits(name):
    """A pool too small for all of them: requests are preempted, re-admitted at their own (or
    others') cached prefix, one is aborted mid-prefill; tokens stay right and nothing leaks."""
    h = Harness(**{**CONFIGS[name], "num_blocks": 26 if name == "v4like" else 16}, budget=9, max_num_seqs=4)
    for i in range(6):
        h.add(f"r{i}", PROMPT[:24 + 2 * i] + [950 + i] * 5, max_tokens=12)
    h.run(abort={3: "r4"})
    assert h.sched.num_preemptions_total > 0, "the pool was meant to force preemption"
    h.check_outputs(aborted={"r4"})
    assert any(h.reqs[f"r{i}"].num_cached_tokens for i in range(6))


def test_different_salt_never_hits():
    h = Harness(**{**CONFIGS["mixed"], "num_snapshot_slots": 16})
    h.add("a", PROMPT[:30], salt="tenant-a")
    h.run()
    h.add("b", PROMPT[:30], salt="tenant-b")
    h.add("c", PROMPT[:30])
    h.run()
    h.add("d", PROMPT[:30], salt="tenant-a")
    h.run()
    assert [h.reqs[r].num_cached_tokens for r in "abcd"] == [0, 0, 0, 28]
    h.check_outputs()


# ---- properties -----------------------------------------------------------------------------------

_PREFIXES = [PROMPT[:40], [500 + i for i in range(40)], PROMPT[:12] + [77] * 28]


@st.composite
def _prompts(draw):
    base = draw(st.sampled_from(_PREFIXES))
    keep = draw(st.integers(0, len(base)))
    tail = draw(st.lists(st.integers(1, 60), min_size=0 if keep else 1, max_size=12))
    return base[:keep] + tail


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), layout=st.sampled_from(["paged", "mixed", "v4like", "ring"]))
def test_random_add_allocate_commit_free_keeps_pools_consistent(data, layout):
    """Random admissions (at their hit), chunks (cut at snapshot boundaries, committed), decodes
    and frees over prompts sharing prefixes: the pools stay consistent after every operation,
    every hit's blocks hold the hashes of the request's own tokens, and everything comes back."""
    cfg = {**CONFIGS[layout], "num_blocks": 0 if layout == "ring" else data.draw(st.integers(12, 40), "num_blocks")}
    kv = make_kv(cfg["specs"], cfg.get("num_blocks", 64), cfg.get("num_state_slots", 0),
                 num_snapshot_slots=cfg.get("num_snapshot_slots", 0), snapshot_interval=8)
    live: dict[str, Request] = {}
    for n in range(data.draw(st.integers(1, 40), "num_ops")):
        op = data.draw(st.sampled_from(["add", "add", "chunk", "chunk", "decode", "free"]), f"op{n}")
        if op == "add" or not live:
            req = make_req(f"r{n}", data.draw(_prompts(), f"prompt{n}"), salt=data.draw(st.sampled_from([None, "s"])))
            hit = kv.find_prefix(req)
            assert hit.num_tokens < req.num_tokens and hit.num_tokens % kv.unit == 0
            hashes = kv.block_hashes(req)
            for gi, blocks in enumerate(hit.blocks):
                per_block = kv.paged_specs[gi].tokens_per_block
                for j, blk in enumerate(blocks):
                    assert blk.block_hash == (gi, hashes[(j + 1) * per_block // kv.unit - 1])
            req.snapshot_at = kv.snapshot_boundaries(req, hit.num_tokens)
            end = min([req.num_tokens, hit.num_tokens + 5] + [b for b in req.snapshot_at if b > hit.num_tokens])
            if kv.allocate_slots(req.request_id, end, hit):
                live[req.request_id] = req
                req.num_computed_tokens = hit.num_tokens
                if end in req.snapshot_at:
                    kv.reserve_snapshot(req, end)
                req.num_computed_tokens = end
                kv.commit(req)
            else:
                assert not kv.has_request(req.request_id)
        else:
            rid = data.draw(st.sampled_from(sorted(live)), f"rid{n}")
            req = live[rid]
            if op == "free":
                kv.free(rid)
                del live[rid]
            elif op == "chunk" and req.num_computed_tokens < req.num_tokens:
                start = req.num_computed_tokens
                end = min([req.num_tokens, start + data.draw(st.integers(1, 9))] +
                          [b for b in req.snapshot_at if b > start])
                if kv.allocate_slots(rid, end):
                    if end in req.snapshot_at:
                        kv.reserve_snapshot(req, end)
                    req.num_computed_tokens = end
                    kv.commit(req)
            elif op == "decode" and req.num_computed_tokens == req.num_tokens:
                if kv.allocate_slots(rid, req.num_tokens + 1):
                    req.append_output(data.draw(st.integers(1, 60)))
                    req.num_computed_tokens = req.num_tokens
                    kv.commit(req)
        kv.check_consistency()
    for rid in list(live):
        kv.free(rid)
    kv.check_no_leaks()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.tuples(_prompts(), st.sampled_from([None, None, "s"])), min_size=1, max_size=7),
       layout=st.sampled_from(list(CONFIGS)),
       budget=st.integers(3, 23), num_blocks=st.integers(24, 48), max_num_seqs=st.integers(1, 4),
       abort_at=st.none() | st.tuples(st.integers(0, 30), st.integers(0, 6)))
def test_random_workloads_through_the_scheduler_match_the_reference(prompts, layout, budget, num_blocks,
                                                                    max_num_seqs, abort_at):
    cfg = dict(CONFIGS[layout])
    if layout != "ring":
        cfg["num_blocks"] = num_blocks
    h = Harness(**cfg, budget=budget, max_num_seqs=max_num_seqs)
    for i, (p, salt) in enumerate(prompts):
        h.add(f"r{i}", p, salt=salt, max_tokens=3)
    aborted = set()
    if abort_at is not None and abort_at[1] < len(prompts):
        aborted.add(f"r{abort_at[1]}")
    h.run(abort={abort_at[0]: f"r{abort_at[1]}"} if aborted else None)
    aborted = {rid for rid in aborted if h.reqs[rid].status is RequestStatus.FINISHED_ABORTED}
    h.check_outputs(aborted=aborted)
