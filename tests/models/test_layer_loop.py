"""The layer loop (models/layer_loop.py) runs a stack's steps as its modules would, bit for bit.

Each case runs the same batch twice in one engine, with DEEPINFER_LAYER_LOOP=0 (every step
through the modules) and on, and compares every returned logprob with ==; a counter on the loop's
layer function says which steps it ran. Served: dense fp32 Llama, Qwen2 (q|k|v bias), Qwen3 (q/k
norms), sliding windows (rings), Gemma 2 and 3 (sandwich norms, GeGLU, soft-caps), Phi-3
(sliding windows), an int8 KV cache, the real
SmolLM2 GGUF (packed weights, tile layout); prefill, decode-only steps, steps mixing a prompt's chunk
with decodes, and n-gram verification steps. Not served, and so untouched: MXFP8 cache rows, partial
RoPE (a LongRoPE Phi-3 here) and any step with a forward hook on one of the modules the loop calls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gemma2_phi3_models import ARCHS, gemma2_phi3_checkpoint  # noqa: F401

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.models import layer_loop

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, ignore_eos=True)
PROMPTS = [[1, 17, 300, 4000, 42], [1, 9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(autouse=True)
def _read_the_switch_again():
    yield
    layer_loop.loop_enabled.cache_clear()  # after monkeypatch restored the environment


@pytest.fixture
def layer_runs(monkeypatch) -> list[tuple[bool, int]]:
    """A list that grows by one per layer the loop runs: (decode tokens only, rows)."""
    runs: list[tuple[bool, int]] = []
    run_layer = layer_loop._run_layer

    def counted(plan, layer, md, decodes, positions, h):
        runs.append((decodes, h.shape[0]))
        return run_layer(plan, layer, md, decodes, positions, h)

    monkeypatch.setattr(layer_loop, "_run_layer", counted)
    return runs


def _answers(llm: LLM, monkeypatch, loop: bool, prompts=PROMPTS, params=PARAMS) -> list:
    """(token ids, every logprob returned) per prompt, with the loop on or off."""
    monkeypatch.setenv("DEEPINFER_LAYER_LOOP", "1" if loop else "0")
    layer_loop.loop_enabled.cache_clear()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def _layers(llm: LLM) -> int:
    return len(llm.engine.runner.model.model.layers)


def _check_same(llm: LLM, monkeypatch, layer_runs: list, served: bool = True, prompts=PROMPTS,
                params=PARAMS) -> None:
    off = _answers(llm, monkeypatch, False, prompts, params)
    assert not layer_runs
    on = _answers(llm, monkeypatch, True, prompts, params)
    assert on == off  # token ids and logprobs: every float equal
    if served:  # every step of the batch ran through the loop, all layers: at least one step per 4 tokens
        assert len(layer_runs) >= _layers(llm) * params.max_tokens // 4, len(layer_runs)
        assert len(layer_runs) % _layers(llm) == 0
    else:
        assert not layer_runs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral_swa", "qwen2_swa"])
def test_the_loop_gives_the_modules_bits(arch, tiny_checkpoint, monkeypatch, layer_runs):
    llm = LLM(tiny_checkpoint(arch), max_model_len=256)
    try:
        _check_same(llm, monkeypatch, layer_runs)
    finally:
        llm.close()


@pytest.mark.real_model
def test_an_int8_cache_and_packed_weights(default_gguf_path, monkeypatch, layer_runs):
    llm = LLM(default_gguf_path, max_model_len=256, kv_cache_dtype="int8")
    try:
        _check_same(llm, monkeypatch, layer_runs)
    finally:
        llm.close()


def test_sandwich_layers(tiny_checkpoint, monkeypatch, layer_runs):
    """Gemma 3: sandwich norms (offset 1), q/k norms, GeGLU, local and global RoPE, sliding windows."""
    llm = LLM(tiny_checkpoint("gemma3"), max_model_len=256)
    try:
        _check_same(llm, monkeypatch, layer_runs)
    finally:
        llm.close()


@pytest.mark.parametrize("name", ARCHS)
def test_gemma2_and_phi3(name, gemma2_phi3_checkpoint, monkeypatch, layer_runs):  # noqa: F811
    """Gemma 2 (attention and final soft-caps, sandwich norms, alternating windows) and Phi-3 (sliding
    windows; this LongRoPE checkpoint rotates part of each head, which the loop refuses)."""
    llm = LLM(gemma2_phi3_checkpoint(name), max_model_len=256)
    try:
        _check_same(llm, monkeypatch, layer_runs, served=name != "phi3_longrope")
    finally:
        llm.close()


def test_a_refused_stack_keeps_its_refusal(tiny_checkpoint, monkeypatch, layer_runs):
    """MXFP8 cache rows, which the CPU kernels do not serve: the stack runs its modules, refused once
    (not worked out again every step)."""
    builds: list[int] = []
    build = layer_loop.build_plan
    monkeypatch.setattr(layer_loop, "build_plan", lambda *args: builds.append(1) or build(*args))
    llm = LLM(tiny_checkpoint("llama"), max_model_len=256, kv_cache_dtype="fp8")
    try:
        _check_same(llm, monkeypatch, layer_runs, served=False)
        assert len(builds) == 1 and not llm.engine.runner.model.model._layer_plan.served
    finally:
        llm.close()


def test_a_hook_or_a_new_module_is_honoured(tiny_checkpoint, monkeypatch, layer_runs):
    """A forward hook on any module the loop calls sends the step through the modules (the hook runs);
    a module replaced after the plan was made is the one that runs."""
    llm = LLM(tiny_checkpoint("qwen2"), max_model_len=256)
    try:
        model = llm.engine.runner.model.model
        off = _answers(llm, monkeypatch, loop=False)
        calls: list[int] = []
        handle = model.layers[1].mlp.down_proj.register_forward_hook(lambda m, args, out: calls.append(1))
        assert _answers(llm, monkeypatch, loop=True) == off
        assert calls and not layer_runs  # the hook ran at every step; the loop ran none
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: calls.append(2))
        assert _answers(llm, monkeypatch, loop=True) == off
        assert 2 in calls and not layer_runs  # a global hook: the same
        handle.remove()
        assert _answers(llm, monkeypatch, loop=True) == off and layer_runs
        plan = model._layer_plan
        scaled = copy.deepcopy(model.layers[0].post_attention_layernorm)  # the plan holds the old one's weight
        with torch.no_grad():
            scaled.weight.mul_(2.0)
        model.layers[0].post_attention_layernorm = scaled
        changed = _answers(llm, monkeypatch, loop=False)
        assert changed != off
        assert _answers(llm, monkeypatch, loop=True) == changed
        assert model._layer_plan is not plan  # made again for the new module
    finally:
        llm.close()


def test_mixed_steps_and_verification_steps(tiny_checkpoint, monkeypatch, layer_runs):
    """Prompts admitted while others decode (a small token budget splits them over steps that also
    decode), and n-gram drafts verified several rows a request at a time."""
    llm = LLM(tiny_checkpoint("qwen2"), max_model_len=256, max_num_batched_tokens=8)
    try:
        _check_same(llm, monkeypatch, layer_runs)
        assert any(not decodes and rows < sum(map(len, PROMPTS)) for decodes, rows in layer_runs)  # mixed
    finally:
        llm.close()
    layer_runs.clear()
    llm = LLM(tiny_checkpoint("qwen2"), max_model_len=256, speculative_method="ngram", num_speculative_tokens=3)
    try:  # prompts that repeat themselves, and outputs that do: drafts to verify
        repeats = [p * 4 for p in PROMPTS]
        _check_same(llm, monkeypatch, layer_runs, prompts=repeats,
                    params=SamplingParams(max_tokens=12, temperature=0.0, logprobs=4, ignore_eos=True))
        assert any(decodes and rows > len(repeats) for decodes, rows in layer_runs)  # several rows a request
    finally:
        llm.close()
