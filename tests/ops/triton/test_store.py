"""The Triton store kernel against LayerCache.store (the torch reference): same bytes at the same lines."""

import pytest
import torch

from deepinfer.contracts.cache import PAGED, RING, CacheGroupSpec, RowSpec
from deepinfer.model_executor.layers.ops.mxfp8 import quantize_mxfp8
from deepinfer.model_executor.layers.ops.triton.store import store_layer_rows, store_rows
from deepinfer.worker.cache_engine import CacheEngine, RowCodec


def layer_caches(hkv, d, kv_cache_dtype, shared=False, kind=PAGED, rows=4, layers=3, units=6):
    """Two CacheEngines of one group (3 layers): one for the kernel, one for the reference."""
    window = rows - 1 if kind == RING else None
    group = CacheGroupSpec("g", kind, tuple(range(layers)), rows_per_unit=rows, window=window,
                           row=RowSpec(hkv, d, shared_kv=shared))
    codec = RowCodec(hkv, d, torch.float32, kv_cache_dtype, shared_kv=shared)
    return [CacheEngine([group], [units], [codec], torch.device("cpu")).group_caches(0) for _ in range(2)]


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8"])
@pytest.mark.parametrize("hkv,d,shared,kind", [(2, 16, False, PAGED), (3, 32, False, RING), (1, 16, False, PAGED),
                                               (1, 64, True, RING), (4, 8, True, PAGED)])
def test_store_writes_the_reference_bytes_at_the_reference_lines(kv_cache_dtype, hkv, d, shared, kind):
    mine, ref = layer_caches(hkv, d, kv_cache_dtype, shared, kind)
    slots = torch.tensor([5, 0, 23, 9, 14])  # units 1, 0, 5, 2, 3 of R = 4 rows
    k = torch.randn(5, hkv, d, generator=gen(d)) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.0])[:, None, None]
    v = torch.randn(5, hkv, d, generator=gen(d + 1))
    layer = 1  # the middle layer: its lines sit between two other layers' rows
    store_layer_rows(mine[layer], slots, k, v)
    ref[layer].store(slots, k, v)
    assert torch.equal(mine[layer].rows2d.view(torch.uint8), ref[layer].rows2d.view(torch.uint8))
    assert mine[layer].rows2d.view(torch.uint8).any()


def test_store_takes_strided_views_of_a_fused_projection():
    """k, v as slices of one [T, (H + 2 H_kv) D] projection, and a subset of rows (store_rows)."""
    mine, ref = layer_caches(2, 16, "fp8", layers=2)
    qkv = torch.randn(6, (4 + 2 + 2) * 16, generator=gen(3))
    k = qkv[:, 64:96].view(6, 2, 16)[1::2]  # [3, 2, 16], strided
    v = qkv[:, 96:].view(6, 2, 16)[1::2]
    slots = torch.tensor([3, 17, 8])
    store_layer_rows(mine[0], slots, k, v)
    ref[0].store(slots, k.contiguous(), v.contiguous())
    assert torch.equal(mine[0].rows2d, ref[0].rows2d)


def test_mxfp8_is_bit_identical_to_the_encoder_at_the_edges():
    """Blocks whose max is exactly 448 * 2^k, just above it, zero blocks, subnormal e4m3 values,
    ties between e4m3 steps (round to even) and both signs."""
    e = 4 * 32
    x = torch.randn(6, e, generator=gen(0))
    x[0, :32] = 0.0
    x[1, 5] = 448.0 * 2.0 ** -3  # amax exactly on a scale boundary
    x[1, 40] = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))  # one ulp above: next scale
    x[2, :32] = torch.linspace(-448, 448, 32)
    x[2, 32:64] = torch.arange(32) * 2.0 ** -10 * 448 / 448  # e4m3 subnormal range after scaling
    x[3, :32] = torch.tensor([1.0, 1.0625, 1.125, 1.1875] * 8) * torch.tensor([1.0, -1.0]).repeat(16)  # ties
    x[3, 0] = 448.0  # scale 1: the ties above land exactly between e4m3 steps
    x[4] *= 1e-30
    x[5] *= 1e30
    rows = torch.zeros(6, e + e // 32, dtype=torch.uint8)
    store_rows(rows, torch.arange(6), x.view(6, 4, 32), None, 6, 6, 0, fp8=True)
    assert torch.equal(rows, quantize_mxfp8(x))


def test_store_of_no_rows_writes_nothing():
    mine, _ = layer_caches(2, 16, "fp8")
    store_layer_rows(mine[0], torch.zeros(0, dtype=torch.long), torch.zeros(0, 2, 16), torch.zeros(0, 2, 16))
    assert not mine[0].rows2d.any()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_many_short_rows_span_several_programs(kv_cache_dtype):
    """Rows of 32 elements: each program stores a block of rows; 70 rows leave a partial last block."""
    mine, ref = layer_caches(1, 16, kv_cache_dtype, rows=16, units=5)
    slots = torch.randperm(80, generator=gen(4))[:70]
    k, v = torch.randn(70, 1, 16, generator=gen(5)), torch.randn(70, 1, 16, generator=gen(6))
    store_layer_rows(mine[2], slots, k, v)
    ref[2].store(slots, k, v)
    assert torch.equal(mine[2].rows2d.view(torch.uint8), ref[2].rows2d.view(torch.uint8))



@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8"])
@pytest.mark.parametrize("kind", [PAGED, RING])
def test_slot_minus_one_writes_nothing(kv_cache_dtype, kind):
    """Padding rows of a CUDA-graph decode batch carry slot -1: the kernel skips them, and the
    real rows among them land where the reference puts them; every other byte stays 0."""
    mine, ref = layer_caches(2, 16, kv_cache_dtype, kind=kind)
    k, v = torch.randn(5, 2, 16, generator=gen(7)) + 1.0, torch.randn(5, 2, 16, generator=gen(8)) + 1.0
    store_layer_rows(mine[1], torch.full((5,), -1), k, v)
    assert not mine[1].rows2d.view(torch.uint8).any()  # the group's whole allocation, all layers
    slots = torch.tensor([-1, 5, -1, 14, -1])
    store_layer_rows(mine[1], slots, k, v)
    real = slots >= 0
    ref[1].store(slots[real], k[real], v[real])
    assert torch.equal(mine[1].rows2d.view(torch.uint8), ref[1].rows2d.view(torch.uint8))
    assert mine[1].rows2d.view(torch.uint8).any()
