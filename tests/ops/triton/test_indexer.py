"""The Triton lightning-indexer scores against the torch reference (`IndexerScorer.score`): shared
and per-query keys, keys read from a LayerCache (MXFP8 and fp32 rows, -1 slots), odd sizes, and
the same top-k picks as the reference scores give."""

from types import SimpleNamespace

import pytest
import torch

from deepinfer.contracts.cache import PAGED, CacheGroupSpec, RowSpec
from deepinfer.model_executor.layers.ops.torch_sparse_mla import load_latent
from deepinfer.model_executor.layers.ops.triton.indexer import indexer_scores, indexer_scores_from_cache
from deepinfer.model_executor.models.deepseek_v4.indexer import IndexerScorer, topk_visible_rows
from deepinfer.worker.cache_engine import CacheEngine, RowCodec


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def scorer(heads: int, d: int) -> IndexerScorer:
    return IndexerScorer(SimpleNamespace(index_head_dim=d, index_n_heads=heads, hidden_size=8))


def inputs(n: int, heads: int, d: int, seed: int = 0):
    """q [n, h, d], head weights [n, h] (some negative, as weights_proj gives)."""
    return torch.randn(n, heads, d, generator=gen(seed)), torch.randn(n, heads, generator=gen(seed + 1))


@pytest.mark.parametrize(("n", "heads", "d", "width"), [(5, 3, 48, 37), (2, 20, 32, 16), (1, 1, 16, 1)])
def test_shared_keys_match_reference(n, heads, d, width):
    q, w = inputs(n, heads, d)
    keys = torch.randn(width, d, generator=gen(2))  # [R, d]
    expected = scorer(heads, d).score(q, keys, w)  # [n, R]
    out = indexer_scores(q, keys, w, d**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_per_query_keys_match_reference():
    q, w = inputs(4, 5, 40)
    keys = torch.randn(4, 23, 40, generator=gen(3))  # [n, R, d]
    torch.testing.assert_close(indexer_scores(q, keys, w, 40**-0.5), scorer(5, 40).score(q, keys, w),
                               rtol=1e-5, atol=1e-5)


def index_cache(d: int, kv_cache_dtype: str):
    """Layer 1 of a two-layer paged index group, every row written through the torch store."""
    codec = RowCodec(1, d, torch.float32, kv_cache_dtype, shared_kv=True)
    group = CacheGroupSpec("index", PAGED, (0, 1), 8, compress_ratio=4, row=RowSpec(1, d, shared_kv=True))
    cache = CacheEngine([group], [4], [codec], torch.device("cpu")).group_caches(0)[1]
    cache.store(torch.arange(32), torch.randn(32, 1, d, generator=gen(4)), None)
    return cache


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "auto"])
def test_cache_rows_match_reference(kv_cache_dtype):
    """Per-query slots with a -1 tail: valid columns equal the reference over `load_latent`
    (the MXFP8 rows dequantized by torch), -1 columns are -inf."""
    d, heads, n = 64, 3, 3
    cache = index_cache(d, kv_cache_dtype)
    q, w = inputs(n, heads, d, seed=5)
    slots = torch.stack([torch.randperm(32, generator=gen(6 + i))[:21] for i in range(n)])  # [n, R]
    slots[1, 15:] = -1
    slots[2, :] = -1
    out = indexer_scores_from_cache(q, w, cache, slots, d**-0.5)  # [n, R]
    expected = scorer(heads, d).score(q, load_latent(cache, slots), w)  # [n, R]
    valid = slots >= 0
    torch.testing.assert_close(out[valid], expected[valid], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(out[~valid]).all()
    shared = indexer_scores_from_cache(q, w, cache, slots[0], d**-0.5)  # [n, R]: one row list for all
    torch.testing.assert_close(shared, scorer(heads, d).score(q, load_latent(cache, slots[0]), w),
                               rtol=1e-5, atol=1e-5)


def test_picks_match_reference_with_ties():
    """Two heads and ReLU give many exact-zero scores (ties); the stable top-k over the kernel's
    scores picks the same rows as over the reference's."""
    q, w = inputs(12, 2, 32, seed=8)
    w = w.abs()  # positive weights: negative dots then tie at exactly 0
    keys = torch.randn(30, 32, generator=gen(9))  # [R, d]
    positions = torch.arange(12) * 10 + 3  # [n]: 1..30 visible rows at ratio 4
    ours = topk_visible_rows(indexer_scores(q, keys, w, 32**-0.5), positions, 6, 4)
    expected_scores = scorer(2, 32).score(q, keys, w)
    assert (expected_scores == 0).float().mean() > 0.1
    assert torch.equal(ours, topk_visible_rows(expected_scores, positions, 6, 4))


def test_bad_shapes_are_refused():
    q, w = inputs(2, 3, 16)
    with pytest.raises(ValueError, match="index_keys"):
        indexer_scores(q, torch.randn(5, 8), w, 0.25)
    with pytest.raises(ValueError, match="weights"):
        indexer_scores(q, torch.randn(5, 16), w[:, :2], 0.25)
    with pytest.raises(ValueError, match="slots"):
        indexer_scores_from_cache(q, w, index_cache(16, "auto"), torch.zeros(3, 4, dtype=torch.long), 0.25)
