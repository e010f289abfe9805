"""The CPU default path is batch-invariant: on the real SmolLM2 and Gemma 3 270M GGUFs with default
settings (quantization auto, DEEPINFER_BATCH_INVARIANT unset), a greedy and a seeded (T 0.8)
request get the same token ids and logprobs (==) with prefix caching on or off (a later run
hitting the cached prefix), alone or among 16 other requests, under chunk budgets of 8, 64 and 512
tokens, and (greedy) with n-gram speculative decoding on or off.

One engine per configuration and model (default, no prefix cache, n-gram drafts), short outputs.
tests/models/test_batch_invariant.py shows the control (the knob off: logprobs move with the batch).
Last, where the knob resolves to on (and to off), and a float checkpoint's native path.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.layers.batch_invariant import resolve_batch_invariant
from deepinfer.model_executor.models.registry import get_model_class

TARGET = ("In a quiet village at the edge of a great forest, there lived an old clockmaker who repaired every "
          "clock in the valley. His workshop smelled of oil and cedar, and its walls were covered with clocks of "
          "every size: tall clocks with painted faces, small brass clocks from the city, and a cuckoo clock that "
          "had not sung in years. Every morning he wound each of them, listened to their ticking, and wrote in a "
          "worn notebook which ones ran fast and which ran slow. One winter morning, when the snow lay deep on "
          "the road, a girl knocked on his door holding a broken pocket watch")
ECHO = TARGET + ". She asked him: can you fix it? He said: I can fix it. She asked again: can you fix it? He said:"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, seed=1234, logprobs=2, ignore_eos=True)
ENGINE = {"max_model_len": 512, "kv_cache_memory": "128MiB"}


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request) -> str:
    return request.getfixturevalue("default_gguf_path" if request.param == "smollm2" else "gemma3_gguf_path")


@pytest.fixture(scope="module")
def engines(model) -> Iterator[dict[str, LLM]]:
    """Built on first use, one per configuration, default settings otherwise."""
    options = {"default": {}, "no_prefix_cache": {"enable_prefix_caching": False},
               "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3}}
    built: dict[str, LLM] = {}

    class Engines(dict):
        def __missing__(self, name: str) -> LLM:
            built[name] = LLM(model, **ENGINE, **options[name])
            return built[name]

    yield Engines()
    for llm in built.values():
        llm.close()


def _others(n: int, vocab_size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n random prompts of 3 .. 40 tokens, greedy and seeded outputs of 2 .. 8 tokens."""
    rng = random.Random(n)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randrange(3, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 9), temperature=0.7 * (i % 2), seed=i, ignore_eos=True)
              for i in range(n)]
    return prompts, params


def _run(llm: LLM, targets=(GREEDY, SEEDED), budget: int = 512, num_others: int = 0, first: bool = True,
         prompt: str = TARGET):
    """The targets' [(token ids, logprobs)] and their cached prompt tokens, among `num_others` other
    requests (targets first or last), under a prefill chunk budget of `budget` tokens."""
    llm.engine.scheduler.config.max_num_batched_tokens = budget  # the scheduler reads it every step
    prompts, params = _others(num_others, min(20000, llm.engine.runner.model.config.vocab_size))
    ours = [prompt] * len(targets)
    batch = (ours + prompts, list(targets) + params) if first else (prompts + ours, params + list(targets))
    outs = llm.generate(*batch, use_tqdm=False)
    mine = outs[:len(targets)] if first else outs[len(outs) - len(targets):]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in mine], [o.num_cached_tokens for o in mine]


@pytest.fixture(scope="module")
def expected(engines):
    """The targets alone on an engine without prefix caching, budget 512: the reference."""
    expected, cached = _run(engines["no_prefix_cache"])
    assert cached == [0, 0]
    assert len(expected[0][0]) == len(expected[1][0]) == GREEDY.max_tokens and expected[0][0] != expected[1][0]
    return expected


@pytest.mark.real_model
def test_the_default_cpu_path_runs_the_mode_natively(engines):
    """Defaults: quantized GGUF weights, the mode on (recorded in the row identity), the C++ invariant
    attention, the sampler's fixed-block sums, and no TorchFunctionMode around the forward."""
    runner = engines["default"].engine.runner
    assert runner.quantization.value == "gguf"
    assert runner.batch_invariant and runner.numerics.batch_invariant and runner.steps.sampler.batch_invariant
    assert runner.attention_backend.batch_invariant and runner.attention_backend.cpu_invariant
    assert not hasattr(runner.model.forward, "__wrapped__")  # the model's own forward, not _under_mode's


