"""DEEPINFER_BATCH_INVARIANT: a request's token ids and logprobs are bit-identical (==) whatever
shares its batch and however its prompt is chunked.

The op-level tests check, on this machine, the properties `layers/batch_invariant.py` relies on
(a machine whose BLAS breaks them fails here first); the engine tests run the real default model
and tiny checkpoints with the knob on, and show that without it the same comparisons differ.
"""

from __future__ import annotations

import contextlib
import os
import random
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from tiny_models import run_steps

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.layers import batch_invariant as bi
from deepinfer.model_executor.layers.attention.invariant import (
    decode_layout,
    invariant_decode,
    invariant_prefill,
    prefill_layout,
)
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.worker.sampling_inputs import build_sampling_metadata

pytestmark = [pytest.mark.parity]

# ---- ops -------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_features,out_features", [(576, 960), (576, 3072), (1536, 576), (64, 192)])
def test_linear_row_does_not_depend_on_its_call(in_features, out_features):
    """SmolLM2's and a tiny model's projections: a row alone, and at several positions of calls of
    1 .. 40, 64, 129, 300 and 2048 rows (plain F.linear differs for 1-3 rows and 129 on this CPU)."""
    gen = torch.Generator().manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(2048, in_features, generator=gen)
    alone = torch.cat([bi.linear(x[i:i + 1], weight) for i in range(0, 2048, 7)])  # [293, N]
    for m in [*range(1, 41), 64, 129, 300, 2048]:
        out = bi.linear(x[:m], weight)  # [m, N]
        rows = list(range(0, m, 7))
        assert torch.equal(out[rows], alone[:len(rows)]), f"M={m}"
        assert torch.equal(bi.linear(x[:m].flip(0), weight).flip(0)[rows], alone[:len(rows)]), f"M={m} reversed"


def test_elementwise_ops_keep_their_bits_at_any_position():
    """F.silu / sigmoid / gelu round the array tail differently; the invariant forms do not."""
    x = torch.randn(5003, generator=torch.Generator().manual_seed(0)) * 4
    for name, op, ref in [("silu", bi.silu, F.silu), ("sigmoid", bi.sigmoid, torch.sigmoid),
                          ("gelu_tanh", partial(bi.gelu, approximate="tanh"), partial(F.gelu, approximate="tanh")),
                          ("gelu", bi.gelu, F.gelu)]:
        full = op(x)
        singles = torch.cat([op(x[i:i + 1]) for i in range(0, 5003, 13)])
        assert torch.equal(singles, full[::13]), name
        torch.testing.assert_close(full, ref(x), rtol=1e-5, atol=2e-6)


def test_row_sum_and_pairwise_sum():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(17, 49152, generator=gen)
    alone = torch.stack([bi.row_sum(x[i:i + 1])[0] for i in range(17)])
    assert torch.equal(bi.row_sum(x), alone)
    torch.testing.assert_close(bi.row_sum(x), x.double().sum(-1).float(), rtol=1e-5, atol=1e-3)
    parts = torch.randn(4, 5, 3, generator=gen)
    padded = torch.cat([parts, torch.zeros(4, 11, 3)], dim=1)
    assert torch.equal(bi.pairwise_sum(parts, 1), bi.pairwise_sum(padded, 1))


class _Codec:
    """Plain fp32 rows: a cache read returns what was stored."""

    @staticmethod
    def encode(k, v):
        return torch.stack((k, v), dim=1)  # [n, 2, H_kv, D]

    @staticmethod
    def decode(rows):
        return rows


