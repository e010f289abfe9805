"""The default path on real GGUF models (quantized weights kept quantized, integer CPU kernels)
against HF transformers' forward on the same GGUF dequantized to fp32, under teacher forcing: at
least 97% of our greedy tokens must be the reference's argmax at their position. Also the resident
memory of the loaded embedded model.

With one level of int8 activations everywhere (llama.cpp's Q8 scheme) SmolLM2 agreed on 95.6% ..
96.9% of 8 x 40 tokens (97.5% of 8 x 120): the rounding flips near-tied argmaxes. Two levels (x,
then its residual: ~15 bits) everywhere agree on all of them; the default (two on q/k/v and 8-bit
weights, one on o, gate/up, down and a <= 6-bit LM head: quant_linear.activation_levels; both
models' heads are Q8_0) on 98.1% (SmolLM2) and 98.8% (Gemma 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import teacher_forcing_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa
from deepinfer.model_executor.layers.quant_linear import QuantLinear

pytestmark = [pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\nx = np.",
    # long prompts: prefill chunks of > 128 rows; decode steps of 8 rows (one kernel for both)
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used for wine. "
    "Within fifty years presses operated in more than two hundred cities across Europe, and the price "
    "of books fell sharply. Scholars could compare identical copies, errors were corrected in later "
    "editions, and vernacular languages gained standard spellings. Historians still debate",
    "Photosynthesis converts light energy into chemical energy. In the light-dependent reactions, "
    "water is split, oxygen is released, and ATP and NADPH are produced in the thylakoid membranes. "
    "In the Calvin cycle, which takes place in the stroma, carbon dioxide is fixed by the enzyme "
    "RuBisCO and reduced to sugars using the ATP and NADPH. The overall efficiency of the process",
]
MIN_AGREEMENT = 0.97


def agreement(llm: LLM, hf_model, max_tokens: int = 40, tolerance: float = 0.0) -> float:
    """Fraction of greedy output tokens that are the reference's argmax given the same history (with
    a tolerance: whose reference log-probability is within `tolerance` nats of the argmax's)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)  # batched: decode steps run 6 rows at once
    hits = total = 0
    for out in outs:
        ids = torch.tensor(out.outputs[0].token_ids)
        ref = teacher_forcing_logprobs(hf_model, out.prompt_token_ids, ids.tolist())  # [n, V]
        chosen = ref.gather(1, ids[:, None])[:, 0]  # [n]
        hits += int((chosen >= ref.max(dim=-1).values - tolerance).sum())
        total += len(ids)
    return hits / total


def assert_quantized(llm: LLM) -> None:
    runner = llm.engine.runner
    assert runner.quantization.value == "gguf", runner.quantization
    assert runner.dtype == torch.float32
    assert any(type(m).__name__ == "QuantLinear" for m in runner.model.modules())


def test_embedded_model_agrees_with_transformers(smollm2_hf_model):
    assert kernel_isa() > 0, "the CPU kernels did not build: the default path would not be quantized"
    llm = LLM(max_model_len=512, kv_cache_memory="128MiB")
    assert_quantized(llm)
    assert agreement(llm, smollm2_hf_model) >= MIN_AGREEMENT


@pytest.mark.real_model
def test_gemma3_270m_agrees_with_transformers(gemma3_gguf_path, gemma3_hf_model):
    llm = LLM(gemma3_gguf_path, max_model_len=512, kv_cache_memory="128MiB", max_num_seqs=8)
    assert_quantized(llm)
    assert agreement(llm, gemma3_hf_model) >= MIN_AGREEMENT


@pytest.fixture(scope="module")
def requantized_smollm2(default_gguf_path, tmp_path_factory):
    """The embedded SmolLM2 written again by scripts/requantize_gguf.py in its `rotate_all` mix:
    ffn_down (1536-value rows) of layer i < 13 in the i-th of the 13 types kept since the K-quants
    (Q2_K, Q3_K, IQ4_XS, IQ4_NL, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0),
    every other matrix as the file had it (Q4_1 and Q8_0)."""
    path = str(tmp_path_factory.mktemp("requantized") / "smollm2-rotate-all.gguf")
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "requantize_gguf.py")
    subprocess.run([sys.executable, script, default_gguf_path, path, "--mix", "rotate_all"], check=True, timeout=600,
                   capture_output=True)
    return path


