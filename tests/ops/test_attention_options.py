"""Attention options (logit soft-cap, per-head sinks) in every backend and kernel set, against a
plain float64 formula on random inputs:

    s_j = q . k_j * scale;  s_j = cap * tanh(s_j / cap)            (soft-cap)
    p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i))                  (sink: in the denominator only)
    out = sum_j p_j v_j

Decode kernels (torch reference, fused C++, Triton interpreted, batch-invariant C++ and torch) read
index rows of a paged cache (shuffled blocks, -1 padding) and of a ring (sliding window); prefill
kernels (torch reference, batch-invariant C++ and torch) run chunks over [loaded | chunk], with and
without a window. The batch-invariant paths keep a query's bits in any batch and chunking with
the options on; each backend's `forward` hands the options to every hook. The Triton cases run on
CUDA where torch sees a device (scripts/gpu_check.sh runs them there), else interpreted.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from deepinfer.contracts.cache import PAGED, RING, CacheGroupSpec, RowSpec
from deepinfer.model_executor.layers.attention import invariant
from deepinfer.model_executor.layers.attention.backend import (
    AttentionMetadata,
    GroupMetadata,
    PrefillSegment,
    TorchAttentionBackend,
)
from deepinfer.model_executor.layers.attention.layer import Attention
from deepinfer.model_executor.layers.attention.triton_backend import TritonAttentionBackend
from deepinfer.model_executor.layers.kernel_set import TORCH_KERNELS
from deepinfer.model_executor.layers.ops import fused
from deepinfer.model_executor.layers.ops import torch_attention as torch_ref
from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa
from deepinfer.worker.cache_engine import CacheEngine, RowCodec

H, HKV, D = 4, 2, 32
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CAP = 2.0  # the scores below reach +-10: the cap bends most of them
OPTIONS = {"softcap": (CAP, False), "sinks": (None, True), "both": (CAP, True)}


def _no_reference(*args):
    raise AssertionError("the torch reference ran where the kernel serves the call")


fused_decode = fused.decode_attention_op(_no_reference)
invariant_decode_kernel = fused.invariant_decode_attention_op(_no_reference)
invariant_prefill_kernel = fused.invariant_prefill_attention_op(_no_reference)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def options(name: str) -> tuple[float | None, torch.Tensor | None]:
    cap, with_sinks = OPTIONS[name]
    return cap, (torch.randn(H, generator=gen(11)) * 2 + 6 if with_sinks else None)


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Rows:
    """One request's K, V [P, H_kv, D] in layer 1 of a 3-layer cache group: paged (16-row blocks in
    shuffled units) or, with a window, a ring of W + 4 rows holding the last W + 4 positions."""

    def __init__(self, length: int, window: int | None = None, kv_cache_dtype: str = "auto", seed: int = 0,
                 device: str = "cpu"):
        self.length, self.window = length, window
        self.k = torch.randn(length, HKV, D, generator=gen(seed)) * 1.5
        self.v = torch.randn(length, HKV, D, generator=gen(seed + 1))
        if window is None:
            rows, units = 16, -(-length // 16) + 2
            table = torch.randperm(units, generator=gen(seed + 2))
            self.slots = table[torch.arange(length) // rows] * rows + torch.arange(length) % rows  # [P]
            kept = torch.arange(length)
        else:
            rows, units = window + 4, 2
            self.slots = rows + torch.arange(length) % rows  # state 1: row p mod S
            kept = torch.arange(max(0, length - rows), length)  # the ring holds the last S positions
        group = CacheGroupSpec("g", RING if window else PAGED, (0, 1, 2), rows_per_unit=rows, window=window,
                               row=RowSpec(HKV, D))
        codec = RowCodec(HKV, D, torch.float32, kv_cache_dtype)
        self.cache = CacheEngine([group], [units], [codec], torch.device(device)).group_caches(0)[1]
        self.cache.store(self.slots[kept].to(device), self.k[kept].to(device), self.v[kept].to(device))

    def first(self, p: int) -> int:
        return max(0, p - self.window + 1) if self.window else 0

    def index(self, queries: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(index rows [N, width]: each query's visible slots in position order, then -1; first [N])."""
        first = torch.tensor([self.first(p) for p in queries])
        cols = torch.arange(width)
        index = torch.stack([torch.where(cols <= p - f, self.slots[(f + cols).clamp(max=p)], -1)
                             for p, f in zip(queries, first.tolist(), strict=True)])
        return index, first

    def held(self, start: int, end: int) -> torch.Tensor:
        """Rows of positions start .. end-1 as the cache returns them -> [n, 2, H_kv, D] (on the CPU)."""
        return self.cache.load(self.slots[start:end].to(self.cache.rows2d.device)).cpu()


