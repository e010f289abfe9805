"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers' forward
on the same GGUF, dequantized by transformers' own loader.

Token-for-token parity within 2e-3 in logprob holds with two int8 activation levels everywhere
(`activation_levels=2`, ~15 bits of each value); the default's one level on o, gate/up and down
moves logprobs by a few hundredths, and its teacher-forced agreement (>= 97%) is
tests/models/test_quantized_parity.py's."""

from __future__ import annotations

import pytest
from tiny_models import assert_teacher_forcing

from deepinfer import LLM, SamplingParams

pytestmark = [pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


def test_default_model_matches_transformers(smollm2_hf_model):
    llm = LLM(max_model_len=512, kv_cache_memory="256MiB", activation_levels=2)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert len(c.token_ids) == 32
        sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert_teacher_forcing(smollm2_hf_model, out.prompt_token_ids, c.token_ids, sampled, atol=2e-3)


def test_default_model_chat_is_coherent():
    """The README's question on the default path. (Without "Answer in one sentence." the first token is
    a near tie: llama.cpp on the same file, and the default, open with "L'Étoile"; two activation
    levels everywhere answer "Paris".)"""
    default_llm = LLM(max_model_len=512, kv_cache_memory="256MiB")
    question = "What is the capital of France? Answer in one sentence."
    out = default_llm.chat([{"role": "user", "content": question}],
                           SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
    kv = default_llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks
