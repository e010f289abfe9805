"""CUDA tests: each module is marked `cuda`; `scripts/gpu_check.sh` runs exactly them (`pytest -m cuda tests/cuda`).

Without a CUDA device they are skipped, saying why, so a CPU run never passes them by accident.
`GPU_CHECK_CPU=1` runs them on the CPU instead: the toy rehearsal of the GPU check (same code,
another device), so the tests themselves cannot fail for a trivial reason on the GPU.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "deepseek_v4"))


@pytest.fixture(scope="session")
def device() -> str:
    """cuda when torch sees one; cpu under GPU_CHECK_CPU=1; else the test is skipped."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("GPU_CHECK_CPU") == "1":
        return "cpu"
    pytest.skip("needs a CUDA device (scripts/gpu_check.sh runs it; GPU_CHECK_CPU=1 rehearses it on the CPU)")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint (weights and config only: no tokenizer, prompts are token ids)."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    with torch.no_grad():  # larger than the default init, so greedy tokens are far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    path = str(tmp_path_factory.mktemp("cuda-tiny-llama"))
    model.save_pretrained(path)
    return path
