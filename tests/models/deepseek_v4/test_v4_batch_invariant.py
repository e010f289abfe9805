"""DeepSeek-V4 under DEEPINFER_BATCH_INVARIANT: a request's token ids and logprobs are
bit-identical (==) whatever shares its batch, wherever its prompt is cut into chunks and whether
its prefix came from the cache.

The op tests check each V4 piece for a row alone vs in a batch (and decode vs prefill reads); the
engine tests run a tiny sliding + CSA + HCA checkpoint (2 index heads: tied index scores are
common) with MXFP8 rows, and show that without the knob the same comparisons differ.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from models.test_batch_invariant import _knob
from v4_tiny import CSA, HCA, SLIDING, VOCAB, make_tiny_v4

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.layers import batch_invariant as bi
from deepinfer.model_executor.layers.fused_moe import FusedExperts
from deepinfer.model_executor.layers.invariant_attention import index_scores
from deepinfer.model_executor.layers.moe import grouped_experts
from deepinfer.model_executor.layers.ops.torch_sparse_mla import attention_over_parts, indexer_scores
from deepinfer.model_executor.models.deepseek_v4 import invariant
from deepinfer.model_executor.models.deepseek_v4.hyper_connection import HyperConnection
from deepinfer.model_executor.models.deepseek_v4.indexer import ascending_rows

# ---- ops -------------------------------------------------------------------------------------


class _Rows:
    """A latent-row cache whose slot s holds rows[s] (load_latent reads [..., 0, 0, :])."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows  # [S, D]

    def load(self, slots: torch.Tensor) -> torch.Tensor:
        return self.rows[slots.clamp(min=0)][..., None, None, :]  # [..., 1, 1, D]


