"""`--quantization` on HF checkpoints (int8 / int4 at load) and its refusals; `--dtype auto`'s rule."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import run_steps

from deepinfer import LLM
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.layers.quant_linear import QuantLinear


def prompt_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    table = list(range(8))
    return run_steps(llm, [ScheduledRequest("r", tokens, 0, (table,), (0,))])[0]  # [T, V]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("scheme,bound", [("int8", 0.05), ("int4", 0.6)])
def test_quantized_at_load_stays_close(tiny_checkpoint, arch, scheme, bound):
    """Every linear layer quantized (groups of 32); logits within the scheme's error of fp32's.

    Tiny random models amplify rounding (gemma3 int4: ~47% relative error over 5 layers); a wrong
    layout or scale gives uncorrelated logits, a relative error of 1 or more."""
    path = tiny_checkpoint(arch)
    kw = dict(num_blocks=16, block_size=8, max_model_len=64, max_num_seqs=2)
    ref, quant = LLM(path, quantization="none", **kw), LLM(path, quantization=scheme, **kw)
    runner = quant.engine.runner
    assert runner.quantization.value == scheme
    assert any(isinstance(m, QuantLinear) for m in runner.model.modules())
    plain = [m for m in runner.model.modules() if type(m) is torch.nn.Linear and m.in_features % 32 == 0]
    assert not plain
    tokens = [random.Random(1).randrange(3, 1000) for _ in range(20)]
    want, got = prompt_logits(ref, tokens), prompt_logits(quant, tokens)
    assert (got - want).norm() / want.norm() < bound


def test_quantized_generation_is_coherent_with_fp32(tiny_checkpoint):
    from deepinfer import SamplingParams

    path = tiny_checkpoint("llama")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(path, quantization="int8", num_blocks=32, block_size=8, max_model_len=256)
    outs = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("kwargs,match", [
    (dict(quantization="int3"), "quantization must be one of .*'int3'"),
    (dict(quantization="gguf"), "quantization='gguf' needs a .gguf model"),
    (dict(quantization="int8", load_format="dummy"), "needs real weights"),
])
def test_bad_quantization_requests_are_named(tiny_checkpoint, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_checkpoint("llama"), num_blocks=8, **kwargs)


def test_quantization_refused_for_a_model_type_without_support(monkeypatch, tiny_checkpoint):
    from dataclasses import replace

    from deepinfer.model_executor import model_loader
    from deepinfer.model_executor.loader.source import load_model_source
    from deepinfer.model_executor.models.llama import LlamaForCausalLM

    source = load_model_source(tiny_checkpoint("llama"))
    refused = replace(LlamaForCausalLM.capabilities, quantize_at_load=False)  # llama, mistral, qwen2, qwen3
    monkeypatch.setattr(LlamaForCausalLM, "capabilities", refused)
    with pytest.raises(ValueError, match="supports model types gemma2, gemma3_text, mixtral, phi3, qwen2_moe, "
                                         "qwen3_moe; got 'llama'"):
        model_loader.resolve_quantization("int4", source, torch.device("cpu"))


def test_auto_dtype_rules(tiny_checkpoint):
    from deepinfer.model_executor.loader.source import load_model_source
    from deepinfer.model_executor.model_loader import resolve_dtype

    source = load_model_source(tiny_checkpoint("llama"))
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, source, "gguf").value == "float32"
    small = resolve_dtype("auto", cpu, source, "none")
    assert small.value == "float32" and "small model" in small.reason
    assert resolve_dtype("auto", torch.device("cuda"), source, "none").value == "bfloat16"
    assert resolve_dtype("bf16", cpu, source, "none").value == "bf16"
    with pytest.raises(ValueError, match="dtype must be one of .*'fp64'"):
        resolve_dtype("fp64", cpu, source, "none")


def test_auto_dtype_measures_a_large_model(monkeypatch):
    """Above the small-model rule, the faster of the two probes wins and the reason carries the times."""
    from types import SimpleNamespace

    from deepinfer.model_executor import model_loader

    source = SimpleNamespace(hf_config=SimpleNamespace(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16))
    for times, want in (((1.0, 0.5), "bfloat16"), ((1.0, 0.95), "float32")):
        monkeypatch.setattr(model_loader, "_probe_matmul", lambda h, i, t=times: t)
        choice = model_loader.resolve_cpu_dtype(source, "none")
        assert choice.value == want and "measured" in choice.reason


def test_auto_quantization_follows_source_device_and_kernels(monkeypatch):
    from types import SimpleNamespace

    from deepinfer.model_executor.layers.ops import cpu_kernels
    from deepinfer.model_executor.model_loader import resolve_quantization

    gguf = SimpleNamespace(format="gguf", load_format="auto")
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", gguf, cpu).value == "gguf"
    assert resolve_quantization("auto", gguf, torch.device("cuda")).value == "none"
    assert resolve_quantization("auto", gguf, cpu, batch_invariant=True).value == "gguf"  # integer kernels: invariant
    assert resolve_quantization("auto", SimpleNamespace(format="gguf", load_format="dummy"), cpu).value == "none"
    assert resolve_quantization("auto", SimpleNamespace(format="hf", load_format="auto"), cpu).value == "none"
    monkeypatch.setenv("DEEPINFER_CPU_ISA", "none")
    cpu_kernels.kernel_isa.cache_clear()
    try:
        off = resolve_quantization("auto", gguf, cpu)
        assert off.value == "none" and "DEEPINFER_CPU_ISA=none" in off.reason
    finally:
        monkeypatch.undo()
        cpu_kernels.kernel_isa.cache_clear()


@pytest.mark.parametrize("scheme,one_level", [("int4", {"o_proj", "gate_up_proj", "down_proj", "lm_head"}),
                                              ("int8", set())])
def test_activation_levels_per_module(tiny_checkpoint, scheme, one_level):
    """Two int8 levels for q/k/v and 8-bit weights; one for the attention output, the MLP and the LM
    head with <= 6-bit weights (quant_linear.activation_levels). The output is the chosen level's
    product exactly, and the level is part of the cache identity."""
    from deepinfer.model_executor.layers.ops import qdot

    llm = LLM(tiny_checkpoint("llama"), quantization=scheme, num_blocks=16, block_size=8, max_model_len=64)
    model = llm.engine.runner.model
    levels = {name.rsplit(".", 1)[-1]: m.act_levels for name, m in model.named_modules()
              if hasattr(m, "act_levels")}
    assert levels == {role: 1 if role in one_level else 2 for role in levels}
    assert {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} <= set(levels)
    down = model.model.layers[0].mlp.down_proj
    x = torch.randn(5, down.in_features, generator=torch.Generator().manual_seed(0))
    want = qdot.qdot_ref(qdot.quantize_acts_ref(x, down.act_levels), down.qweights[0])
    assert torch.equal(down(x), want)
    if one_level:
        assert not torch.equal(want, qdot.qdot_ref(qdot.quantize_acts_ref(x, 2), down.qweights[0]))
        from deepinfer.model_executor.model_loader import _tensor_types

        before = _tensor_types(model)
        down.act_levels = 2
        assert _tensor_types(model) != before


@pytest.mark.parametrize("choice", [1, "2"])
def test_activation_levels_option_sets_every_module(tiny_checkpoint, choice):
    llm = LLM(tiny_checkpoint("llama"), quantization="int4", activation_levels=choice, num_blocks=16, block_size=8,
              max_model_len=64)
    levels = {m.act_levels for m in llm.engine.runner.model.modules() if hasattr(m, "act_levels")}
    assert levels == {int(choice)}


def test_activation_levels_option_refuses_other_values():
    with pytest.raises(ValueError, match="activation_levels must be one of 'auto', '1', '2', got '3'"):
        LLM("/no/such/model", activation_levels=3)