def reference(rows: Rows, q: torch.Tensor, queries: list[int], scale: float, softcap, sinks) -> torch.Tensor:
    """The formula above in float64, each query over its visible rows as the cache holds them."""
    out = torch.zeros(len(queries), H, D, dtype=torch.float64)
    for i, p in enumerate(queries):
        kv = rows.held(rows.first(p), p + 1).double()  # [L, 2, H_kv, D]
        for h in range(H):
            s = kv[:, 0, h // (H // HKV)] @ q[i, h].double() * scale  # [L]
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            sink = torch.tensor([-math.inf if sinks is None else float(sinks[h])], dtype=torch.float64)
            p_all = torch.softmax(torch.cat((s, sink)), dim=0)[:-1]  # [L]
            out[i, h] = p_all @ kv[:, 1, h // (H // HKV)]
    return out


def _triton_decode(cache, q, index, first, scale, softcap, sinks):
    """The Triton kernel on the cache's device (CUDA, or the CPU interpreted) -> on the CPU."""
    from deepinfer.model_executor.layers.ops.triton.decode_attention import decode_layer_attention

    device = cache.rows2d.device
    sinks = None if sinks is None else sinks.to(device)
    return decode_layer_attention(cache, q.to(device), index.to(device), scale, None, softcap, sinks).cpu()


def _device(kernel: str) -> str:
    return TRITON_DEVICE if kernel == "triton" else "cpu"


DECODE_KERNELS = {
    "torch": lambda cache, q, index, first, scale, cap, sinks: torch_ref.decode_attention(cache, q, index, scale,
                                                                                           None, cap, sinks),
    "fused": lambda cache, q, index, first, scale, cap, sinks: fused_decode(cache, q, index, scale, None, cap, sinks),
    "triton": _triton_decode,
    "invariant_cpp": lambda *args: invariant_decode_kernel(*args),
    "invariant_torch": invariant.torch_decode_attention,
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("window", [None, 24], ids=["paged", "ring"])
@pytest.mark.parametrize("kernel", list(DECODE_KERNELS))
def test_decode_kernels_honour_the_options(kernel, window, option):
    """Decode queries (the last 4 positions of 90, as a verification step reads them) through index
    rows padded 7 columns wider than the longest, against the formula; the formula without the
    option differs (so the option is not ignored)."""
    if kernel.endswith("cpp") or kernel == "fused":
        assert kernel_isa() > 0, "the C++ kernels are not built"
    rows = Rows(90, window, seed=3, device=_device(kernel))
    queries = list(range(86, 90))
    index, first = rows.index(queries, (window or 90) + 7)
    q = torch.randn(4, H, D, generator=gen(5)) * 3
    cap, sinks = options(option)
    scale = D ** -0.5
    expect = reference(rows, q, queries, scale, cap, sinks)
    out = DECODE_KERNELS[kernel](rows.cache, q, index, first, scale, cap, sinks)
    torch.testing.assert_close(out.double(), expect, rtol=2e-5, atol=2e-5)
    assert (reference(rows, q, queries, scale, None, None) - expect).abs().max() > 1e-2


@pytest.mark.parametrize("kernel", ["torch", "fused", "triton"])
def test_bf16_rows_and_edge_cases(kernel):
    """bf16 cache rows; a sink of -inf is no sink; a query that sees nothing gets zeros (sink or not);
    logits hundreds apart saturate the cap without NaN."""
    rows = Rows(40, kv_cache_dtype="bfloat16", seed=8, device=_device(kernel))
    index, first = rows.index([39, 20, 39], 40)
    index[1] = -1
    q = torch.randn(3, H, D, generator=gen(9)) * 3
    q[2] *= 100  # scores in the hundreds
    run = DECODE_KERNELS[kernel]
    cap, sinks = options("both")
    out = run(rows.cache, q, index, first, D ** -0.5, cap, sinks)
    assert torch.equal(out[1], torch.zeros(H, D)) and not out.isnan().any()
    expect = reference(rows, q[[0, 2]], [39, 39], D ** -0.5, cap, sinks)
    torch.testing.assert_close(out[[0, 2]].double(), expect, rtol=2e-5, atol=2e-5)
    no_sink = run(rows.cache, q, index, first, D ** -0.5, cap, torch.full((H,), -math.inf))
    torch.testing.assert_close(no_sink, run(rows.cache, q, index, first, D ** -0.5, cap, None), rtol=1e-6, atol=1e-6)


def _torch_prefill(rows, q, start, s, e, scale, cap, sinks):
    return torch_ref.prefill_attention(q, rows.k[s:e], rows.v[s:e], rows.held(start, s), torch.arange(s, e),
                                       torch.arange(start, s), scale, rows.window, cap, sinks)


def _invariant_prefill(op):
    def run(rows, q, start, s, e, scale, cap, sinks):
        return op(rows.cache, q, rows.k[s:e], rows.v[s:e], rows.held(start, s), torch.arange(s, e), start,
                  rows.window, scale, cap, sinks)

    return run


PREFILL_KERNELS = {"torch": _torch_prefill, "invariant_cpp": _invariant_prefill(invariant_prefill_kernel),
                   "invariant_torch": _invariant_prefill(invariant.torch_prefill_attention)}


def prefill_chunks(kernel: str, rows: Rows, q: torch.Tensor, chunk: int, scale, cap, sinks) -> torch.Tensor:
    """All of q [P, H, D] prefilled in chunks of `chunk`, each over [loaded window | chunk]."""
    outs = []
    for s in range(0, rows.length, chunk):
        e = min(s + chunk, rows.length)
        outs.append(PREFILL_KERNELS[kernel](rows, q[s:e], rows.first(s), s, e, scale, cap, sinks))
    return torch.cat(outs)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("kernel", list(PREFILL_KERNELS))
def test_prefill_kernels_honour_the_options(kernel, window, option):
    """150 tokens in chunks of 37 (cuts on and off the 64-key blocks), full or a window of 70."""
    rows = Rows(150, seed=4)
    rows.window = window  # paged rows hold every position; the window only limits what a query sees
    q = torch.randn(150, H, D, generator=gen(6)) * 3
    cap, sinks = options(option)
    expect = reference(rows, q, list(range(150)), D ** -0.5, cap, sinks)
    torch.testing.assert_close(prefill_chunks(kernel, rows, q, 37, D ** -0.5, cap, sinks).double(), expect,
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window", [None, 70])
def test_invariant_paths_keep_a_querys_bits_with_the_options(window):
    """With soft-cap and sinks: a query's output read alone by decode (1 thread) equals it in a padded
    decode batch and in prefill chunks of 150, 64, 37 and 8, under 1 and 2 threads (C++); the torch
    implementation gives a query the same bits in decode and in any prefill chunking."""
    rows = Rows(150, seed=12)
    rows.window = window
    q = torch.randn(150, H, D, generator=gen(13)) * 3
    cap, sinks = options("both")
    scale = D ** -0.5
    every = list(range(150))
    for name in ("invariant_cpp", "invariant_torch"):
        decode = DECODE_KERNELS[name]
        with threads(1):
            alone = torch.cat([decode(rows.cache, q[[p]], *rows.index([p], 150), scale, cap, sinks) for p in every])
        for n in (1, 2):
            with threads(n):
                batch = decode(rows.cache, q, *rows.index(every, 150 + 70), scale, cap, sinks)
                assert torch.equal(batch, alone), (name, n)
                for chunk in (150, 64, 37, 8):
                    assert torch.equal(prefill_chunks(name, rows, q, chunk, scale, cap, sinks), alone), (name, chunk)


def _step(rows: Rows, decode_at: int, chunk: tuple[int, int]) -> tuple[AttentionMetadata, GroupMetadata]:
    """A step of one decode query at `decode_at` (its row already stored) and one prefill chunk
    [s, e) over the loaded rows before it; the chunk's rows are stored at their slots."""
    s, e = chunk
    index, _ = rows.index([decode_at], decode_at + 1)
    start = rows.first(s)
    seg = PrefillSegment(1, 1 + e - s, rows.slots[start:s], torch.arange(start, s))
    group = GroupMetadata(rows.window, rows.slots[s:e], torch.arange(1, 1 + e - s), index, [seg])
    return AttentionMetadata(torch.cat((torch.tensor([decode_at]), torch.arange(s, e))), 1, [group]), group


@pytest.mark.parametrize("backend", ["torch", "fused", "invariant_cpp", "invariant_torch", "triton"])
def test_every_backend_forward_hands_the_options_to_its_hooks(backend):
    """AttentionBackend.forward (load, store, decode, prefill) with both options, for each backend and
    kernel set, against the formula."""
    backends = {"torch": lambda: TorchAttentionBackend(False, TORCH_KERNELS), "fused": TorchAttentionBackend,
                "invariant_cpp": lambda: TorchAttentionBackend(True),
                "invariant_torch": lambda: TorchAttentionBackend(True, TORCH_KERNELS),
                "triton": TritonAttentionBackend}
    device = _device(backend)
    full = Rows(80, seed=14)
    rows = Rows(80, seed=14, device=device)  # the same K, V; positions 60 .. 79 not stored yet
    rows.cache.rows2d.zero_()
    rows.cache.store(rows.slots[:60].to(device), rows.k[:60].to(device), rows.v[:60].to(device))
    md, _ = _step(rows, 45, (60, 80))
    md = md.to(device)
    q = torch.randn(21, H, D, generator=gen(15)) * 3
    cap, sinks = options("both")
    k = torch.cat((rows.k[45:46], rows.k[60:80]))
    v = torch.cat((rows.v[45:46], rows.v[60:80]))
    q, k, v, sinks = (t.to(device) for t in (q, k, v, sinks))
    out = backends[backend]().forward(rows.cache, q, k, v, md, md.groups[0], D ** -0.5, cap, sinks).cpu()
    q = q.cpu()
    expect = reference(full, q, [45] + list(range(60, 80)), D ** -0.5, cap, sinks)
    torch.testing.assert_close(out.double(), expect, rtol=2e-5, atol=2e-5)


def test_the_layer_keeps_sinks_as_a_reference_and_checks_its_options():
    layer = Attention(H, HKV, D, 0.1, 0, softcap=30)
    owner = torch.nn.Parameter(torch.zeros(H))
    layer.sinks = owner
    assert layer.sinks is owner and layer.softcap == 30.0
    assert not list(layer.parameters()) and "sinks" not in layer.state_dict()
    with pytest.raises(ValueError, match=r"sinks must have one logit per query head \(4\)"):
        layer.sinks = torch.zeros(3)
    with pytest.raises(ValueError, match="softcap must be a positive number or None, got 0"):
        Attention(H, HKV, D, 0.1, 0, softcap=0)
