"""The Triton sparse MLA decode against the torch reference (`layers/ops/torch_sparse_mla.py`),
both reading the same LayerCaches: ring window rows that wrap, paged compressed rows, -1 padding,
MXFP8 / bf16 / fp32 rows, odd head counts and widths, two head blocks."""

import pytest
import torch

from deepinfer.contracts.cache import PAGED, RING, CacheGroupSpec, RowSpec
from deepinfer.model_executor.layers.ops import torch_sparse_mla as ref
from deepinfer.model_executor.layers.ops.addressing import ring_read_index
from deepinfer.model_executor.layers.ops.triton import sparse_mla as tri
from deepinfer.worker.cache_engine import CacheEngine, RowCodec

RING_ROWS, WINDOW, STATES = 11, 9, 3
BLOCK_ROWS, BLOCKS = 4, 6


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def caches(d: int, dtype: torch.dtype, kv_cache_dtype: str):
    """(ring, compressed) LayerCaches of layer 1 of two-layer groups (a non-zero layer offset),
    every row written through the torch store."""
    codec = RowCodec(1, d, dtype, kv_cache_dtype, shared_kv=True)
    row = RowSpec(1, d, shared_kv=True)
    groups = [CacheGroupSpec("swa", RING, (0, 1), RING_ROWS, WINDOW, row=row),
              CacheGroupSpec("csa", PAGED, (0, 1), BLOCK_ROWS, compress_ratio=4, row=row)]
    engine = CacheEngine(groups, [STATES, BLOCKS], [codec, codec], torch.device("cpu"))
    ring, comp = engine.group_caches(0)[1], engine.group_caches(1)[1]
    for i, cache in enumerate((ring, comp)):
        n = cache.view.shape[0] * cache.rows_per_unit
        cache.store(torch.arange(n), (torch.randn(n, 1, d, generator=gen(i)) * 1.5).to(dtype), None)
    return ring, comp


def window_index(n: int) -> torch.Tensor:
    """[n, W] ring read indices: states 0..2 at lengths that wrap the ring, one short (-1 padding)."""
    offset = torch.tensor([0 * RING_ROWS + 5, 1 * RING_ROWS + 8, 2 * RING_ROWS + 0, 1 * RING_ROWS + 10])[:n]
    length = torch.tensor([WINDOW, WINDOW, 4, 7])[:n]
    return ring_read_index(offset, length, WINDOW, RING_ROWS)  # [n, W]


def compressed_index(n: int, width: int) -> torch.Tensor:
    """[n, width] distinct paged slots per query with a -1 tail of varying length."""
    rows = torch.stack([torch.randperm(BLOCK_ROWS * BLOCKS, generator=gen(10 + i))[:width] for i in range(n)])
    cols = torch.arange(width)
    return rows.masked_fill(cols[None, :] >= torch.tensor([width, width - 2, 1, 0])[:n, None], -1)  # [n, width]


CASES = [  # kv_cache_dtype, dtype, heads, head_dim, compressed width
    ("auto", torch.float32, 5, 64, 7),
    ("bfloat16", torch.float32, 3, 48, 19),
    ("auto", torch.bfloat16, 7, 32, 5),
    ("fp8", torch.float32, 5, 64, 7),
    ("fp8", torch.bfloat16, 17, 160, 18),  # head_dim > 128: blocks of 16 heads, so two of them
]


@pytest.mark.parametrize(("kv_cache_dtype", "dtype", "heads", "d", "width"), CASES)
def test_matches_reference(kv_cache_dtype, dtype, heads, d, width):
    ring, comp = caches(d, dtype, kv_cache_dtype)
    n = 4
    q = torch.randn(n, heads, d, generator=gen(20)).to(dtype)  # [N, H, D]
    sinks = torch.randn(heads, generator=gen(21))  # [H]
    win, extra = window_index(n), compressed_index(n, width)
    assert (win < 0).any() and (extra < 0).any() and (win >= 0).any()
    scale = d**-0.5
    out = tri.decode_mla_mqa_sparse(q, ring, win, scale, sinks, comp, extra)  # [N, H, D]
    expected = ref.decode_mla_mqa_sparse(q, ring, win, scale, sinks, comp, extra)  # [N, H, D]
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    assert out.dtype == dtype and out.shape == (n, heads, d)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    alone = tri.decode_mla_mqa_sparse(q, ring, win, scale, sinks)  # the window only
    torch.testing.assert_close(alone.float(), ref.decode_mla_mqa_sparse(q, ring, win, scale, sinks).float(),
                               rtol=tol, atol=tol)


