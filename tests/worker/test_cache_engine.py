"""The cache engine: one allocation per group, the book's views, and its two hazards reproduced
on the real cache (not only the scalar helpers)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.plan import ScheduledRequest, StepPlan
from deepinfer.model_executor.layers.attention.backend import TorchAttentionBackend
from deepinfer.model_executor.layers.ops.torch_attention import visibility
from deepinfer.worker.cache_engine import CacheEngine, RowCodec, page_rows
from deepinfer.worker.input_batch import build_step_inputs, group_addressing

CPU = torch.device("cpu")


def ring_engine(window: int, ring: int, num_states: int = 3, kv_cache_dtype: str = "auto", head_dim: int = 16):
    group = CacheGroupSpec("swa", "ring", (0, 1), ring, window)
    codec = RowCodec(1, head_dim, torch.float32, kv_cache_dtype)
    return CacheEngine([group], [num_states], [codec], CPU), group


def test_layer_views_have_the_book_shape_and_alias_one_allocation():
    engine, group = ring_engine(128, 134, kv_cache_dtype="fp8", head_dim=256)  # 2*256 = 512 -> 528 B
    (alloc,) = engine.allocations
    caches = engine.layer_caches()
    assert engine.codecs[0].row_bytes == 528
    for layer in (0, 1):
        view = caches[layer][1].view
        assert view.shape == (3, 134, 1, 528)  # (state slots, ring positions, 1, bytes per row)
        assert view.stride() == (alloc.stride(0), 528, 528, 1)
        assert view.untyped_storage().data_ptr() == alloc.untyped_storage().data_ptr()
    caches[1][1].view[2, 5, 0, 7] = 99  # layer 1, state 2, ring row 5, byte 7
    assert alloc[2, 134 * 528 + 5 * 528 + 7] == 99
    assert engine.num_bytes == 3 * 2 * 134 * 528


def _rows(positions: torch.Tensor, head_dim: int = 16):
    """k = v = the position itself, so a read row tells which position it holds."""
    k = positions.float()[:, None, None].expand(-1, 1, head_dim).contiguous()  # [T, 1, D]
    return k, k.clone()


def _fill_ring(cache, addr, sid: int, upto: int) -> None:
    s = ScheduledRequest("r", list(range(upto)), 0, (), (sid,))
    slots = addr.slots(s, torch.arange(max(0, upto - addr.R), upto))
    cache.store(slots, *_rows(torch.arange(max(0, upto - addr.R), upto)))


@pytest.mark.parametrize("ring, expected", [(128, [5, 4, 3, 2, 1, 0]), (133, [0] * 6), (134, [0] * 6)])
def test_six_verification_writes_overwrite_visible_rows_only_in_a_small_ring(ring, expected):
    window, k, sid = 128, 5, 1
    engine, group = ring_engine(window, ring)
    cache = engine.layer_caches()[0][1]
    (addr,) = group_addressing([group])
    p = window + ring
    _fill_ring(cache, addr, sid, p)
    step = ScheduledRequest("r", [0] * (k + 1), p, (), (sid,), verify=True)
    g = build_step_inputs(StepPlan([step]), [addr], CPU).attn_metadata.groups[0]
    cache.store(g.store_slots, *_rows(torch.arange(p, p + k + 1)))  # decode order: store all, then read
    held = cache.load(g.decode_index)[:, :, 0, 0, 0]  # [k+1, W] the position each read row holds
    wanted = torch.arange(window)[None, :] + torch.arange(p - window + 1, p + k + 1 - window + 1)[:, None]
    assert ((held != wanted) & (g.decode_index >= 0)).sum(1).tolist() == expected


class StoreFirstBackend(TorchAttentionBackend):
    """The wrong order of listing 3.13: store the chunk, then load the old window."""

    def forward(self, cache, q, k, v, metadata, group, scale):
        cache.store(group.store_slots, k, v)
        loaded = [cache.load(seg.load_slots) for seg in group.prefills]
        seg, old = group.prefills[0], loaded[0]
        from deepinfer.model_executor.layers.ops.torch_attention import prefill_attention

        return prefill_attention(q, k, v, old, metadata.positions, seg.load_positions, scale, group.window)


def _reference(q, k, v, window):
    pos = torch.arange(q.shape[0])
    mask = visibility(pos, pos, window)  # [T, T]
    scores = torch.einsum("thd,shd->hts", q, k).masked_fill(~mask, float("-inf"))  # [H, T, T]
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)  # [T, H, D]


@pytest.mark.parametrize("backend, corrupt", [(TorchAttentionBackend(), False), (StoreFirstBackend(), True)])
def test_prefill_must_load_the_old_window_before_storing_the_chunk(backend, corrupt):
    window, ring, sid, d = 3, 5, 0, 16
    engine, group = ring_engine(window, ring, num_states=1)
    cache = engine.layer_caches()[0][1]
    (addr,) = group_addressing([group])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 1, d, generator=g) for _ in range(3))
    ref = _reference(q, k, v, window)  # [8, 1, D]
    cache.store(torch.arange(4), k[:4], v[:4])  # the cached prefix 0..3 in slots 0..3
    step = ScheduledRequest("r", [0] * 4, 4, (), (sid,))  # the chunk 4..7: its store of 7 hits slot 2
    md = build_step_inputs(StepPlan([step]), [addr], CPU).attn_metadata
    out = backend.forward(cache, q[4:], k[4:], v[4:], md, md.groups[0], 1.0)  # [4, 1, D]
    ok = torch.allclose(out, ref[4:], atol=1e-5)
    assert ok is not corrupt
    if corrupt:  # only query 4 read position 2; queries 5..7 are unharmed
        assert not torch.allclose(out[0], ref[4], atol=1e-5) and torch.allclose(out[1:], ref[5:], atol=1e-5)


def test_paged_views_cover_distinct_blocks():
    group = CacheGroupSpec("full", "paged", (0,), 4)
    engine = CacheEngine([group], [6], [RowCodec(2, 8, torch.float32, "auto")], CPU)
    cache = engine.layer_caches()[0][1]
    k = torch.arange(24, dtype=torch.float32).view(24, 1, 1).expand(24, 2, 8).contiguous()
    cache.store(torch.arange(24), k, -k)
    back = cache.load(torch.tensor([[0, 5, 23], [-1, 4, 7]]))  # [2, 3, 2, 2, 8]
    assert back[0, :, 0, 0, 0].tolist() == [0, 5, 23] and back[0, 2, 1, 1, 3].item() == -23


@pytest.mark.parametrize("kv_cache_dtype, row_bytes", [("fp8", 528), ("bfloat16", 1024), ("auto", 2048)])
def test_shared_latent_row_is_both_k_and_v(kv_cache_dtype, row_bytes):
    """One 512-element row per token serves as K and V: 528 B in MXFP8, as the book computes;
    bf16 rows under fp32 compute hold each value rounded to bf16."""
    codec = RowCodec(1, 512, torch.float32, kv_cache_dtype, shared_kv=True)
    group = CacheGroupSpec("swa", "ring", (0,), 134, 128)
    engine = CacheEngine([group], [2], [codec], CPU)
    cache = engine.layer_caches()[0][1]
    assert codec.row_bytes == row_bytes and cache.view.shape == (2, 134, 1, row_bytes)
    latent = torch.randn(3, 1, 512)
    cache.store(torch.tensor([5, 134 + 7, 133]), latent, None)
    kv = cache.load(torch.tensor([5, 141, 133]))  # [3, 2, 1, 512]
    assert torch.equal(kv[:, 0], kv[:, 1])
    if kv_cache_dtype == "bfloat16":
        assert torch.equal(kv[:, 0].float(), latent.to(torch.bfloat16).float())
        return
    tol = 0.07 if kv_cache_dtype == "fp8" else 0.0  # half an e4m3 step: 2^-4 relative
    assert torch.allclose(kv[:, 0], latent, rtol=tol, atol=1e-3 if tol else 0.0)


def test_paged_groups_of_different_rows_share_one_pool_of_pages():
    """DeepSeek-V4's paged groups (MXFP8): latent rows of 528 B in 2 CSA layers and 1 HCA layer,
    index keys of 132 B in 2 layers. One page size, one allocation; a block id is the same page
    bytes in every group, so the pool can hand a page to any group without over-provisioning."""
    latent = RowCodec(1, 512, torch.float32, "fp8", shared_kv=True)
    index = RowCodec(1, 128, torch.float32, "fp8", shared_kv=True)
    groups = [CacheGroupSpec("swa", "ring", (0, 1, 2), 134, 128),
              CacheGroupSpec("csa", "paged", (1, 2), 16, compress_ratio=4),
              CacheGroupSpec("hca", "paged", (0,), 16, compress_ratio=128),
              CacheGroupSpec("index", "paged", (1, 2), 16, compress_ratio=4)]
    codecs = [latent, latent, latent, index]
    sized = page_rows(groups, 16, codecs)
    assert [g.rows_per_unit for g in sized] == [134, 16, 32, 64]  # page = 16 x 2 x 528 = 16,896 B
    engine = CacheEngine(sized, [2, 5, 5, 5], codecs, CPU)
    pool = engine.allocations[1]
    assert pool.shape == (5, 16_896) and engine.allocations[2] is pool and engine.allocations[3] is pool
    assert engine.num_bytes == 2 * 3 * 134 * 528 + 5 * 16_896  # the pool counted once
    caches = {g.name: engine.group_caches(i) for i, g in enumerate(sized)}
    caches["hca"][0].store(torch.tensor([3 * 32 + 31]), torch.ones(1, 1, 512), None)  # block 3, last row
    caches["index"][2].store(torch.tensor([1 * 64 + 63]), torch.ones(1, 1, 128), None)  # block 1, layer 2
    used = pool.ne(0).any(dim=1).tolist()
    assert used == [False, True, False, True, False]
    assert pool[3, 31 * 528:32 * 528].ne(0).any() and pool[1, 16_896 - 132:].ne(0).any()
