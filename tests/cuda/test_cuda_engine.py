"""The engine on a CUDA device against HF transformers (see conftest: skipped without CUDA).

Parity is against transformers' full causal forward run on the CPU in fp32 (teacher forcing): an
independent reference that shares neither our device code nor our cache.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from tiny_models import VOCAB, assert_teacher_forcing, hf_reference

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.cuda


def _prompts(n: int, seed: int, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _greedy(llm: LLM, prompts, max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks, "a KV block leaked"
    return [o.outputs[0] for o in outs]


def test_runs_on_the_device(device, tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device=device, dtype="float32", max_model_len=128, num_blocks=32, block_size=8)
    assert llm.engine.runner.device.type == device
    assert next(llm.engine.runner.model.parameters()).device.type == device


def test_fp32_greedy_parity_with_transformers(device, tiny_llama_dir):
    """Chunked prefill (budget 29) and a pool small enough to preempt, on the device; every token
    is transformers' argmax and its logprob matches."""
    llm = LLM(tiny_llama_dir, device=device, dtype="float32", max_model_len=128, num_blocks=20, block_size=8,
              max_num_batched_tokens=29, max_num_seqs=6)
    prompts = _prompts(6, seed=1)
    completions = _greedy(llm, prompts, max_tokens=32)
    hf = hf_reference(tiny_llama_dir)
    for prompt, c in zip(prompts, completions, strict=True):
        assert len(c.token_ids) == 32
        sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert_teacher_forcing(hf, prompt, c.token_ids, sampled, atol=2e-3)


def test_bf16_tracks_the_fp32_reference(device, tiny_llama_dir):
    """bf16 on the device: the first greedy token of each prompt is within bf16 noise of transformers'
    fp32 best (its logprob at most 0.05 below the max)."""
    llm = LLM(tiny_llama_dir, device=device, dtype="bfloat16", max_model_len=128, num_blocks=32, block_size=8)
    prompts = _prompts(8, seed=2)
    completions = _greedy(llm, prompts, max_tokens=4)
    hf = hf_reference(tiny_llama_dir)
    for prompt, c in zip(prompts, completions, strict=True):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt])).logits[0, -1].float()  # [V]
        ref = torch.log_softmax(logits, dim=-1)  # [V]
        assert float(ref.max() - ref[c.token_ids[0]]) < 0.05, (prompt, c.token_ids[0], int(ref.argmax()))


def test_v4_greedy_parity_with_transformers(device, tmp_path):
    """A tiny DeepSeek-V4 (sliding, CSA, HCA) on the device, fp32: tokens and logprobs against
    transformers' full forward on the CPU, prompts past the window and several compress blocks."""
    from v4_tiny import CSA, HCA, SLIDING, make_tiny_v4
    from v4_tiny import VOCAB as V4_VOCAB

    hf = make_tiny_v4(str(tmp_path), [SLIDING, CSA, HCA], index_n_heads=8)
    llm = LLM(str(tmp_path), device=device, dtype="float32", max_model_len=256, num_blocks=48, block_size=8,
              max_num_batched_tokens=37)
    prompts = _prompts(4, seed=3, vocab=V4_VOCAB)
    for prompt, c in zip(prompts, _greedy(llm, prompts, max_tokens=24), strict=True):
        sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert_teacher_forcing(hf, prompt, c.token_ids, sampled, atol=2e-3)


def _has_attention_backend_option() -> bool:
    return "attention_backend" in inspect.signature(LLM.__init__).parameters


@pytest.mark.skipif(not _has_attention_backend_option(), reason="LLM has no attention_backend option yet")
def test_triton_backend_matches_torch_backend(device, tiny_llama_dir):
    """The same requests through the torch reference backend and the Triton backend: same greedy
    tokens, logprobs within fp32 noise."""
    prompts = _prompts(5, seed=4)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_llama_dir, device=device, dtype="float32", max_model_len=128, num_blocks=32, block_size=8,
                  max_num_batched_tokens=23, attention_backend=backend)
        runs[backend] = _greedy(llm, prompts, max_tokens=16)
        llm.close()
    for ref, got in zip(runs["torch"], runs["triton"], strict=True):
        assert got.token_ids == ref.token_ids
        for lp_ref, lp_got, t in zip(ref.logprobs, got.logprobs, ref.token_ids, strict=True):
            assert abs(lp_ref[t].logprob - lp_got[t].logprob) < 1e-3
