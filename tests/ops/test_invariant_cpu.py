"""The CPU default path's row independence, op by op: the batch-invariant kernels of
invariant_cpu.cpp (attention, GeGLU) and the fused kernels of fused_cpu.cpp, for every
instruction set this CPU runs.

The invariant attention is its own path (it does not give the torch implementation's bits): it is
checked against float64 softmax attention, and its invariance directly: a query's output has the
same bits read alone by decode, in a padded decode batch, or as a query of prefill chunks cut
anywhere, with fp32 and bf16 cache rows, under 1, 2 and 3 threads. The other ops: a row alone vs
the same row inside a batch (at another place, another alignment, another thread split), with `==`.
"""

import contextlib
import math
import types

import pytest
import torch

from deepinfer.model_executor.layers import activation
from deepinfer.model_executor.layers.attention import invariant
from deepinfer.model_executor.layers.norm import rms_norm
from deepinfer.model_executor.layers.ops import fused
from deepinfer.model_executor.layers.ops.addressing import cache_line
from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa
from deepinfer.model_executor.layers.rotary import RotaryEmbedding

ISAS = [isa for isa in (1, 2) if kernel_isa() >= isa]
THREADS = (1, 2, 3)
R, LPU, OFFSET = 16, 48, 16  # 16 rows per block, 3 layers per unit; the cache below is the middle layer


def _no_reference(*args):
    raise AssertionError("the torch reference ran where the kernel serves the call")


decode_kernel = fused.invariant_decode_attention_op(_no_reference)
prefill_kernel = fused.invariant_prefill_attention_op(_no_reference)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Sequence:
    """One request's K|V rows in a paged cache (blocks in shuffled units), as the engine stores them:
    K, V [P, H_kv, D] fp32, rows of `dtype`; slot of position p: table[p // R] * R + p % R."""

    def __init__(self, length: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
        self.k = torch.randn(length, hkv, d, generator=gen(seed))
        self.v = torch.randn(length, hkv, d, generator=gen(seed + 1))
        units = -(-length // R) + 2
        self.table = torch.randperm(units, generator=gen(seed + 2))
        self.slots = self.table[torch.arange(length) // R] * R + torch.arange(length) % R  # [P]
        rows2d = torch.full((units * LPU, 2 * hkv * d), float("nan")).to(dtype)  # unread lines are NaN
        rows2d[cache_line(self.slots, R, LPU, OFFSET)] = torch.cat((self.k.flatten(1), self.v.flatten(1)), 1).to(dtype)
        codec = types.SimpleNamespace(fp8=False, num_kv_heads=hkv, head_dim=d)
        self.cache = types.SimpleNamespace(rows2d=rows2d, rows_per_unit=R, lines_per_unit=LPU, layer_offset=OFFSET,
                                           codec=codec)

    def loaded(self, start: int, end: int) -> torch.Tensor:
        """Rows of positions start .. end-1 as a cache load returns them -> [n, 2, H_kv, D]."""
        lines = cache_line(self.slots[start:end], R, LPU, OFFSET)
        return self.cache.rows2d[lines].view(end - start, 2, *self.k.shape[1:])


def first_of(p: int, window: int | None) -> int:
    return max(0, p - window + 1) if window else 0


def decode_rows(seq: Sequence, q: torch.Tensor, queries: list[int], width: int, window, scale, isa) -> torch.Tensor:
    """Decode queries at positions `queries`, index rows padded with -1 to `width` columns."""
    first = torch.tensor([first_of(p, window) for p in queries])
    cols = torch.arange(width)
    index = torch.stack([torch.where(cols <= p - f, seq.slots[(f + cols).clamp(max=p)], -1)
                         for p, f in zip(queries, first.tolist(), strict=True)])  # [N, width]
    return decode_kernel.pick(decode_kernel.kind(seq.cache, q, index, first, scale), isa)(
        seq.cache, q[queries], index, first, scale)


def prefill_chunks(seq: Sequence, q: torch.Tensor, chunk: int, window, scale, isa) -> torch.Tensor:
    """The whole sequence prefilled in chunks of `chunk`, each over [loaded | chunk]."""
    run, outs = None, []
    for s in range(0, q.shape[0], chunk):
        e = min(s + chunk, q.shape[0])
        start = first_of(s, window)
        args = (seq.cache, q[s:e], seq.k[s:e], seq.v[s:e], seq.loaded(start, s), torch.arange(s, e), start, window,
                scale)
        run = run or prefill_kernel.pick(prefill_kernel.kind(*args), isa)
        outs.append(run(*args))
    return torch.cat(outs)


def reference(seq: Sequence, q: torch.Tensor, window, scale, dtype) -> torch.Tensor:
    """Softmax attention in float64 over each query's visible rows, as the cache holds them."""
    k, v = seq.k.to(dtype).double(), seq.v.to(dtype).double()
    n, h, d = q.shape
    group = h // k.shape[1]
    out = torch.empty(n, h, d, dtype=torch.float64)
    for p in range(n):
        f = first_of(p, window)
        for head in range(h):
            w = torch.softmax(k[f:p + 1, head // group] @ q[p, head].double() * scale, dim=0)  # [L]
            out[p, head] = w @ v[f:p + 1, head // group]
    return out


# H, H_kv, D, window. The AVX-512 value sums take heads four at a time, then the last 1-3 heads in one
# pass over slices of the row: G = 7 and 3 with D = 128 and 256 cover a last pass of 3 heads.
SHAPES = [(9, 3, 64, None), (4, 1, 256, 40), (4, 2, 48, None), (6, 6, 16, 70), (7, 1, 128, None),
          (6, 2, 256, 90)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,window", SHAPES)
def test_attention_is_softmax_attention(isa, dtype, num_heads, num_kv_heads, head_dim, window):
    """SmolLM2's and Gemma 3's heads (G = 3, 4; D = 64, 256), an odd head size, windows, and groups
    of 7 and 3 heads at D = 128 and 256."""
    length, scale = 150, head_dim ** -0.5
    seq = Sequence(length, num_kv_heads, head_dim, dtype, seed=head_dim)
    q = torch.randn(length, num_heads, head_dim, generator=gen(num_heads))
    expect = reference(seq, q, window, scale, dtype)
    decode = decode_rows(seq, q, list(range(length)), length, window, scale, isa)
    torch.testing.assert_close(decode.double(), expect, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(prefill_chunks(seq, q, 37, window, scale, isa).double(), expect, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,window", SHAPES[:2] + SHAPES[3:])
def test_a_query_has_the_same_bits_in_any_batch_chunking_and_thread_split(isa, dtype, num_heads, num_kv_heads,
                                                                          head_dim, window):
    """Every query of a 200-token sequence: decode alone (1 thread) is the reference; decode among
    all the others with index rows padded 70 columns wider, and prefill in chunks of 200, 64, 37, 8
    and 1 (chunk boundaries on and off the 64-key blocks), under 1, 2 and 3 threads: ==."""
    length, scale = 200, head_dim ** -0.5
    seq = Sequence(length, num_kv_heads, head_dim, dtype, seed=head_dim + 1)
    q = torch.randn(length, num_heads, head_dim, generator=gen(num_heads + 1))
    with threads(1):
        alone = torch.cat([decode_rows(seq, q, [p], length, window, scale, isa) for p in range(length)])
    for n in THREADS:
        with threads(n):
            assert torch.equal(decode_rows(seq, q, list(range(length)), length + 70, window, scale, isa), alone), n
            assert torch.equal(decode_rows(seq, q, list(range(length))[::-1], length, window, scale, isa),
                               alone.flip(0)), n
            for chunk in (200, 64, 37, 8, 1):
                assert torch.equal(prefill_chunks(seq, q, chunk, window, scale, isa), alone), (n, chunk)


@pytest.mark.parametrize("isa", ISAS)
def test_attention_edge_cases(isa):
    """A query that sees nothing gets zeros; a hidden column inside a row weighs exactly 0; scores
    hundreds apart (every weight but the top one underflows) stay exact."""
    seq = Sequence(130, 1, 64, torch.float32, seed=7)
    q = torch.randn(3, 2, 64, generator=gen(8)) * 30  # scores span hundreds
    index = seq.slots[:130].repeat(3, 1)  # [3, 130]
    index[1] = -1
    index[2, 5] = -1
    first = torch.zeros(3, dtype=torch.long)
    out = decode_kernel.pick(decode_kernel.kind(seq.cache, q, index, first, 0.125), isa)(
        seq.cache, q, index, first, 0.125)
    assert torch.equal(out[1], torch.zeros(2, 64))
    keep = torch.arange(130) != 5
    for i, visible in ((0, torch.ones(130, dtype=torch.bool)), (2, keep)):
        for h in range(2):
            w = torch.softmax(seq.k[visible, 0].double() @ q[i, h].double() * 0.125, dim=0)
            torch.testing.assert_close(out[i, h].double(), w @ seq.v[visible, 0].double(), rtol=1e-4, atol=1e-4)


def test_other_call_classes_take_the_torch_implementation():
    """bf16 queries and MXFP8 rows run the torch implementation, for decode and prefill alike (so a
    query never mixes the two)."""
    seq = Sequence(8, 1, 16, torch.float32, seed=9)
    q = torch.randn(1, 2, 16)
    args = (q, torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1.0)
    assert invariant.decode_attention.pick(invariant.decode_attention.kind(seq.cache, q.bfloat16(), *args[1:]),
                                           2) is invariant.torch_decode_attention
    seq.cache.codec.fp8 = True
    assert invariant.decode_attention.pick(invariant.decode_attention.kind(seq.cache, *args), 2) \
        is invariant.torch_decode_attention
    prefill = (seq.cache, q, q[:, :1], q[:, :1], seq.loaded(0, 0), torch.arange(1), 0, None, 1.0)
    assert invariant.prefill_attention.pick(invariant.prefill_attention.kind(*prefill), 2) \
        is invariant.torch_prefill_attention
    seq.cache.codec.fp8 = False
    assert invariant.prefill_attention.pick(invariant.prefill_attention.kind(*prefill), 2) \
        is not invariant.torch_prefill_attention


def test_prefill_refuses_rows_that_do_not_follow():
    seq = Sequence(40, 1, 16, torch.float32, seed=10)
    q = torch.randn(4, 1, 16)
    with pytest.raises(RuntimeError, match="must follow the loaded rows"):
        prefill_kernel(seq.cache, q, q, q, seq.loaded(0, 10), torch.arange(11, 15), 0, None, 1.0)
    with pytest.raises(RuntimeError, match="before the first row"):
        prefill_kernel(seq.cache, q, q, q, seq.loaded(5, 10), torch.arange(10, 14), 5, None, 1.0)


# ---- row-wise ops ----------------------------------------------------------------------------


def rows_alone_and_batched(op, x: torch.Tensor, rows=range(0, 37, 5)) -> None:
    """op(x rows [T, ...], their row ids [T]) over all of x vs over each row alone: ==, under 1, 2
    and 3 threads, and for a copy of x that starts one element off the allocation's alignment. An
    op returning a tuple is compared part by part."""
    def parts(out, r=None):
        out = out if isinstance(out, tuple) else (out,)
        return [o if r is None else o[r:r + 1] for o in out]

    every = torch.arange(x.shape[0])
    with threads(1):
        alone = [parts(op(x[r:r + 1], every[r:r + 1])) for r in rows]
    for n in THREADS:
        with threads(n):
            shifted = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape).copy_(x)  # misaligned rows
            for batch in (x, shifted):
                out = op(batch, every)
                for r, one in zip(rows, alone, strict=True):
                    assert all(map(torch.equal, parts(out, r), one)), f"row {r}, {n} threads"


def test_fused_rms_norm_rope_and_silu_are_row_independent():
    """fused_cpu.cpp's per-row loops as the layers call them: RMSNorm (hidden rows, Gemma's q/k norm
    over [T, H, D] with offset 1), RoPE on q and k views of one fused projection, SwiGLU."""
    assert kernel_isa() > 0
    w = torch.randn(576, generator=gen(1))
    rows_alone_and_batched(lambda t, i: rms_norm(t, w, 1e-5, 0.0), torch.randn(40, 576, generator=gen(2)) * 3)
    rows_alone_and_batched(lambda t, i: rms_norm(t, w[:256], 1e-6, 1.0), torch.randn(40, 4, 256, generator=gen(3)))
    rows_alone_and_batched(lambda t, i: activation.silu_and_mul(t), torch.randn(40, 2 * 1536, generator=gen(4)) * 4)
    rotary = RotaryEmbedding(1.0 / 10000 ** (torch.arange(0, 64, 2) / 64), 4096)
    positions = torch.randint(0, 4096, (40,), generator=gen(5))
    qk = torch.randn(40, 12, 64, generator=gen(6))  # q [T, 9, 64] and k [T, 3, 64] as views of one tensor
    rows_alone_and_batched(lambda t, i: rotary(positions[i], t[:, :9], t[:, 9:]), qk)


@pytest.mark.parametrize("isa", ISAS)
def test_gelu_tanh_mul_is_gelu_and_row_independent(isa):
    x = torch.randn(40, 2 * 2048, generator=gen(7)) * 4
    gate, up = x.double().chunk(2, dim=-1)
    expect = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))) * up
    torch.testing.assert_close(torch.ops.deepinfer_cpu.gelu_tanh_mul(x, isa).double(), expect, rtol=3e-6, atol=3e-6)
    rows_alone_and_batched(lambda t, i: torch.ops.deepinfer_cpu.gelu_tanh_mul(t, isa), x, rows=range(40))


def test_the_activations_models_call_are_row_independent():
    """Gemma 3's GeGLU and the Llama family's SwiGLU as the models call them: F.gelu's vectorized
    loop rounds a thread chunk's tail differently, which 3 threads over Gemma's 2048 columns hit."""
    x = torch.randn(64, 2 * 2048, generator=gen(8)) * 3
    rows_alone_and_batched(lambda t, i: activation.gelu_tanh_and_mul(t), x, rows=range(64))
    rows_alone_and_batched(lambda t, i: activation.silu_and_mul(t), x, rows=range(64))
