"""The decode step's fused CPU kernels (fused_cpu.cpp) against plain torch on random inputs, odd
sizes included, for every instruction set this CPU runs; and the layers that call them against
their own torch paths (DEEPINFER_CPU_ISA=none)."""

import math
import types

import pytest
import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.norm import RMSNorm, rms_norm, torch_rms_norm
from deepinfer.model_executor.layers.ops import fused
from deepinfer.model_executor.layers.ops.addressing import cache_line
from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa
from deepinfer.model_executor.layers.rotary import RotaryEmbedding, _rotate

ISAS = [isa for isa in (1, 2) if kernel_isa() >= isa]
OPS = torch.ops.deepinfer_cpu


def _no_reference(*args):
    raise AssertionError("the torch reference ran where the kernel serves the call")


decode_attention = fused.decode_attention_op(_no_reference)  # the kernel, or a failure
store_rows = fused.store_rows_op(_no_reference)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (3, 4, 37), (33, 1)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_torch(isa, shape, offset):
    x = torch.randn(*shape, generator=gen(shape[-1])) * 3  # [..., E]
    w = torch.randn(shape[-1], generator=gen(7))  # [E]
    ref = F.rms_norm(x.double(), (shape[-1],), (w + offset).double(), 1e-5).float()
    torch.testing.assert_close(OPS.rms_norm(x, w, 1e-5, offset, isa), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t,i", [(1, 1536), (4, 37), (2, 1)])
def test_silu_mul_matches_torch_and_is_row_wise(isa, t, i):
    x = torch.randn(t, 2 * i, generator=gen(i)) * 6  # [T, 2I]
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])[: min(3, i)]  # saturated and zero gates
    y = OPS.silu_mul(x, isa)  # [T, I]
    torch.testing.assert_close(y, F.silu(x[:, :i].double()).float() * x[:, i:], rtol=2e-6, atol=1e-6)
    for r in range(t):  # a row's bits do not depend on the rows beside it
        assert torch.equal(OPS.silu_mul(x[r: r + 1], isa), y[r: r + 1])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t,h,hkv,d", [(1, 9, 3, 64), (4, 4, 1, 256), (3, 2, 2, 6)])
def test_rope_matches_torch_on_strided_views(isa, t, h, hkv, d):
    """q and k as views into one fused qkv output (rows strided by the full width), as layers pass them."""
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen(d))  # [T, (H + 2 H_kv) D]
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d: (h + hkv) * d].view(t, hkv, d)
    cos, sin = torch.randn(50, d, generator=gen(1)), torch.randn(50, d, generator=gen(2))  # [P, D]
    positions = torch.randint(0, 50, (t,), generator=gen(3))
    before = qkv.clone()
    rq, rk = OPS.rope(q, k, positions, cos, sin, isa)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, D]
    torch.testing.assert_close(rq, _rotate(q, c, s), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rk, _rotate(k, c, s), rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv, before)  # the inputs are not written


def fake_cache(lines_per_unit, rows_per_unit, layer_offset, hkv, d, parts, dtype, units=8, seed=0):
    rows2d = torch.randn(units * lines_per_unit, parts * hkv * d, generator=gen(seed)).to(dtype)  # [lines, row]
    codec = types.SimpleNamespace(fp8=False, num_kv_heads=hkv, head_dim=d)
    return types.SimpleNamespace(rows2d=rows2d, rows_per_unit=rows_per_unit, lines_per_unit=lines_per_unit,
                                 layer_offset=layer_offset, codec=codec)


def rows_at(cache, slots: torch.Tensor) -> torch.Tensor:
    lines = cache_line(slots, cache.rows_per_unit, cache.lines_per_unit, cache.layer_offset)
    return cache.rows2d[lines]  # [..., row]


def attention_ref(cache, q, index, scale, parts):
    """Each query over exactly the rows its index names, in float64."""
    n, h, d = q.shape
    hkv = cache.codec.num_kv_heads
    out = torch.zeros(n, h, d, dtype=torch.float64)
    for i in range(n):
        slots = index[i][index[i] >= 0]
        if slots.numel() == 0:
            continue
        kv = rows_at(cache, slots).double().view(-1, parts, hkv, d)  # [L, parts, H_kv, D]
        k, v = kv[:, 0], kv[:, parts - 1]  # [L, H_kv, D]
        for head in range(h):
            g = head // (h // hkv)
            p = torch.softmax(k[:, g] @ q[i, head].double() * scale, dim=0)  # [L]
            out[i, head] = p @ v[:, g]
    return out.float()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,h,hkv,d,parts", [(1, 9, 3, 64, 2), (5, 4, 1, 256, 2), (3, 6, 2, 24, 2), (2, 4, 4, 32, 1)])
def test_decode_attention_reads_exactly_the_indexed_rows(isa, dtype, n, h, hkv, d, parts):
    R, lpu, offset = 4, 12, 4  # 3 layers of 4 rows per unit; this is the middle one
    cache = fake_cache(lpu, R, offset, hkv, d, parts, dtype, seed=n + d)
    L = 9
    index = torch.randint(0, 8 * R, (n, L), generator=gen(d))
    index[:, 5:] = torch.where(torch.rand(n, L - 5, generator=gen(1)) < 0.5, -1, index[:, 5:])  # padding
    if n > 2:
        index[2] = -1  # a query that sees nothing gets zeros
    q = torch.randn(n, h, d, generator=gen(h))
    out = OPS.decode_attn(q, cache.rows2d, index, hkv, R, lpu, offset, 1 / math.sqrt(d), isa)
    torch.testing.assert_close(out, attention_ref(cache, q, index, 1 / math.sqrt(d), parts), rtol=2e-5, atol=2e-5)