def _window_index(q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Slots = positions: each query's visible window slots in position order, then -1. [N, W]"""
    return invariant.window_local_index(q_pos, 0, window)


def _hca_index(q_pos: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """Slots = row ids: rows 0 .. (p+1)//m - 1 of each query, then -1. [N, width]"""
    cols = torch.arange(width)
    return torch.where(cols < ((q_pos + 1) // ratio)[:, None], cols, -1)


def test_sparse_attention_decode_and_prefill_reads_agree():
    """One 150-token sequence (window 40, 4 heads, sink): each query's output over its window and
    its compressed rows is the same bits read alone, in a decode batch with wider compressed index
    rows, or as a query of prefill chunks of 150, 37 or 8; and close to `attention_over_parts`."""
    gen = torch.Generator().manual_seed(0)
    length, window, ratio, heads, dim = 150, 40, 4, 4, 32
    q = torch.randn(length, heads, dim, generator=gen)
    rows = torch.randn(length, dim, generator=gen)
    compressed = _Rows(torch.randn(length // ratio, dim, generator=gen))
    sink, scale, pos = torch.randn(heads, generator=gen), dim ** -0.5, torch.arange(length)

    def decode(queries: list[int], extra: int) -> torch.Tensor:
        qp = pos[queries]
        return invariant.decode_attention(q[queries], _Rows(rows), _window_index(qp, window), qp, window, sink,
                                          scale, compressed, _hca_index(qp, ratio, length // ratio + extra))

    alone = torch.cat([decode([p], 0) for p in range(length)])  # [150, H, D]
    assert torch.equal(decode(list(range(length)), 70), alone)
    for chunk in (length, 37, 8):
        out = []
        for s in range(0, length, chunk):
            e, first = min(s + chunk, length), max(0, s - window + 1)
            out.append(invariant.prefill_attention(q[s:e], rows[first:e], pos[s:e], window, sink, scale,
                                                   compressed, _hca_index(pos[s:e], ratio, length // ratio)))
        assert torch.equal(torch.cat(out), alone), f"chunk {chunk}"
    win, hca = _window_index(pos, window), _hca_index(pos, ratio, length // ratio)
    ref = attention_over_parts(q, [(rows[win.clamp(min=0)], win >= 0), (compressed.rows[hca.clamp(min=0)], hca >= 0)],
                               sink, scale)
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)


def test_index_scores_do_not_depend_on_the_call():
    """Scores of 33 queries against 150 index keys: per query or shared keys, alone or together:
    the same bits, close to the reference score sum; picks in ascending row id, -1 last."""
    gen = torch.Generator().manual_seed(1)
    q, keys = torch.randn(33, 2, 32, generator=gen), torch.randn(150, 32, generator=gen)
    weights = torch.randn(33, 2, generator=gen)
    shared = index_scores(q, keys, weights, 0.2)  # [33, 150]
    own = index_scores(q, keys[None].expand(33, -1, -1), weights, 0.2)
    assert torch.equal(shared, own)
    for i in (0, 16, 32):  # alone, against only the first 100 + i keys
        alone = index_scores(q[i:i + 1], keys[:100 + i], weights[i:i + 1], 0.2)  # [1, 100 + i]
        assert torch.equal(alone, shared[i:i + 1, :100 + i]), i
    torch.testing.assert_close(shared, indexer_scores(q, keys, weights, 0.2), rtol=1e-5, atol=1e-5)
    assert ascending_rows(torch.tensor([[7, -1, 2], [-1, -1, 0]])).tolist() == [[2, 7, -1], [0, -1, -1]]


def test_compressor_pool_and_hyper_connection_rows_are_their_own():
    """slot_pool of a window alone vs among 37; an mHC (4 streams) token alone vs among 37 tokens."""
    gen = torch.Generator().manual_seed(2)
    kv, score = torch.randn(37, 8, 32, generator=gen), torch.randn(37, 8, 32, generator=gen)
    score[:, :4] = float("-inf")  # CSA's half A before the first window
    pooled = bi.slot_pool(kv, score)  # [37, 32]
    assert torch.equal(torch.cat([bi.slot_pool(kv[i:i + 1], score[i:i + 1]) for i in range(37)]), pooled)
    torch.testing.assert_close(pooled, (kv * score.softmax(dim=1)).sum(dim=1), rtol=1e-5, atol=1e-6)
    hc = HyperConnection(64, 4, 20, 1e-6, 1e-6)
    with torch.no_grad():
        for p in hc.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hc.batch_invariant = True
    streams, block_out = torch.randn(37, 4, 64, generator=gen), torch.randn(37, 64, generator=gen)

    def step(s, y):
        x, post, comb = hc(s)
        return x, hc.merge(y, s, post, comb, fixed_order=True)

    with bi.BatchInvariantMode():
        x, merged = step(streams, block_out)
        for i in (0, 17, 36):
            xi, mi = step(streams[i:i + 1], block_out[i:i + 1])
            assert torch.equal(xi, x[i:i + 1]) and torch.equal(mi, merged[i:i + 1]), i
    hc.batch_invariant = False
    x_ref, post, comb = hc(streams)
    torch.testing.assert_close(x, x_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, hc.merge(block_out, streams, post, comb), rtol=1e-5, atol=1e-5)


def test_experts_sum_each_token_in_expert_order():
    """8 experts, top-2 (a token may name one twice, as hash tables do): a token alone vs among 37
    gives the same bits, close to the grouped reference; sqrt(softplus) routing scores too."""
    gen = torch.Generator().manual_seed(3)
    experts = FusedExperts(8, 64, 32, swiglu_limit=7.0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    experts.batch_invariant = True
    x, ids = torch.randn(37, 64, generator=gen), torch.randint(0, 8, (37, 2), generator=gen)
    weights, logits = torch.rand(37, 2, generator=gen), torch.randn(37, 8, generator=gen) * 8
    with bi.BatchInvariantMode():
        out, scores = experts(x, ids, weights), F.softplus(logits)
        for i in (0, 5, 36):
            assert torch.equal(experts(x[i:i + 1], ids[i:i + 1], weights[i:i + 1]), out[i:i + 1]), i
            assert torch.equal(F.softplus(logits[i:i + 1]), scores[i:i + 1]), i
    ref = grouped_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj, 7.0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores, F.softplus(logits), rtol=1e-6, atol=1e-6)


# ---- the engine ------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=1234, logprobs=2, ignore_eos=True)
TARGET = [random.Random(7).randrange(3, VOCAB) for _ in range(41)]  # 10 CSA rows, 5 HCA rows, 5 windows


def _others(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n random prompts of 3 .. 40 tokens, greedy and seeded outputs of 2 .. 10 tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 41))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 11), temperature=0.7 * (i % 2), seed=i, ignore_eos=True)
              for i in range(n)]
    return prompts, params


def _run(llm: LLM, budget: int, num_others: int, first: bool = True):
    """(the greedy and seeded targets' (token ids, logprobs), their cached prompt tokens) in a batch
    with `num_others` other requests under a prefill chunk budget of `budget` tokens."""
    llm.engine.scheduler.config.max_num_batched_tokens = budget  # the scheduler reads it every step
    prompts, params = _others(num_others)
    batch = ([TARGET, TARGET] + prompts, [GREEDY, SEEDED] + params) if first else \
        (prompts + [TARGET, TARGET], params + [GREEDY, SEEDED])
    outs = llm.generate(*batch, use_tqdm=False)
    mine = outs[:2] if first else outs[-2:]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in mine], [o.num_cached_tokens for o in mine]


SWEEP = [(8, 16, True), (64, 16, False), (512, 16, True), (8, 0, True)]  # (budget, others, targets first)


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("v4-invariant"))
    make_tiny_v4(path, [SLIDING, CSA, HCA], index_n_heads=2)
    return path


def _engine(path: str, on: bool, prefix_caching: bool) -> LLM:
    with _knob(on):
        return LLM(path, block_size=4, max_model_len=256, kv_cache_dtype="fp8", enable_prefix_caching=prefix_caching)


@pytest.mark.slow
def test_v4_is_batch_invariant(v4_path):
    """Greedy and seeded targets alone, among 16 others (first or last), prefilled in chunks of
    8, 64 or 512 tokens; then with prefix caching, a cold run and a run whose prefix comes from
    the cache (among 16 others, chunks of 8): ids and logprobs are ==. The engine runs the fused
    kernel set (torch hooks for V4's own kernels) and every decoder layer's invariant forms."""
    llm = _engine(v4_path, True, prefix_caching=False)
    runner = llm.engine.runner
    assert runner.attention_backend.batch_invariant and runner.attention_backend.kernels.name == "cpu"
    layers = runner.model.model.layers
    assert all(la.self_attn.batch_invariant and la.mlp.experts.batch_invariant and la.ffn_hc.batch_invariant
               for la in layers)
    assert layers[1].self_attn.compressor.indexer.scorer.batch_invariant  # the CSA layer's indexer
    alone, _ = _run(llm, 512, 0)
    assert len(alone[0][0]) == len(alone[1][0]) == 10 and alone[0][0] != alone[1][0]  # the seeded target samples
    for budget, num_others, first in SWEEP:
        got, _ = _run(llm, budget, num_others, first)
        assert got[0] == alone[0], f"greedy, budget {budget}, {num_others} others"
        assert got[1] == alone[1], f"seeded, budget {budget}, {num_others} others"
    cached = _engine(v4_path, True, prefix_caching=True)
    cold, hits = _run(cached, 512, 0)
    assert cold == alone
    warm, hits = _run(cached, 8, 16)
    assert min(hits) > 0 and warm == alone


@pytest.mark.slow
def test_v4_without_the_knob_differs(v4_path):
    """The control: the same comparisons with the knob off; at least one target's logprobs differ."""
    llm = _engine(v4_path, False, prefix_caching=True)
    alone, _ = _run(llm, 512, 0)
    differs = [_run(llm, budget, n, first)[0] != alone for budget, n, first in SWEEP]
    assert any(differs), differs