@pytest.mark.real_model
def test_prefix_cache_batch_and_chunking_change_no_bit(engines, expected):
    """The default engine: alone with a budget of 512 (a cold cache), alone with a budget of 8 (on
    the cached prefix), and last among 16 others with a budget of 64: ids and logprobs == the
    reference's (no prefix caching)."""
    hits = []
    for budget, num_others, first in [(512, 0, True), (8, 0, True), (64, 16, False)]:
        got, cached = _run(engines["default"], budget=budget, num_others=num_others, first=first)
        what = f"budget {budget}, {num_others} others, cached {cached}"
        assert got[0] == expected[0], f"greedy, {what}"
        assert got[1] == expected[1], f"seeded, {what}"
        hits.append(max(cached))
    assert hits[0] == 0 and hits[1] > 0, f"a cold run, then one on the cached prefix: cached tokens {hits}"


@pytest.mark.real_model
def test_ngram_speculative_decoding_changes_no_bit(engines):
    """Greedy on a prompt that repeats itself, with n-gram drafts (k = 3) and without: the same ids and
    logprobs, and drafts were accepted (tokens taken from verification rows past the first)."""
    expected = _run(engines["no_prefix_cache"], targets=(GREEDY,), prompt=ECHO)[0]
    llm = engines["ngram"]
    assert _run(llm, targets=(GREEDY,), prompt=ECHO)[0] == expected
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def caps(model_type: str):
    return get_model_class(model_type).capabilities


def test_the_knob_resolves_to_on_for_the_cpu_path_only(monkeypatch):
    """Unset: on for fp32 on the CPU with the C++ kernels, the torch backend and a native model
    type; off for the Triton backend, bf16, DeepSeek-V4, a GPU, or no kernels. Set: as set."""
    from deepinfer.model_executor.layers.ops import cpu_kernels

    cpu, cuda, fp32 = torch.device("cpu"), torch.device("cuda"), torch.float32
    assert resolve_batch_invariant(None, cpu, "auto", caps("llama"), fp32)
    assert resolve_batch_invariant(None, cpu, "torch", caps("gemma3_text"), fp32)
    assert not resolve_batch_invariant(None, cpu, "triton", caps("llama"), fp32)
    assert not resolve_batch_invariant(None, cpu, "auto", caps("llama"), torch.bfloat16)
    assert not resolve_batch_invariant(None, cpu, "auto", caps("deepseek_v4"), fp32)
    assert not resolve_batch_invariant(None, cuda, "auto", caps("llama"), fp32)
    assert not resolve_batch_invariant(False, cpu, "auto", caps("llama"), fp32)
    assert resolve_batch_invariant(True, cuda, "auto", caps("deepseek_v4"), torch.bfloat16)
    monkeypatch.setenv("DEEPINFER_CPU_ISA", "none")
    cpu_kernels.kernel_isa.cache_clear()
    try:
        assert not resolve_batch_invariant(None, cpu, "auto", caps("llama"), fp32)
    finally:
        monkeypatch.undo()
        cpu_kernels.kernel_isa.cache_clear()


@pytest.mark.slow
def test_a_float_checkpoint_runs_natively_and_zero_turns_it_off(tiny_checkpoint, monkeypatch):
    """A tiny HF checkpoint (float linear layers): on by default, its linear layers on the invariant
    `linear`, no TorchFunctionMode; DEEPINFER_BATCH_INVARIANT=0: off, the plain kernels."""
    from deepinfer.environ import get_environ

    path = tiny_checkpoint("llama")
    runner = LLM(path, num_blocks=16, block_size=8, max_model_len=64).engine.runner
    assert runner.batch_invariant and runner.attention_backend.batch_invariant and runner.steps.sampler.batch_invariant
    assert not hasattr(runner.model.forward, "__wrapped__")
    linears = [m for m in runner.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all("forward" in vars(m) for m in linears)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    get_environ.cache_clear()
    try:
        off = LLM(path, num_blocks=16, block_size=8, max_model_len=64).engine.runner
    finally:
        monkeypatch.undo()
        get_environ.cache_clear()
    assert not (off.batch_invariant or off.attention_backend.batch_invariant or off.steps.sampler.batch_invariant)
    assert not off.numerics.batch_invariant and runner.numerics.batch_invariant
