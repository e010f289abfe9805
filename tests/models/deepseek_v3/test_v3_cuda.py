"""DeepSeek-V3 on a CUDA device through the Triton kernel set: latent rows stored by the Triton store,
decode through the Triton sparse MLA kernel (the absorbed form: MQA over the 40-wide latent rows, no
sink), experts through the Triton grouped GEMM. Tokens and logprobs against transformers' fp32 forward
on the CPU. Marked `cuda`: scripts/gpu_check.sh runs it; without a device it is skipped, and
GPU_CHECK_CPU=1 rehearses it on the CPU (the Triton kernels interpreted)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from tiny_models import assert_teacher_forcing
from v3_tiny import VOCAB, make_tiny

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("GPU_CHECK_CPU") == "1":
        return "cpu"
    pytest.skip("needs a CUDA device (scripts/gpu_check.sh runs it; GPU_CHECK_CPU=1 rehearses it on the CPU)")


def test_v3_triton_decode_matches_transformers(device, tmp_path):
    hf = make_tiny(str(tmp_path))
    llm = LLM(str(tmp_path), device=device, dtype="float32", attention_backend="triton", max_model_len=128,
              num_blocks=48, block_size=8, max_num_batched_tokens=29, enable_prefix_caching=False)
    assert llm.engine.runner.attention_backend.kernels.name == "triton"
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 33, 50)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        c = out.outputs[0]
        sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert_teacher_forcing(hf, prompt, c.token_ids, sampled, atol=2e-3)