@pytest.fixture(scope="module")
def requantized_hf(requantized_smollm2):
    """transformers' model of that file (its GGUF loader dequantizes through `gguf`)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(requantized_smollm2), dtype=torch.float32,
                                                gguf_file=os.path.basename(requantized_smollm2)).eval()


@pytest.mark.real_model
def test_a_model_in_every_kept_type_agrees_with_transformers(requantized_smollm2, requantized_hf):
    """Each of the 13 types in one ffn_down, kept in its blocks (no type dequantized at load), against
    transformers loading the same file. The 1- and 2-bit matrices flatten the model's distributions,
    so the MLPs' one-level (8-bit) activations, as llama.cpp's, flip near ties: measured 0.928 (llama.cpp
    0.859 on this file). With two levels (15 bits) on every layer the kernels give transformers'
    tokens: measured 1.000."""
    llm = LLM(requantized_smollm2, max_model_len=512, kv_cache_memory="128MiB")
    assert_quantized(llm)
    kinds = {w.kind for m in llm.engine.runner.model.modules() for w in getattr(m, "qweights", ())}
    assert {"Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
            "TQ1_0", "TQ2_0"} <= kinds, kinds
    assert agreement(llm, requantized_hf) >= 0.9
    for module in llm.engine.runner.model.modules():
        if isinstance(module, QuantLinear):
            module.act_levels = 2
    assert agreement(llm, requantized_hf) >= MIN_AGREEMENT


@pytest.mark.real_model
def test_greedy_answers_on_every_kept_type_read_as_llama_cpps(requantized_smollm2, requantized_hf):
    """The same file in llama.cpp (node-llama-cpp, where `make peers` installed it): its greedy tokens
    and ours, each teacher-forced through transformers, agree with it alike, and the two answers share
    their opening (ours reads as the model's in llama.cpp, not only against our own reference). Measured:
    ours 0.917, llama.cpp's 0.859 of 8 x 24 tokens; on this flat model the two answers part after 0-5
    tokens (printed; on the K/IQ4 mix alone, 11.5 and 15.1 of 24 in common)."""
    from deepinfer.entrypoints.bench.peers import node_llama_cpp as nlc

    if nlc.installed_version(nlc.install_dir()) is None:
        pytest.skip(f"node-llama-cpp is not installed in {nlc.install_dir()}: run `make peers`")
    llm = LLM(requantized_smollm2, max_model_len=512, kv_cache_memory="128MiB")
    n = 24
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    job = {"model_path": requantized_smollm2, "threads": 2, "prompts": [o.prompt_token_ids for o in outs],
           "output_lens": [n] * len(outs), "parallel": 1, "ctx_size": 512, "return_tokens": True}
    theirs = json.loads(nlc.run_job(job, nlc.ensure_installed()).strip().splitlines()[-1])["tokens"]
    hits = {"ours": 0, "llama.cpp": 0}
    shared = []
    for out, other in zip(outs, theirs, strict=True):
        ours = list(out.outputs[0].token_ids)
        for name, ids in (("ours", ours), ("llama.cpp", other)):
            ref = teacher_forcing_logprobs(requantized_hf, out.prompt_token_ids, ids)  # [n, V]
            hits[name] += int((ref.argmax(dim=-1) == torch.tensor(ids)).sum())
        shared.append(next((i for i, (a, b) in enumerate(zip(ours, other, strict=True)) if a != b), n))
    total = n * len(outs)
    print(f"teacher-forced agreement: ours {hits['ours'] / total:.3f}, llama.cpp {hits['llama.cpp'] / total:.3f}; "
          f"shared opening tokens per prompt {shared}")
    assert hits["ours"] / total >= hits["llama.cpp"] / total - 0.02, hits


_MEMORY_SCRIPT = """
import json, sys
from deepinfer import LLM
from deepinfer.model_executor.loader.source import load_model_source
from deepinfer.model_executor.model_loader import release_free_memory

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

source = load_model_source(None)  # config + tokenizer: no weights yet
release_free_memory()
before = rss_mib()
llm = LLM(source, max_model_len=1024, kv_cache_memory="64MiB")
after = rss_mib()
allocations = {id(a): a for a in llm.engine.runner.caches.cache.allocations if a is not None}
kv = sum(a.numel() * a.element_size() for a in allocations.values()) / 2**20
print(json.dumps({"before": before, "after": after, "kv": kv, "quantization": llm.engine.runner.quantization.value}))
"""


@pytest.mark.subprocess
def test_loaded_embedded_model_stays_near_its_file_size(default_gguf_path):
    """Loading the weights adds at most 1.5x the GGUF file's size to the resident set, beside the KV cache."""
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, check=True,
                         timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    file_mib = os.path.getsize(default_gguf_path) / 2**20
    assert got["quantization"] == "gguf"
    assert got["after"] - got["before"] - got["kv"] <= 1.5 * file_mib, (got, file_mib)
