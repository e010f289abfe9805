"""The Triton decode attention kernel against a float64 reference over the rows `LayerCache.load` returns."""

import math

import pytest
import torch

from deepinfer.contracts.cache import PAGED, RING, CacheGroupSpec, RowSpec
from deepinfer.model_executor.layers.ops.addressing import ring_read_index
from deepinfer.model_executor.layers.ops.triton.decode_attention import decode_layer_attention
from deepinfer.worker.cache_engine import CacheEngine, RowCodec


def gen(seed):
    return torch.Generator().manual_seed(seed)


def filled_cache(hkv, d, kv_cache_dtype, shared=False, kind=PAGED, rows=8, units=5, layer=1):
    """Layer `layer` of a 3-layer group, every row written through the torch reference store."""
    window = rows - 2 if kind == RING else None
    group = CacheGroupSpec("g", kind, (0, 1, 2), rows_per_unit=rows, window=window,
                           row=RowSpec(hkv, d, shared_kv=shared))
    codec = RowCodec(hkv, d, torch.float32, kv_cache_dtype, shared_kv=shared)
    cache = CacheEngine([group], [units], [codec], torch.device("cpu")).group_caches(0)[layer]
    n = rows * units
    k = torch.randn(n, hkv, d, generator=gen(hkv * d)) * 2
    cache.store(torch.arange(n), k, None if shared else torch.randn(n, hkv, d, generator=gen(7)))
    return cache


def reference(cache, q, index, scale):
    """Each query over exactly the rows its index names (cache.load: the torch decode of a row), float64."""
    n, h, d = q.shape
    hkv = cache.codec.num_kv_heads
    out = torch.zeros(n, h, d, dtype=torch.float64)
    for i in range(n):
        slots = index[i][index[i] >= 0]
        if slots.numel() == 0:
            continue
        kv = cache.load(slots).double()  # [L, 2, H_kv, D]
        for head in range(h):
            g = head // (h // hkv)
            p = torch.softmax(kv[:, 0, g] @ q[i, head].double() * scale, dim=0)  # [L]
            out[i, head] = p @ kv[:, 1, g]
    return out


SHAPES = [(3, 4, 2, 16, False), (2, 9, 3, 32, False), (2, 5, 1, 24, False), (2, 6, 2, 40, False), (2, 4, 1, 64, True)]
CASES = [(dt, *shape) for dt in ("auto", "bfloat16", "fp8") for shape in SHAPES
         if dt != "fp8" or (2 - shape[4]) * shape[2] * shape[3] % 32 == 0]  # MXFP8: rows of 32k elements


@pytest.mark.parametrize("kv_cache_dtype,n,h,hkv,d,shared", CASES)
def test_paged_reads_match_the_reference(kv_cache_dtype, n, h, hkv, d, shared):
    cache = filled_cache(hkv, d, kv_cache_dtype, shared)
    index = torch.randint(0, 40, (n, 37), generator=gen(n + d))  # more columns than one block
    index[0, 20:] = -1  # padding
    index[1, ::3] = -1  # holes anywhere are skipped
    q = torch.randn(n, h, d, generator=gen(h))
    scale = 1 / math.sqrt(d)
    out = decode_layer_attention(cache, q, index, scale)
    torch.testing.assert_close(out.double(), reference(cache, q, index, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_ring_index_rows_wrap_inside_their_state(kv_cache_dtype):
    """Index rows from ring_read_index (offsets near the ring's end wrap to its start)."""
    ring, window = 8, 6
    cache = filled_cache(2, 16, kv_cache_dtype, kind=RING, rows=ring)
    offset = torch.tensor([0 * ring + 5, 3 * ring + 7, 2 * ring + 1])  # first slot read, per query
    length = torch.tensor([6, 4, 1])
    index = ring_read_index(offset, length, window, ring)  # [3, W]
    assert index[0].tolist() == [5, 6, 7, 0, 1, 2]  # wrapped
    q = torch.randn(3, 4, 16, generator=gen(1))
    out = decode_layer_attention(cache, q, index, 0.3)
    torch.testing.assert_close(out.double(), reference(cache, q, index, 0.3), rtol=1e-5, atol=1e-5)


def test_a_query_without_slots_gets_zeros_and_others_are_unaffected():
    cache = filled_cache(2, 16, "auto")
    index = torch.tensor([[-1, -1, -1], [3, 9, -1]])
    q = torch.randn(2, 4, 16, generator=gen(2))
    out = decode_layer_attention(cache, q, index, 0.25)
    assert torch.equal(out[0], torch.zeros(4, 16))
    torch.testing.assert_close(out.double(), reference(cache, q, index, 0.25), rtol=1e-5, atol=1e-5)


def test_extreme_scores_and_bf16_queries():
    """Scores hundreds apart (all but the top key underflow), and bf16 queries over fp32 rows."""
    cache = filled_cache(1, 32, "auto")
    cache.rows2d[:, :32] *= 60  # K of every row: large logits
    index = torch.arange(40).view(1, 40)
    q = torch.randn(1, 3, 32, generator=gen(3))
    torch.testing.assert_close(decode_layer_attention(cache, q, index, 0.2).double(),
                               reference(cache, q, index, 0.2), rtol=1e-4, atol=1e-4)
    out = decode_layer_attention(cache, q.bfloat16(), index, 0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(cache, q.bfloat16().float(), index, 0.2), rtol=0.05, atol=0.05)


def test_row_lengths_bound_the_walk():
    """lens[n]: row n's slots end there; columns past it are not read (even where they name a slot),
    and lens 0 gives zeros, as a padding row of a CUDA graph bucket does."""
    cache = filled_cache(2, 16, "auto")
    index = torch.randint(0, 40, (3, 70), generator=gen(5))  # more than two BLOCK_L blocks
    lens = torch.tensor([70, 33, 0])
    q = torch.randn(3, 4, 16, generator=gen(6))
    out = decode_layer_attention(cache, q, index, 0.25, lens)
    cut = index.clone()
    cut[1, 33:] = -1
    cut[2] = -1
    torch.testing.assert_close(out.double(), reference(cache, q, cut, 0.25), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2], torch.zeros(4, 16))
