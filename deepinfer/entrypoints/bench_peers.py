"""Peers for `deepinfer bench --peer`: HF transformers and llama.cpp on the same requests.

Both are optional: transformers is a test dependency; llama-cpp-python is the `peers` extra.
"""

from __future__ import annotations

import os
import time

import torch

from deepinfer.entrypoints.bench import BenchResult, Workload

HF_BATCH = 8


def run_peer(name: str, source, workload: Workload) -> BenchResult:
    if name == "hf":
        return run_hf(source, workload)
    if name == "llama.cpp":
        return run_llama_cpp(source, workload)
    raise ValueError(f"unknown peer {name!r}")


def _hf_model(source):
    from transformers import AutoModelForCausalLM

    if source.format == "gguf":
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(source.path), dtype=torch.float32,
                                                    gguf_file=os.path.basename(source.path)).eval()
    return AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()


@torch.inference_mode()
def run_hf(source, workload: Workload) -> BenchResult:
    """fp32, batched generate with left padding, HF_BATCH requests a batch, EOS ignored."""
    model = _hf_model(source)
    pad = source.tokenizer.pad_token_id if source.tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), HF_BATCH):
        prompts, lens = workload.prompts[i:i + HF_BATCH], workload.output_lens[i:i + HF_BATCH]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, width]
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                       min_new_tokens=max(lens), do_sample=False, pad_token_id=pad)
    seconds = time.perf_counter() - start
    return BenchResult("hf", workload.name, seconds, workload.num_output_tokens)


def run_llama_cpp(source, workload: Workload) -> BenchResult:
    """llama-cpp-python on the same GGUF, 2 threads, one request at a time, EOS ignored."""
    if source.format != "gguf":
        raise ValueError(f"the llama.cpp peer needs a .gguf model, got {source.path!r}")
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise ValueError("the llama.cpp peer needs llama-cpp-python: pip install 'deepinfer[peers]'") from exc
    llm = Llama(model_path=source.path, n_threads=2, n_ctx=1024, verbose=False)
    start = time.perf_counter()
    for prompt, n in zip(workload.prompts, workload.output_lens, strict=True):
        llm.reset()
        for count, _ in enumerate(llm.generate(prompt, temp=0.0), start=1):
            if count == n:
                break
    seconds = time.perf_counter() - start
    return BenchResult("llama.cpp", workload.name, seconds, workload.num_output_tokens)
