"""Gemma 2 and Phi-3 against HF transformers, from tiny random checkpoints (tests/gemma2_phi3_models.py).

- The engine (chunked prefill of 37 tokens, a block pool that forces preemption, an abort) gives
  HF's greedy tokens under teacher forcing, logprobs within 1e-4; the logits of every position of
  one request, prefilled in chunks and decoded through the engine's own cache, are within 1e-4 of
  HF's full forward. Configs: Gemma 2 (ring / paged layers, attention and final soft-caps), Phi-3
  with LongRoPE's long factors and partial rotary, Phi-3 with a window on every layer and
  LongRoPE's short factors. Under DEEPINFER_BATCH_INVARIANT=1 (the C++ invariant attention with
  the soft-cap) Gemma 2's tokens and logprobs are bit-identical in a preempting engine and a roomy one.
- GGUF files written the way llama.cpp's converter writes them (tests/llamacpp_writer.py): our
  loader's tensors equal transformers' GGUF loader's and the originals, the config is the
  original's, and with Q8_0 weights kept quantized (integer kernels) at least 97% of the greedy
  tokens are the argmax of HF's forward over the same Q8_0 weights (dequantized by gguf.quants).
"""

from __future__ import annotations

import contextlib
import random

import gguf
import pytest
import torch
from gemma2_phi3_models import ARCHS, gemma2_phi3_checkpoint, tiny_config, tiny_model  # noqa: F401
from llamacpp_writer import write_gguf
from test_parity import run_engine_with_abort
from tiny_models import assert_teacher_forcing, hf_reference, run_steps, teacher_forcing_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.loader import load_model_source
from deepinfer.model_executor.models.gemma2 import Gemma2ForCausalLM
from deepinfer.model_executor.models.llama import head_dim_of
from deepinfer.model_executor.models.phi3 import Phi3ForCausalLM

pytestmark = [pytest.mark.parity]

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {"gemma2": "gemma2", "phi3_longrope": "phi3", "phi3_swa": "phi3"}
GGUF_OVERRIDES = {"gemma2": {"query_pre_attn_scalar": 32}}  # llama.cpp's Gemma 2 scale: head_dim


