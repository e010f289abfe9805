"""Parity with HF transformers' full causal forward (teacher forcing) on tiny random checkpoints.

Each run mixes chunked prefill, a block pool small enough to force preemption, and an abort.
"""

from __future__ import annotations

import random

import pytest
from tiny_models import assert_teacher_forcing, hf_reference

from deepinfer import LLM, SamplingParams

pytestmark = [pytest.mark.parity]

ARCHS = ["llama", "llama3", "qwen2", "qwen3", "mistral"]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 60))] for _ in range(n)]


def run_engine_with_abort(llm: LLM, prompts, max_tokens: int, abort_index: int, abort_after_steps: int):
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    ids = [engine.add_request(p, params) for p in prompts]
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == abort_after_steps:
            assert engine.abort_request(ids[abort_index])
    return [finished[i] for i in ids], engine.scheduler.num_preemptions_total


@pytest.mark.parametrize("arch", ARCHS)
def test_teacher_forcing_parity(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    llm = LLM(path, num_blocks=24, block_size=8, max_num_batched_tokens=37, max_num_seqs=8,
              max_model_len=192)  # 24 blocks of 8 hold one request at max_model_len
    prompts = _prompts(9, seed=len(arch))
    outs, preemptions = run_engine_with_abort(llm, prompts, max_tokens=64, abort_index=3, abort_after_steps=12)
    assert preemptions > 0, "the pool was meant to force preemption"
    assert outs[3].outputs[0].finish_reason == "abort"
    hf = hf_reference(path)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        if i == 3:
            continue
        c = out.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 64
        sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert_teacher_forcing(hf, prompt, c.token_ids, sampled, atol=2e-3)
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks
