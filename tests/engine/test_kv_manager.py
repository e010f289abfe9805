"""Block pool, state slots and the KV cache manager: allocation, ref counts, no leaks."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.kv_manager import (
    BlockPool,
    KVCacheManager,
    PagedGroupSpec,
    RingGroupSpec,
    StateSlotPool,
)

FULL = PagedGroupSpec("full", block_size=4)


@pytest.mark.subprocess
def test_module_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import deepinfer.engine.kv_manager"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_specs_validate_sizes():
    with pytest.raises(ValueError, match="full.block_size must be a positive integer, got 0"):
        PagedGroupSpec("full", 0)
    with pytest.raises(ValueError, match="swa.ring_size"):
        RingGroupSpec("swa", -3)
    assert PagedGroupSpec("full", 4).num_blocks_for(0) == 0
    assert PagedGroupSpec("full", 4).num_blocks_for(9) == 3


def test_block_pool_allocates_from_head_cached_blocks_to_tail_others_to_head():
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    a[1].block_hash = ("h", 1)
    pool.cached[a[1].block_hash] = a[1]
    pool.free([a[1]])  # cached: to the tail, kept as long as anything else is free
    pool.free([a[0]])  # nothing findable: to the head, reused first
    assert pool.free_block_ids() == [0, 3, 4, 5, 1]
    assert [b.block_id for b in pool.allocate(4)] == [0, 3, 4, 5]
    assert pool.cached == {("h", 1): a[1]}  # the cached block survived
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(5 / 6)
    assert [b.block_id for b in pool.allocate(1)] == [1] and pool.cached == {}  # evicted at last


def test_block_pool_ref_counts_and_double_free():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert pool.num_free_blocks == 1 and block.ref_cnt == 1
    pool.free([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="block 0 freed more often"):
        pool.free([block])
    pool.touch([block])  # a free block can be taken back (a prefix hit on a freed block)
    assert pool.free_block_ids() == [1] and block.ref_cnt == 1


def test_block_pool_refuses_overallocation_and_clears_hash():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="cannot allocate 3 blocks: only 2 free"):
        pool.allocate(3)
    (block,) = pool.allocate(1)
    block.block_hash = 1234
    pool.free([block])
    pool.allocate(2)
    assert block.block_hash is None


def test_state_slot_pool():
    pool = StateSlotPool(2)
    assert [pool.allocate(), pool.allocate()] == [0, 1]
    with pytest.raises(ValueError, match="no free state slot"):
        pool.allocate()
    pool.free(1)
    with pytest.raises(RuntimeError, match="state slot 1 freed twice"):
        pool.free(1)
    pool.free(0)
    assert [pool.allocate(), pool.allocate()] == [0, 1]  # the slot freed last comes back first


def test_manager_validates_arguments():
    with pytest.raises(ValueError, match="at least one cache group"):
        KVCacheManager((), num_blocks=4)
    with pytest.raises(ValueError, match="names must be unique"):
        KVCacheManager((FULL, PagedGroupSpec("full", 8)), num_blocks=4)
    with pytest.raises(ValueError, match="num_blocks must be a positive integer, got 0"):
        KVCacheManager((FULL,), num_blocks=0)
    with pytest.raises(ValueError, match="num_state_slots"):
        KVCacheManager((FULL, RingGroupSpec("swa", 8)), num_blocks=4, num_state_slots=0)
    with pytest.raises(ValueError, match="PagedGroupSpec or RingGroupSpec"):
        KVCacheManager(("full",), num_blocks=4)


def test_allocate_grows_block_tables():
    kv = KVCacheManager((FULL,), num_blocks=8)
    assert kv.allocate_slots("a", 3)
    assert kv.block_ids("a") == ([0],)
    assert kv.allocate_slots("a", 4)  # still one block
    assert kv.allocate_slots("a", 9)
    assert kv.block_ids("a") == ([0, 1, 2],)
    assert kv.allocate_slots("a", 2)  # never shrinks
    assert kv.block_ids("a") == ([0, 1, 2],)
    assert kv.allocate_slots("b", 1)
    assert kv.block_ids("b") == ([3],)
    assert kv.num_free_blocks == 4 and kv.usage == 0.5 and kv.num_allocated_requests == 2
    assert kv.state_ids("a") == ()
    kv.check_consistency()


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager((FULL,), num_blocks=3)
    assert kv.allocate_slots("a", 8)
    assert not kv.can_allocate("a", 13)
    assert not kv.allocate_slots("a", 13)
    assert kv.block_ids("a") == ([0, 1],) and kv.num_free_blocks == 1
    assert not kv.allocate_slots("b", 5)
    assert not kv.has_request("b") and kv.num_allocated_requests == 1
    assert kv.can_allocate("a", 12) and kv.allocate_slots("a", 12)
    assert kv.num_free_blocks == 0


def test_free_is_idempotent_and_returns_everything():
    kv = KVCacheManager((FULL,), num_blocks=4)
    kv.allocate_slots("a", 10)
    with pytest.raises(AssertionError, match="3 blocks not free"):
        kv.check_no_leaks()
    kv.free("a")
    kv.free("a")
    kv.free("never-seen")
    kv.check_no_leaks()
    with pytest.raises(KeyError, match="holds no cache"):
        kv.block_ids("a")
    # no block was cached: each freed one went to the head, so the next request gets them back in
    # order before the never-used block 3
    assert kv.block_pool.free_block_ids() == [0, 1, 2, 3]


def test_paged_groups_share_one_pool():
    kv = KVCacheManager((PagedGroupSpec("full", 4), PagedGroupSpec("compressed", 16)), num_blocks=5)
    assert not kv.allocate_slots("a", 17)  # 5 blocks of 4 + 2 blocks of 16 > 5
    assert kv.allocate_slots("a", 12)  # 3 blocks of 4 + 1 block of 16
    assert kv.block_ids("a") == ([0, 1, 2], [3])
    assert kv.num_free_blocks == 1
    assert kv.max_num_tokens == 16  # 4 blocks of 4 + 1 block of 16


def test_compressed_groups_hold_one_row_per_ratio_tokens():
    """DeepSeek-V4 layout: compressed rows at ratio 4 and 128 beside a ring; rows exist only for
    complete windows (t // m), so a block of 4 rows covers 16 resp. 512 tokens."""
    csa, hca = PagedGroupSpec("csa", 4, compress_ratio=4), PagedGroupSpec("hca", 4, compress_ratio=128)
    assert [csa.num_blocks_for(t) for t in (0, 3, 4, 16, 17, 19, 20)] == [0, 0, 1, 1, 1, 1, 2]
    assert [hca.num_blocks_for(t) for t in (127, 128, 512, 639, 640)] == [0, 1, 1, 1, 2]
    kv = KVCacheManager((RingGroupSpec("swa", 134), csa, hca), num_blocks=12, num_state_slots=2)
    assert kv.allocate_slots("a", 3) and kv.block_ids("a") == ([], [])  # no complete window yet
    assert kv.allocate_slots("a", 130) and [len(t) for t in kv.block_ids("a")] == [8, 1]  # 32 rows, 1 row
    assert not kv.allocate_slots("b", 64)  # 4 more csa blocks: only 3 free
    assert kv.max_num_tokens == 179  # 44 csa rows (11 blocks) + 1 hca row (1 block); 180 needs a 13th
    kv.free("a")
    kv.check_no_leaks()
    with pytest.raises(ValueError, match="csa.compress_ratio"):
        PagedGroupSpec("csa", 4, compress_ratio=0)


def test_ring_groups_hold_one_state_slot_per_request():
    kv = KVCacheManager((FULL, RingGroupSpec("swa", 134), RingGroupSpec("swa2", 134)),
                        num_blocks=8, num_state_slots=2)
    assert kv.allocate_slots("a", 300) is False  # 75 blocks
    assert kv.allocate_slots("a", 5) and kv.allocate_slots("b", 1)
    assert kv.state_ids("a") == (0, 0) and kv.state_ids("b") == (1, 1)
    assert kv.block_ids("a") == ([0, 1],)
    assert kv.allocate_slots("a", 12)  # growing keeps its slot
    assert not kv.can_allocate("c", 1)  # blocks are free, slots are not
    assert not kv.allocate_slots("c", 1) and not kv.has_request("c")
    kv.free("a")
    assert kv.allocate_slots("c", 1) and kv.state_ids("c") == (0, 0)
    kv.free("b")
    kv.free("c")
    kv.check_no_leaks()


def test_ring_only_manager_has_no_token_limit():
    kv = KVCacheManager((RingGroupSpec("swa", 8),), num_blocks=0, num_state_slots=1)
    assert kv.max_num_tokens > 10**9
    assert kv.allocate_slots("a", 10**6) and kv.block_ids("a") == ()
    kv.free("a")
    kv.check_no_leaks()


def test_max_num_tokens_single_group():
    assert KVCacheManager((FULL,), num_blocks=7).max_num_tokens == 28


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    block_size=st.integers(1, 5),
    ops=st.lists(st.tuples(st.sampled_from("af"), st.integers(0, 4), st.integers(0, 40)), max_size=40),
)
def test_random_allocate_free_keeps_pool_consistent(num_blocks, block_size, ops):
    spec = PagedGroupSpec("full", block_size)
    kv = KVCacheManager((spec, RingGroupSpec("swa", 4)), num_blocks=num_blocks, num_state_slots=3)
    covered: dict[str, int] = {}  # request -> tokens its table must cover
    for op, rid_index, num_tokens in ops:
        rid = f"r{rid_index}"
        if op == "f":
            kv.free(rid)
            covered.pop(rid, None)
            continue
        expected = kv.can_allocate(rid, num_tokens)
        assert kv.allocate_slots(rid, num_tokens) == expected
        if expected:
            covered[rid] = max(covered.get(rid, 0), num_tokens)
        held = [b for rid_ in covered for b in kv.block_ids(rid_)[0]]
        assert len(held) == len(set(held)), "a block is held by two requests"
        assert len(held) + kv.num_free_blocks == num_blocks
        for rid_, n in covered.items():
            assert len(kv.block_ids(rid_)[0]) == spec.num_blocks_for(n)
        kv.check_consistency()
    for rid in list(covered):
        kv.free(rid)
    kv.check_no_leaks()