def _prompts(n: int, seed: int, min_len: int = 3, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def test_layers_take_their_windows_and_caps():
    gemma = Gemma2ForCausalLM(tiny_config("gemma2", vocab_size=64), max_positions=32)
    assert [a.sliding_window for a in gemma.attention_layers()] == [16, None, 16, None]
    assert {a.softcap for a in gemma.attention_layers()} == {2.0} and gemma.spec.final_softcap == 10.0
    assert [g.name for g in gemma.cache_groups()] == ["full", "swa"]
    assert not hasattr(gemma.model.layers[0].self_attn, "q_norm")
    phi = Phi3ForCausalLM(tiny_config("phi3_swa", vocab_size=64), max_positions=32)
    assert [a.sliding_window for a in phi.attention_layers()] == [16, 16]
    partial = Phi3ForCausalLM(tiny_config("phi3_longrope", vocab_size=64), max_positions=32)
    assert partial.model.layers[0].self_attn.rotary.rotary_dim == 8  # of head_dim 16
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        Phi3ForCausalLM(tiny_config("phi3_swa", vocab_size=64, hidden_act="gelu"), max_positions=32)
    with pytest.raises(ValueError, match="attn_logit_softcapping=0.0 must be a positive number"):
        Gemma2ForCausalLM(tiny_config("gemma2", vocab_size=64, attn_logit_softcapping=0.0), max_positions=32)


def _full_logits_steps(llm: LLM, tokens: list[int]) -> list[ScheduledRequest]:
    """Prefill in chunks of 37, then one token per step, in blocks 0.. and ring slot 0."""
    groups = llm.engine.runner.groups
    tables = tuple(list(range(16)) for g in groups if not g.is_ring)
    states = tuple(0 for g in groups if g.is_ring)
    prefill = len(tokens) - 6
    cuts = sorted({*range(0, prefill, 37), prefill, *range(prefill + 1, len(tokens) + 1)})
    return [ScheduledRequest("r", tokens[a:b], a, tables, states) for a, b in zip(cuts, cuts[1:], strict=False)]


@pytest.mark.parametrize("name", ARCHS)
def test_engine_matches_transformers(name, gemma2_phi3_checkpoint):  # noqa: F811
    path = gemma2_phi3_checkpoint(name)
    llm = LLM(path, num_blocks=24, block_size=8, max_num_batched_tokens=37, max_num_seqs=8,
              max_model_len=192)  # 24 blocks of 8 hold one request at max_model_len
    prompts = _prompts(6, seed=len(name))
    outs, preemptions = run_engine_with_abort(llm, prompts, max_tokens=64, abort_index=3, abort_after_steps=12)
    if any(a.sliding_window is None for a in llm.engine.runner.model.attention_layers()):
        assert preemptions > 0, "the pool was meant to force preemption"  # all-ring models keep no blocks
    assert outs[3].outputs[0].finish_reason == "abort"
    hf = hf_reference(path)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        if i != 3:
            c = out.outputs[0]
            assert c.finish_reason == "length" and len(c.token_ids) == 64
            sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
            assert_teacher_forcing(hf, prompt, c.token_ids, sampled, atol=1e-4)
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    tokens = prompts[0] + outs[0].outputs[0].token_ids  # 67 .. 124 tokens: past every window
    logits = torch.cat(run_steps(llm, _full_logits_steps(llm, tokens)))  # [L, V]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()  # [L, V]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def _longrope_inv_freq(cfg, factors: list[float]) -> torch.Tensor:
    """inv_freq_i = 1 / (factor_i * theta^(2i / R)) over the R rotating dims (transformers' longrope)."""
    params = cfg.rope_parameters
    rotary_dim = int(cfg.hidden_size // cfg.num_attention_heads * params["partial_rotary_factor"])
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim  # [R/2]
    return 1.0 / (torch.tensor(factors) * params["rope_theta"] ** exponent)  # [R/2]


def test_longrope_takes_the_factor_set_of_the_fitted_max_model_len(gemma2_phi3_checkpoint):  # noqa: F811
    """phi3_longrope: context 256, original length 64. Seven blocks of 8 rows hold one request of
    56 tokens, so max_model_len (not given) is 56, resolved before the model is built: LongRoPE takes
    the short factors, as transformers does for a sequence within the original length. (Built at the
    context, 256 > 64, the model would take the long ones and drift from transformers.)"""
    path = gemma2_phi3_checkpoint("phi3_longrope")
    llm = LLM(path, num_blocks=7, block_size=8, max_num_seqs=1)
    assert llm.engine.max_model_len == 56 and llm.engine.config.max_model_len == 56
    cfg = load_model_source(path).hf_config
    params = cfg.rope_parameters
    rotary = llm.engine.runner.model.model.layers[0].self_attn.rotary
    angles = rotary.cos[1:2, :rotary.rotary_dim // 2] / rotary.cos[0, 0]  # cos(1 * inv_freq), scaling divided out
    torch.testing.assert_close(angles[0], _longrope_inv_freq(cfg, params["short_factor"]).cos())
    assert not torch.allclose(angles[0], _longrope_inv_freq(cfg, params["long_factor"]).cos())
    prompts = _prompts(2, seed=11, min_len=20, max_len=30)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, ignore_eos=True),
                        use_tqdm=False)
    hf = hf_reference(path)
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert_teacher_forcing(hf, prompt, c.token_ids, sampled, atol=1e-4)


@contextlib.contextmanager
def _batch_invariant():
    """DEEPINFER_BATCH_INVARIANT=1 for the engines built inside (EngineConfig reads it once)."""
    from deepinfer.environ import get_environ

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_BATCH_INVARIANT", "1")
        get_environ.cache_clear()
        try:
            yield
        finally:
            get_environ.cache_clear()


def test_gemma2_is_batch_invariant_and_matches_transformers(gemma2_phi3_checkpoint):  # noqa: F811
    path = gemma2_phi3_checkpoint("gemma2")
    with _batch_invariant():
        roomy = LLM(path, max_model_len=256, kv_cache_memory="16MiB")
        tight = LLM(path, num_blocks=24, block_size=8, max_num_batched_tokens=37, max_num_seqs=8, max_model_len=192)
    assert tight.engine.runner.attention_backend.cpu_invariant  # the C++ invariant attention, soft-capped
    prompts = _prompts(6, seed=9)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    got = [o.outputs[0] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    hf = hf_reference(path)
    for prompt, ours in zip(prompts, got, strict=True):
        alone = roomy.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (ours.token_ids, ours.logprobs) == (alone.token_ids, alone.logprobs)
        sampled = [lp[t].logprob for lp, t in zip(ours.logprobs, ours.token_ids, strict=True)]
        assert_teacher_forcing(hf, prompt, ours.token_ids, sampled, atol=1e-4)


def _tiny_gguf(tmp_path, name: str, qtype):
    """(gguf path, the HF model it was written from, the tensors written) for the tiny model `name`."""
    model = tiny_model(name, **GGUF_OVERRIDES.get(name, {}))
    state = {k: v.clone() for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    path = write_gguf(tmp_path / f"{name}.gguf", GGUF_ARCH[name], model.config, state, qtype=qtype, tokenizer=False)
    return path, model, state


def _transformers_tensors(path: str, config) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only its parameter names are used, for the name mapping
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]


@pytest.mark.parametrize("qtype", [None, Q.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("name", ["gemma2", "phi3_longrope"])
def test_gguf_weights_and_config(tmp_path, name, qtype):
    """Tensor for tensor: ours == transformers' GGUF loader's, ~ the original (Q8_0: a block's step);
    the config fields a model reads are the original's."""
    path, model, original = _tiny_gguf(tmp_path, name, qtype)
    source = load_model_source(path)
    ours = dict(source.iter_weights(torch.float32))
    reference = _transformers_tensors(path, model.config)
    assert set(ours) == set(original) == set(reference)
    for key, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(tensor, original[key], rtol=0, atol=1e-6 if qtype is None else 0.01, msg=key)
    fields = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings",
              "sliding_window"]
    fields += (["layer_types", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "hidden_activation", "rope_parameters"] if name == "gemma2" else
               ["original_max_position_embeddings", "hidden_act"])
    for field in fields:
        assert getattr(source.hf_config, field, None) == getattr(model.config, field, None), field
    assert head_dim_of(source.hf_config) == head_dim_of(model.config)
    if name.startswith("phi3"):  # factors and the attention factor stored as float32
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        ours_rope, theirs = source.hf_config.rope_parameters, model.config.rope_parameters
        for key in ("rope_type", "rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
            assert ours_rope[key] == theirs[key], key
        for key in ("short_factor", "long_factor"):
            torch.testing.assert_close(torch.tensor(ours_rope[key]), torch.tensor(theirs[key]), rtol=1e-6, atol=0)
        scaling = ROPE_INIT_FUNCTIONS["longrope"](model.config, None)[1]
        assert ours_rope["attention_factor"] == pytest.approx(scaling, rel=1e-6)


def _roundtrip(model, qtype):
    """The HF model with every matrix as the GGUF file holds it (gguf.quants: quantized, dequantized)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                blocks = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).view(p.shape))
    return model


@pytest.mark.parametrize("name", ARCHS)
def test_quantized_gguf_agrees_with_transformers(tmp_path, name):
    """Q8_0 weights kept quantized, batched decode; reference: HF on the same Q8_0 weights."""
    path, model, _ = _tiny_gguf(tmp_path, name, Q.Q8_0)
    llm = LLM(path, max_model_len=192, max_num_batched_tokens=37, max_num_seqs=8)
    runner = llm.engine.runner
    assert runner.quantization.value == "gguf" and any(type(m).__name__ == "QuantLinear"
                                                       for m in runner.model.modules())
    hf = _roundtrip(model, Q.Q8_0)
    prompts = _prompts(8, seed=7, min_len=30)  # 30 + 40 tokens: past phi3_longrope's original 64
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hits = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = out.outputs[0].token_ids
        ref = teacher_forcing_logprobs(hf, prompt, ids)  # [n, V]
        hits += int((ref.argmax(dim=-1) == torch.tensor(ids)).sum())
        total += len(ids)
    assert hits / total >= 0.97, hits / total
