"""Split-K invariant attention (ops/invariant_cpu.cpp): a query's keys are cut into chunks of 512 at
absolute positions; each chunk's partial (max, sum of exp, weighted values) is merged in chunk order.
Checked against float64 softmax attention at lengths that cross several chunks (windows, soft-cap,
sinks, a chunk with nothing visible), and for bits: a query has the same output read alone by decode
(one task per chunk), among a batch (one task per query), as a query of a prefill chunk cut
anywhere, under 1 and 2 threads, over fp32, bf16 and int8 (q8) rows.
"""

from __future__ import annotations

import types

import pytest
import torch

from deepinfer.model_executor.layers.ops.addressing import cache_line
from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa
from deepinfer.model_executor.layers.ops.q8 import dequantize_q8, quantize_q8
from tests.ops.test_invariant_cpu import decode_kernel, gen, prefill_kernel, threads

ISAS = [isa for isa in (1, 2) if kernel_isa() >= isa]
ROWS = ["float32", "bfloat16", "int8"]
R, LPU, OFFSET = 16, 32, 16  # 16 rows per block, 2 layers per unit; the cache is the second layer
LENGTH = 1100  # chunks [0, 512), [512, 1024), [1024, 1100)
QUERIES = [0, 3, 511, 512, 513, 700, 1023, 1024, 1099]