class _Cache:
    """One sequence's K|V rows at slots = positions."""

    codec = _Codec()

    def __init__(self, kv: torch.Tensor):
        self.kv = kv  # [P, 2, H_kv, D]

    def load(self, slots: torch.Tensor) -> torch.Tensor:
        return self.kv[slots.clamp(min=0)]  # [..., 2, H_kv, D]


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 32)])
def test_attention_prefill_chunks_and_decode_agree(window, num_heads, num_kv_heads, head_dim):
    """One 150-token sequence: every query's output is the same bits as a decode read alone, a
    decode read in a batch padded to wider rows, or a query of prefill chunks of 150, 37 or 8
    (over [loaded | chunk]); and close to SDPA."""
    gen = torch.Generator().manual_seed(num_heads + (window or 0))
    length, scale = 150, head_dim ** -0.5
    q = torch.randn(length, num_heads, head_dim, generator=gen)
    kv = torch.randn(length, 2, num_kv_heads, head_dim, generator=gen)
    cache, pos = _Cache(kv), torch.arange(length)
    first = (pos - window + 1).clamp(min=0) if window else torch.zeros_like(pos)

    def decode_rows(queries: list[int], width: int) -> torch.Tensor:
        cols = torch.arange(width)
        index = torch.stack([torch.where(cols <= p - first[p], first[p] + cols, -1) for p in queries])  # [N, width]
        return invariant_decode(cache, q[queries], decode_layout(index, pos[queries], window), scale)

    alone = torch.cat([decode_rows([p], length) for p in range(length)])  # [150, H, D]
    assert torch.equal(decode_rows(list(range(length)), length + 70), alone)
    for chunk in (length, 37, 8):
        out = []
        for s in range(0, length, chunk):
            e = min(s + chunk, length)
            loaded_pos = torch.arange(int(first[s]), s)
            layout = prefill_layout(pos[s:e], loaded_pos, window)
            out.append(invariant_prefill(cache, q[s:e], kv[s:e, 0], kv[s:e, 1], kv[loaded_pos], layout, scale))
        assert torch.equal(torch.cat(out), alone), f"chunk {chunk}"
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= first[:, None])  # [150, 150]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams]) -> list:
    rows = [ScheduledRequest(request_id=f"r{i}", token_ids=[0], start_pos=0, block_ids=([],), sampling_params=p,
                             prompt_token_ids=[1, 2, 3], output_token_ids=[]) for i, p in enumerate(params)]
    return Sampler(seed=0, batch_invariant=True)(logits, build_sampling_metadata(rows, torch.device("cpu")))


def test_sampler_rows_do_not_depend_on_the_batch():
    """Logprobs (logsumexp) and seeded top-p draws of a row alone and among 16 others."""
    logits = torch.randn(17, 49152, generator=torch.Generator().manual_seed(2)) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, logprobs=2) if i % 2 else
              SamplingParams(temperature=0.0, logprobs=2) for i in range(17)]
    batch = _sample_rows(logits, params)
    for i in range(17):
        alone = _sample_rows(logits[i:i + 1], [params[i]])[0]
        assert (alone.token_id, alone.logprob, alone.top_logprobs) == \
            (batch[i].token_id, batch[i].logprob, batch[i].top_logprobs), f"row {i}"


def test_mode_refuses_sdpa():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="DEEPINFER_BATCH_INVARIANT"), bi.BatchInvariantMode():
        F.scaled_dot_product_attention(q, q, q)


# ---- the engine ------------------------------------------------------------------------------


@contextlib.contextmanager
def _knob(on: bool):
    """The process environment with DEEPINFER_BATCH_INVARIANT set, read afresh (engines built inside
    keep it: EngineConfig reads the knobs once)."""
    from deepinfer.environ import get_environ

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_BATCH_INVARIANT", "1" if on else "0")
        get_environ.cache_clear()
        try:
            assert get_environ().batch_invariant is on
            yield
        finally:
            get_environ.cache_clear()


V4_MINI = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "deepseek_v4_flash_mini")
TARGET = ("In a quiet village at the edge of a great forest, there lived an old clockmaker who repaired "
          "every clock in the valley. One winter morning")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1234, logprobs=2, ignore_eos=True)