def test_only_indexed_rows_are_read():
    """Garbage in slots no index names changes nothing; a query whose rows are all -1 gets zero
    (the sink takes mass but adds no value), with a finite or a -inf sink."""
    ring, comp = caches(32, torch.float32, "fp8")
    q, sinks = torch.randn(3, 4, 32, generator=gen(1)), torch.tensor([0.5, float("-inf"), -1.0, 2.0])
    win = torch.tensor([[0, 1, 2, -1], [14, 15, -1, -1], [-1, -1, -1, -1]])  # [N, W]
    extra = torch.tensor([[3, -1], [9, 10], [-1, -1]])  # [N, L]
    out = tri.decode_mla_mqa_sparse(q, ring, win, 0.2, sinks, comp, extra)  # [N, H, D]
    unread_ring, unread_comp = torch.tensor([3, 4, 13, 16, 30]), torch.tensor([0, 11, 23])
    ring.store(unread_ring, 1e3 * torch.randn(5, 1, 32, generator=gen(2)), None)
    comp.store(unread_comp, 1e3 * torch.randn(3, 1, 32, generator=gen(3)), None)
    again = tri.decode_mla_mqa_sparse(q, ring, win, 0.2, sinks, comp, extra)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert out[:2].abs().sum() > 0


def test_sink_takes_mass():
    """A huge sink drives the output to zero; a -inf sink leaves plain softmax attention."""
    ring, comp = caches(32, torch.float32, "auto")
    q = torch.randn(2, 3, 32, generator=gen(4))  # [N, H, D]
    win = window_index(2)
    huge = tri.decode_mla_mqa_sparse(q, ring, win, 0.1, torch.full((3,), 1e4))
    assert huge.abs().max() < 1e-6
    plain = tri.decode_mla_mqa_sparse(q, ring, win, 0.1, torch.full((3,), float("-inf")))
    rows = ring.load(win)[:, :, 0, 0]  # [N, W, D]
    logits = torch.einsum("nhd,nld->nhl", q, rows) * 0.1
    probs = torch.softmax(logits.masked_fill(~(win >= 0)[:, None, :], float("-inf")), dim=-1)  # [N, H, W]
    torch.testing.assert_close(plain, torch.einsum("nhl,nld->nhd", probs, rows), rtol=1e-5, atol=1e-5)


def test_bad_index_shape_is_refused():
    ring, _ = caches(32, torch.float32, "auto")
    q = torch.randn(2, 3, 32)
    with pytest.raises(ValueError, match="index rows"):
        tri.decode_mla_mqa_sparse(q, ring, torch.zeros(3, 4, dtype=torch.long), 0.1, torch.zeros(3))
    with pytest.raises(ValueError, match="head_dim=16"):
        tri.decode_mla_mqa_sparse(q[..., :16], ring, torch.zeros(2, 4, dtype=torch.long), 0.1, torch.zeros(3))


@pytest.mark.slow
def test_v4_engine_with_triton_kernels(tmp_path, monkeypatch):
    """A tiny V4 (window, CSA with the indexer, HCA) in the engine with attention_backend="triton":
    sparse MLA decode, indexer scores and routed experts run as Triton kernels, and the greedy
    tokens and logprobs are the torch backend's (MXFP8 rows)."""
    from models.deepseek_v4.v4_tiny import CSA, HCA, SLIDING, make_tiny_v4

    from deepinfer import LLM, SamplingParams
    from deepinfer.model_executor.layers.ops.triton import indexer as tri_indexer
    from deepinfer.model_executor.layers.ops.triton import moe as tri_moe

    make_tiny_v4(str(tmp_path), [SLIDING, CSA, HCA])
    prompts = [[5, 17, 99, 3, 250, 41, 8], [300, 12, 77, 9, 45, 101, 33, 6, 2, 480, 64]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    calls = []
    for module, name in ((tri, "decode_mla_mqa_sparse"), (tri_indexer, "indexer_scores"), (tri_moe, "fused_experts")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    outs = []
    for backend in ("torch", "triton"):
        llm = LLM(str(tmp_path), block_size=4, max_model_len=128, kv_cache_dtype="fp8", attention_backend=backend)
        outs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.engine.kv_manager.check_no_leaks()
        assert bool(calls) == (backend == "triton")
    assert {"decode_mla_mqa_sparse", "indexer_scores", "fused_experts"} <= set(calls)
    for ref_out, tri_out in zip(*outs, strict=True):
        assert tri_out.token_ids == ref_out.token_ids
        for a, b in zip(ref_out.logprobs, tri_out.logprobs, strict=True):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