class Sequence:
    """One request's K|V rows in a paged cache (shuffled blocks) in one row format:
    K, V [P, H_kv, D] fp32 as computed; `kv` [P, 2, H_kv, D] fp32 as the cache holds them."""

    def __init__(self, hkv: int, d: int, rows: str, seed: int, length: int = LENGTH):
        self.k = torch.randn(length, hkv, d, generator=gen(seed))
        self.v = torch.randn(length, hkv, d, generator=gen(seed + 1))
        units = -(-length // R) + 2
        table = torch.randperm(units, generator=gen(seed + 2))
        self.slots = table[torch.arange(length) // R] * R + torch.arange(length) % R  # [P]
        flat = torch.cat((self.k.flatten(1), self.v.flatten(1)), 1)  # [P, E]
        if rows == "int8":
            stored = quantize_q8(flat)  # [P, row bytes]
            self.kv = dequantize_q8(stored, torch.float32).view(length, 2, hkv, d)
        else:
            stored = flat.to(getattr(torch, rows))  # [P, E]
            self.kv = stored.float().view(length, 2, hkv, d)
        rows2d = torch.zeros(units * LPU, stored.shape[1], dtype=stored.dtype)
        rows2d[cache_line(self.slots, R, LPU, OFFSET)] = stored
        self.loadable = stored.view(length, 2, hkv, d) if rows != "int8" else self.kv  # what a cache load returns
        codec = types.SimpleNamespace(fp8=False, num_kv_heads=hkv, head_dim=d)
        self.cache = types.SimpleNamespace(rows2d=rows2d, rows_per_unit=R, lines_per_unit=LPU, layer_offset=OFFSET,
                                           codec=codec)


def first_of(p: int, window: int | None) -> int:
    return max(0, p - window + 1) if window else 0


def decode(seq: Sequence, q: torch.Tensor, queries: list[int], width: int, window, isa, opts) -> torch.Tensor:
    """Decode queries at positions `queries` [N], index rows padded with -1 to `width` columns -> [N, H, D]."""
    first = torch.tensor([first_of(p, window) for p in queries])
    cols = torch.arange(width)
    index = torch.stack([torch.where(cols <= p - f, seq.slots[(f + cols).clamp(max=p)], -1)
                         for p, f in zip(queries, first.tolist(), strict=True)])  # [N, width]
    args = (seq.cache, q[queries], index, first, *opts)
    return decode_kernel.pick(decode_kernel.kind(*args), isa)(*args)


def prefill(seq: Sequence, q: torch.Tensor, s: int, e: int, window, isa, opts) -> torch.Tensor:
    """Queries s .. e-1 as one prefill chunk over the loaded rows they see -> [e - s, H, D]."""
    start = first_of(s, window)
    args = (seq.cache, q[s:e], seq.k[s:e], seq.v[s:e], seq.loadable[start:s], torch.arange(s, e), start, window,
            *opts)
    return prefill_kernel.pick(prefill_kernel.kind(*args), isa)(*args)


def reference(seq: Sequence, q: torch.Tensor, queries: list[int], window, scale, softcap=None, sinks=None,
              hidden: slice | None = None) -> torch.Tensor:
    """Softmax attention in float64 over each query's visible rows as the cache holds them -> [N, H, D]."""
    kv = seq.kv.double()  # [P, 2, H_kv, D]
    h = q.shape[1]
    group = h // kv.shape[2]
    out = []
    for p in queries:
        keep = torch.zeros(kv.shape[0], dtype=torch.bool)
        keep[first_of(p, window):p + 1] = True
        if hidden is not None:
            keep[hidden] = False
        k = kv[keep, 0].repeat_interleave(group, 1)  # [n, H, D]
        v = kv[keep, 1].repeat_interleave(group, 1)  # [n, H, D]
        s = torch.einsum("hd,nhd->hn", q[p].double(), k) * scale  # [H, n]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:
            s = torch.cat((s, sinks.double()[:, None]), 1)  # [H, n + 1]
        w = torch.softmax(s, 1)[:, :k.shape[0]]  # [H, n]
        out.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(out)  # [N, H, D]


# H, H_kv, D, window, softcap, sinks: Qwen2-1.5B's heads; SmolLM2's (3 KV heads) with a window whose
# first chunk is cut, a soft-cap and sinks.
SHAPES = [(12, 2, 128, None, None, False), (9, 3, 64, 600, 20.0, True)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,window,softcap,with_sinks", SHAPES)
def test_split_k_is_softmax_attention(isa, rows, num_heads, num_kv_heads, head_dim, window, softcap, with_sinks):
    seq = Sequence(num_kv_heads, head_dim, rows, seed=head_dim)
    q = torch.randn(LENGTH, num_heads, head_dim, generator=gen(num_heads))
    sinks = torch.randn(num_heads, generator=gen(5)) + 2 if with_sinks else None
    scale = head_dim ** -0.5
    opts = (scale, softcap, sinks)
    expect = reference(seq, q, QUERIES, window, *opts)
    torch.testing.assert_close(decode(seq, q, QUERIES, LENGTH, window, isa, opts).double(), expect,
                               rtol=2e-5, atol=2e-5)
    tail = prefill(seq, q, 1000, LENGTH, window, isa, opts)  # [100, H, D]: queries 1000 .. 1099
    torch.testing.assert_close(tail[[24, 99]].double(), expect[-2:], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_a_chunk_with_nothing_visible_and_dominant_sinks(isa):
    """Columns 512 .. 1023 hidden (the middle chunk has no partial), sinks far above every logit
    (each chunk's weights scaled far down in the merge), and a query that sees nothing (zeros)."""
    seq = Sequence(1, 64, "float32", seed=3)
    q = torch.randn(2, 2, 64, generator=gen(4))
    sinks = torch.tensor([30.0, -30.0])
    index = seq.slots[None].repeat(2, 1)  # [2, P]
    index[:, 512:1024] = -1
    index[1] = -1
    first = torch.zeros(2, dtype=torch.long)
    args = (seq.cache, q, index, first, 0.125, None, sinks)
    out = decode_kernel.pick(decode_kernel.kind(*args), isa)(*args)
    assert torch.equal(out[1], torch.zeros(2, 64))
    big = torch.zeros(LENGTH, 2, 64)
    big[LENGTH - 1] = q[0]
    expect = reference(seq, big, [LENGTH - 1], None, 0.125, None, sinks, hidden=slice(512, 1024))
    torch.testing.assert_close(out[0].double(), expect[0], rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,window", [("float32", None), ("bfloat16", 600), ("int8", None), ("int8", 600)])
def test_split_k_bits_across_threads_batches_and_paths(isa, rows, window):
    """Each query of QUERIES decoded alone under 1 thread (one task per chunk) is the reference; under 1
    and 2 threads: the same queries as one decode batch (one task per query) with index rows 70
    columns wider, and reversed; prefill in chunks cut at 400, 700 and 1000 (1 thread), in one chunk
    of all 1100 queries (2 threads), and a one-query chunk: ==."""
    seq = Sequence(2, 64, rows, seed=11)
    q = torch.randn(LENGTH, 6, 64, generator=gen(12))
    opts = (0.125, None, None)
    with threads(1):
        alone = torch.cat([decode(seq, q, [p], LENGTH, window, isa, opts) for p in QUERIES])
    for n in (1, 2):
        with threads(n):
            assert torch.equal(decode(seq, q, QUERIES, LENGTH + 70, window, isa, opts), alone), n
            assert torch.equal(decode(seq, q, QUERIES[::-1], LENGTH, window, isa, opts), alone.flip(0)), n
            cuts = [0, 400, 700, 1000, LENGTH] if n == 1 else [0, LENGTH]
            spans = zip(cuts[:-1], cuts[1:], strict=True)
            out = torch.cat([prefill(seq, q, s, e, window, isa, opts) for s, e in spans])  # [P, H, D]
            assert torch.equal(out[QUERIES], alone), (n, cuts)
            assert torch.equal(prefill(seq, q, 1024, 1025, window, isa, opts)[0], alone[QUERIES.index(1024)]), n