def _others(n: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """n random prompts of 3 .. 80 tokens, greedy and seeded outputs of 2 .. 14 tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randrange(3, 80))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 15), temperature=0.7 * (i % 2), seed=i, ignore_eos=True)
              for i in range(n)]
    return prompts, params


def _run(llm: LLM, budget: int, num_others: int, targets=(GREEDY, SEEDED), first: bool = True):
    """The targets' (token ids, logprobs) in a batch with `num_others` other requests, under a
    prefill chunk budget of `budget` tokens (targets first or last in the batch)."""
    llm.engine.scheduler.config.max_num_batched_tokens = budget  # the scheduler reads it every step
    prompts, params = _others(num_others)
    ours = [TARGET] * len(targets)
    batch = (ours + prompts, list(targets) + params) if first else (prompts + ours, params + list(targets))
    outs = llm.generate(*batch, use_tqdm=False)
    mine = outs[:len(targets)] if first else outs[len(outs) - len(targets):]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in mine]


@pytest.fixture(scope="module")
def invariant_llm():
    with _knob(True):  # the dense weights: the control below compares them with the plain path's
        return LLM(max_model_len=256, kv_cache_memory="64MiB", quantization="none")


@pytest.mark.slow
def test_default_model_is_batch_invariant(invariant_llm):
    """Greedy and seeded (T 0.8, top-p 0.9) targets alone, among 2 and 16 others, first or last,
    prefilled in chunks of 8, 64 or 512 tokens: ids and logprobs are ==."""
    llm = invariant_llm
    greedy_alone = _run(llm, 512, 0, targets=(GREEDY,))[0]
    seeded_alone = _run(llm, 512, 0, targets=(SEEDED,))[0]
    assert len(greedy_alone[0]) == len(seeded_alone[0]) == 12
    assert greedy_alone[0] != seeded_alone[0]  # the seeded target really samples
    for budget, num_others, first in [(512, 1, True), (512, 15, False), (8, 1, True), (64, 15, True)]:
        greedy, seeded = _run(llm, budget, num_others, first=first)
        assert greedy == greedy_alone, f"greedy, budget {budget}, {num_others + 2} requests"
        assert seeded == seeded_alone, f"seeded, budget {budget}, {num_others + 2} requests"


@pytest.mark.slow
def test_without_the_knob_logprobs_move_with_the_batch(invariant_llm):
    """The control: with the knob off the same target's logprobs differ alone vs in a batch of 17
    (an M = 1 matmul, a split [1, V] sum, SDPA's padded reads); ids still agree here, and the
    invariant logprobs stay close to the default ones."""
    with _knob(False):  # the reference path: the quantized kernels are batch-invariant for decode rows
        llm = LLM(max_model_len=256, kv_cache_memory="64MiB", quantization="none", dtype="float32")
    alone = _run(llm, 512, 0, targets=(GREEDY,))[0]
    batched = _run(llm, 512, 15, targets=(GREEDY,))[0]
    assert batched[0] == alone[0]
    assert batched[1] != alone[1]
    invariant = _run(invariant_llm, 512, 0, targets=(GREEDY,))[0]
    assert invariant[0] == alone[0]
    for ours, theirs in zip(invariant[1], alone[1], strict=True):
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-3 for t in ours)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_tiny_models_are_batch_invariant_under_preemption(arch, tiny_checkpoint):
    """Tiny Gemma 3 (GeGLU, windows of 16, G = 2, soft-capping) and Qwen3 (q/k norm): a pool small
    enough to preempt and recompute, chunks of 37 tokens, vs a roomy engine: the same bits."""
    path = tiny_checkpoint(arch)
    prompts, params = _others(6, seed=5)
    params = [SamplingParams(max_tokens=40, temperature=0.9 * (i % 2), seed=i, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    with _knob(True):
        roomy = LLM(path, max_model_len=256, kv_cache_memory="16MiB")
        tight = LLM(path, num_blocks=24, block_size=8, max_num_batched_tokens=37, max_num_seqs=8,
                    max_model_len=192)  # 24 blocks of 8 hold one request at max_model_len
    expected = [roomy.generate([p], [sp], use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params, strict=True)]
    got = [o.outputs[0] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    for ours, theirs in zip(got, expected, strict=True):
        assert (ours.token_ids, ours.logprobs) == (theirs.token_ids, theirs.logprobs)


def test_verification_step_has_the_bits_of_a_prefill(tiny_checkpoint):
    """k+1 = 6 decode queries of one request (a verification step, ring wrapped three times) give
    the same logits, bit for bit, as a plain prefill of those positions (tests/worker's allclose)."""
    with _knob(True):
        llm = LLM(tiny_checkpoint("gemma3"), num_blocks=32, block_size=8, max_model_len=256, max_num_seqs=2)
    rng = random.Random(0)
    tokens = [rng.randrange(3, 49152) for _ in range(70)]
    table, p, k = list(range(9)), 61, 5
    _, got = run_steps(llm, [ScheduledRequest("r", tokens[:p], 0, (table,), (0,)),
                                ScheduledRequest("r", tokens[p:p + k + 1], p, (table,), (0,), verify=True)])
    ref = run_steps(llm, [ScheduledRequest("q", tokens[:p + k + 1], 0, (list(range(9, 18)),), (1,))])[0]
    assert torch.equal(got, ref[p:])