def test_decode_attention_long_rows_and_extreme_scores():
    """Scores far apart (exp underflows to 0 for all but the top key) and hundreds of keys."""
    cache = fake_cache(16, 16, 0, 1, 64, 2, torch.float32, units=40, seed=3)
    cache.rows2d[:, :64] *= 40  # large keys: scores span hundreds
    index = torch.arange(600).view(1, 600)
    q = torch.randn(1, 2, 64, generator=gen(5))
    out = decode_attention(cache, q, index, 0.125)
    torch.testing.assert_close(out, attention_ref(cache, q, index, 0.125, 2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_rows_writes_k_v_at_their_lines_only(dtype):
    R, lpu, offset, hkv, d = 4, 8, 4, 2, 8
    cache = fake_cache(lpu, R, offset, hkv, d, 2, dtype, units=4)
    before = cache.rows2d.clone()
    kv = torch.randn(3, 2 * (hkv + 1) * d, generator=gen(9))
    k, v = kv[:, : hkv * d].view(3, hkv, d), kv[:, hkv * d: 2 * hkv * d].view(3, hkv, d)  # strided views
    slots = torch.tensor([0, 5, 14])
    store_rows(cache, slots, k, v)
    expect = before.clone()
    lines = cache_line(slots, R, lpu, offset)
    expect[lines] = torch.cat((k.flatten(1), v.flatten(1)), dim=1).to(dtype)
    assert torch.equal(cache.rows2d, expect)


def test_store_rows_takes_any_strides():
    """An expanded row (stride 0 along the head) is stored as the values it shows."""
    cache = fake_cache(8, 4, 0, 2, 8, 2, torch.float32, units=2)
    pos = torch.tensor([3.0, 5.0])
    rows = pos[:, None, None].expand(-1, 2, 8)  # [2, H_kv, D], strides (1, 0, 0)
    store_rows(cache, torch.tensor([2, 7]), rows, rows)
    assert torch.equal(rows_at(cache, torch.tensor([2, 7])), pos[:, None].expand(-1, 32))


def test_store_rows_keeps_the_last_row_for_a_slot_named_twice():
    """A chunk longer than a ring names a slot more than once: the later row wins, as in a
    sequential store, whatever the threads (heads run in parallel, rows in order)."""
    cache = fake_cache(8, 4, 0, 3, 64, 2, torch.float32, units=10)
    k, v = torch.randn(2, 300, 3, 64, generator=gen(6)).unbind(0)  # enough rows for the threaded path
    slots = torch.randint(0, 40, (300,), generator=gen(7))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        store_rows(cache, slots, k, v)
    finally:
        torch.set_num_threads(before)
    last = {int(s): t for t, s in enumerate(slots)}
    for slot, t in last.items():
        assert torch.equal(rows_at(cache, torch.tensor([slot]))[0], torch.cat((k[t].flatten(), v[t].flatten())))


def test_store_rows_of_a_shared_k_equals_v_row():
    cache = fake_cache(8, 4, 0, 1, 16, 1, torch.float32, units=2)
    k = torch.randn(2, 1, 16, generator=gen(4))
    store_rows(cache, torch.tensor([1, 6]), k, None)
    assert torch.equal(rows_at(cache, torch.tensor([1, 6])), k.flatten(1))


def test_kernels_refuse_slots_past_the_cache():
    cache = fake_cache(8, 4, 4, 1, 8, 2, torch.float32, units=2)
    k = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="slot 9 is past the cache"):
        store_rows(cache, torch.tensor([9]), k, k)
    with pytest.raises(RuntimeError, match="slot 9 is past the cache"):
        decode_attention(cache, torch.zeros(1, 1, 8), torch.tensor([[0, 9]]), 1.0)


def test_fp8_and_bf16_activations_take_the_torch_paths():
    cache = fake_cache(8, 4, 0, 1, 8, 2, torch.float32)
    q = torch.randn(1, 1, 8)
    decode, store = fused.decode_attention_op(lambda *a: "torch"), fused.store_rows_op(lambda *a: "torch")
    assert decode(cache, q.bfloat16(), torch.tensor([[0]]), 1.0) == "torch"
    assert fused.rms_norm_op(lambda *a: "torch")(q.bfloat16(), torch.ones(8), 1e-6) == "torch"
    cache.codec.fp8 = True
    assert decode(cache, q, torch.tensor([[0]]), 1.0) == "torch"
    assert store(cache, torch.tensor([0]), q, q) == "torch"


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_layers_agree_with_their_torch_paths(isa_env, offset):
    norm = RMSNorm(48, 1e-6, offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=gen(1)))
    rotary = RotaryEmbedding(1.0 / 10000 ** (torch.arange(0, 16, 2) / 16), 64)
    x = torch.randn(3, 48, generator=gen(2))
    q, k = torch.randn(3, 4, 16, generator=gen(3)), torch.randn(3, 2, 16, generator=gen(4))
    positions = torch.tensor([0, 17, 63])
    isa_env("avx512")
    fast = norm(x), rotary(positions, q, k)
    isa_env("none")
    assert rms_norm.pick(rms_norm.kind(x, norm.weight, 1e-6), kernel_isa()) is torch_rms_norm
    plain = norm(x), rotary(positions, q, k)
    torch.testing.assert_close(fast[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast[1], plain[1], rtol=1e-6, atol=1e-6)
