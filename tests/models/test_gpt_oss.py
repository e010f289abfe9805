"""GPT-OSS against HF transformers' forward of the same checkpoint, on tiny random models.

Two checkpoints of one random model (4 layers alternating sliding W = 16 / full, 8 experts top-2,
YaRN, sinks): its experts quantized to MXFP4 blocks + scales with `quantization_config`
{"quant_method": "mxfp4"}, as the released checkpoints are (HF dequantizes them on the CPU), and
that checkpoint loaded by HF and saved again (`save_pretrained` writes dense bf16 experts and no
quantization_config). Engine runs use chunked prefill, a pool that forces preemption and prompts
longer than the window; greedy tokens must be HF's argmax and log-probabilities match.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from tiny_models import assert_teacher_forcing, hf_reference, teacher_forcing_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.layers.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4

pytestmark = [pytest.mark.parity]

VOCAB, WINDOW = 49152, 16
ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 150000.0}
EXPERT_MATRICES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def tiny_gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, num_local_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=1024, rope_parameters=ROPE, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return GptOssConfig(**{**fields, **overrides})


def write_mxfp4_checkpoint(path: str, tokenizer_dir: str, seed: int = 0) -> None:
    """A random GptOssForCausalLM (matrices and biases N(0, 0.08), sinks N(0, 1)), experts as MXFP4."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_gpt_oss_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith("bias"):
                p.normal_(0.0, 0.08)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(EXPERT_MATRICES):  # HF holds [E, in, out]; the checkpoint [E, out, in/32, 16]
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2))
        else:
            tensors[name] = tensor.contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model.config.to_json_file(os.path.join(path, "config.json"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _copy_tokenizer(tokenizer_dir, path)


def _copy_tokenizer(tokenizer_dir: str, path: str) -> None:
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    """{"mxfp4": packed experts, "bf16": the same model saved by HF after dequantizing it, in bf16}."""
    root = tmp_path_factory.mktemp("gpt-oss")
    paths = {"mxfp4": str(root / "mxfp4"), "bf16": str(root / "bf16")}
    write_mxfp4_checkpoint(paths["mxfp4"], tokenizer_dir)
    hf_reference(paths["mxfp4"], dtype=torch.bfloat16).save_pretrained(paths["bf16"])
    _copy_tokenizer(tokenizer_dir, paths["bf16"])
    return paths


def _tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_hf_dequantizes_the_mxfp4_checkpoint_and_saves_dense_bf16(checkpoints):
    packed = _tensors(checkpoints["mxfp4"])
    hf = hf_reference(checkpoints["mxfp4"])  # on the CPU transformers dequantizes MXFP4 experts
    experts = hf.model.layers[1].mlp.experts
    blocks, scales = (packed[f"model.layers.1.mlp.experts.gate_up_proj_{s}"] for s in ("blocks", "scales"))
    assert torch.equal(experts.gate_up_proj, dequantize_mxfp4(blocks, scales).transpose(1, 2))
    dense = _tensors(checkpoints["bf16"])
    assert dense["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert not [name for name in dense if name.endswith(("_blocks", "_scales"))]
    with open(os.path.join(checkpoints["bf16"], "config.json")) as f:
        assert "quantization_config" not in json.load(f)


def test_the_tiny_model_exercises_sinks_window_and_yarn(checkpoints):
    """HF's own logits move when the sinks, the window or YaRN's scaling are taken away: the parity
    tests below can only pass if each is implemented."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([_prompts(1, seed=0, min_len=60, max_len=60)[0]])  # [1, 60]: several windows
    hf = hf_reference(checkpoints["bf16"])
    with torch.no_grad():
        base = hf(input_ids=ids).logits
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert (hf(input_ids=ids).logits - base).abs().max() > 0.05
        for name, value in (("sliding_window", 4096), ("rope_parameters", {"rope_type": "default",
                                                                           "rope_theta": 150000.0})):
            other = AutoModelForCausalLM.from_pretrained(checkpoints["bf16"], dtype=torch.float32, **{name: value})
            assert (other(input_ids=ids).logits - base).abs().max() > 0.05, name


def test_experts_stay_packed(checkpoints):
    llm = LLM(checkpoints["mxfp4"], num_blocks=24, block_size=8, max_model_len=192, max_num_seqs=2)
    model = llm.engine.runner.model
    on_disk = sum(t.numel() * t.element_size() for name, t in _tensors(checkpoints["mxfp4"]).items()
                  if name.endswith(("_blocks", "_scales")))
    assert on_disk == 4 * 3 * 8 * 64 * 64 * 17 // 32  # layers x (2I + I) x E x H values, 17 bytes per 32
    assert model.expert_weight_bytes() <= 1.1 * on_disk
    experts = [name for name, p in model.named_parameters() if ".experts." in name and "bias" not in name]
    assert experts and all(dict(model.named_parameters())[name].dtype == torch.uint8 for name in experts)


def _prompts(n: int, seed: int, min_len: int = 20, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def _check_parity(path: str, atol: float, max_tokens: int = 64, prompts: list[list[int]] | None = None,
                  **engine) -> LLM:
    """Greedy engine tokens (chunked prefill, forced preemption) are HF's argmax; the sampled and the
    top-5 log-probabilities of every position match HF's within atol."""
    llm = LLM(path, num_blocks=24, block_size=8, max_num_batched_tokens=37, max_num_seqs=8, max_model_len=192,
              **engine)  # 24 blocks of 8 hold one request at max_model_len
    assert [a.sliding_window for a in llm.engine.runner.model.attention_layers()] == [WINDOW, None, WINDOW, None]
    prompts = prompts or _prompts(6, seed=1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    hf = hf_reference(path)
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == max_tokens
        sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert_teacher_forcing(hf, prompt, c.token_ids, sampled, atol=atol)
        ref = teacher_forcing_logprobs(hf, prompt, c.token_ids)  # [n, V]
        worst = max(abs(lp.logprob - float(ref[i, t])) for i, row in enumerate(c.logprobs) for t, lp in row.items())
        assert worst < atol, worst
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    return llm


def test_mxfp4_parity(checkpoints):
    """HF dequantizes the experts to fp32; the engine multiplies the packed bytes (C++ kernel): the same
    weights, other summation orders."""
    _check_parity(checkpoints["mxfp4"], atol=1e-3)


def test_dequantized_bf16_parity(checkpoints):
    """Dense bf16 experts (and every other weight bf16), both sides computing in fp32."""
    llm = _check_parity(checkpoints["bf16"], atol=1e-4)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert not experts.packed and experts.gate_up_proj.dtype == torch.float32


def test_triton_backend_parity(checkpoints):
    """The Triton kernel set (interpreted here): attention kernels with sinks and the MXFP4 grouped GEMM."""
    llm = _check_parity(checkpoints["mxfp4"], atol=1e-3, max_tokens=6, prompts=_prompts(3, seed=5, min_len=60),
                        attention_backend="triton")  # interpreted kernels: few, long prompts (still preempted)
    assert all(layer.mlp.experts.grouped_mxfp4 is not None for layer in llm.engine.runner.model.model.layers)


@pytest.mark.multirank
def test_two_ranks_give_one_rank_tokens(checkpoints):
    """Heads (and their sinks) split over 2 ranks, experts whole on each: HF's greedy tokens."""
    prompts = _prompts(2, seed=2)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(checkpoints["mxfp4"], tensor_parallel_size=2, num_blocks=64, block_size=8, max_model_len=192,
             max_num_seqs=4) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_reference(checkpoints["mxfp4"])
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert_teacher_forcing(hf, prompt, c.token_ids, sampled, atol=1e-3)


# llama.cpp's converter: HF name (in a layer) -> GGUF tensor name; experts handled in write_gguf
_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}


def write_gguf(path: str, hf_dir: str, expert_type) -> str:
    """The MXFP4 checkpoint as llama.cpp's converter writes it: its names, gate|up split into gate
    (rows 0::2) and up (rows 1::2) stacks, experts in `expert_type` by gguf-py's own quantizer (MXFP4
    of values already MXFP4 is lossless), everything else F32. No tokenizer: prompts are ids."""
    import gguf
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    writer = gguf.GGUFWriter(path, "gpt-oss")
    _write_gguf_metadata(writer, cfg)
    tensors = _tensors(hf_dir)
    for name, t in tensors.items():
        if not name.endswith(("_blocks", "_scales")):
            for gguf_name, value in _gguf_tensors(name, t):
                writer.add_tensor(gguf_name, value.float().contiguous().numpy())
    for layer in range(cfg.num_hidden_layers):
        for proj in ("gate_up_proj", "down_proj"):
            prefix = f"model.layers.{layer}.mlp.experts.{proj}"
            dense = dequantize_mxfp4(tensors[prefix + "_blocks"], tensors[prefix + "_scales"]).numpy()  # [E, out, in]
            stacks = {"gate": dense[:, 0::2], "up": dense[:, 1::2]} if proj == "gate_up_proj" else {"down": dense}
            for part, value in stacks.items():
                data = gguf.quants.quantize(np.ascontiguousarray(value), expert_type)
                writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", data, raw_dtype=expert_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_gguf_metadata(w, cfg) -> None:
    import gguf

    for add, value in ((w.add_context_length, cfg.max_position_embeddings), (w.add_embedding_length, cfg.hidden_size),
                       (w.add_block_count, cfg.num_hidden_layers), (w.add_feed_forward_length, cfg.intermediate_size),
                       (w.add_head_count, cfg.num_attention_heads), (w.add_head_count_kv, cfg.num_key_value_heads),
                       (w.add_layer_norm_rms_eps, cfg.rms_norm_eps), (w.add_key_length, cfg.head_dim),
                       (w.add_value_length, cfg.head_dim), (w.add_rope_freq_base, ROPE["rope_theta"]),
                       (w.add_rope_scaling_type, gguf.RopeScalingType.YARN),
                       (w.add_rope_scaling_factor, ROPE["factor"]),
                       (w.add_rope_scaling_orig_ctx_len, ROPE["original_max_position_embeddings"]),
                       (w.add_expert_count, cfg.num_local_experts), (w.add_expert_used_count, cfg.num_experts_per_tok),
                       (w.add_expert_feed_forward_length, cfg.intermediate_size), (w.add_sliding_window, WINDOW),
                       (w.add_vocab_size, cfg.vocab_size)):
        add(value)


def _gguf_tensors(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One HF tensor (not an expert matrix) as llama.cpp names it; expert biases split like their rows."""
    stem, suffix = name.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return [(f"{top[stem]}.{suffix}", t)]
    layer = name.split(".")[2]
    if suffix == "sinks":
        return [(f"blk.{layer}.attn_sinks.weight", t)]
    if name.endswith("experts.gate_up_proj_bias"):
        return [(f"blk.{layer}.ffn_gate_exps.bias", t[:, 0::2]), (f"blk.{layer}.ffn_up_exps.bias", t[:, 1::2])]
    if name.endswith("experts.down_proj_bias"):
        return [(f"blk.{layer}.ffn_down_exps.bias", t)]
    return [(f"blk.{layer}.{_GGUF_NAMES[stem.split('.', 3)[3]]}.{suffix}", t)]


@pytest.mark.parametrize("expert_type", ["MXFP4", "F32"])
def test_gguf_parity(checkpoints, tmp_path, expert_type):
    """A gpt-oss GGUF written from the MXFP4 checkpoint: MXFP4 stacks come back as the same packed
    experts (gate and up interleaved again, nibbles reordered), F32 stacks as dense ones; either way the
    greedy tokens and log-probabilities of HF's forward of the checkpoint."""
    import gguf

    path = write_gguf(str(tmp_path / "tiny.gguf"), checkpoints["mxfp4"], gguf.GGMLQuantizationType[expert_type])
    llm = LLM(path, num_blocks=24, block_size=8, max_num_batched_tokens=37, max_num_seqs=4, max_model_len=192)
    experts = llm.engine.runner.model.model.layers[2].mlp.experts
    assert experts.packed == (expert_type == "MXFP4")
    packed = _tensors(checkpoints["mxfp4"])
    expected = dequantize_mxfp4(packed["model.layers.2.mlp.experts.gate_up_proj_blocks"],
                                packed["model.layers.2.mlp.experts.gate_up_proj_scales"])  # [E, 2I, H]
    got = (dequantize_mxfp4(experts.gate_up_proj_blocks, experts.gate_up_proj_scales) if experts.packed
           else experts.gate_up_proj.detach().transpose(1, 2))
    assert torch.equal(got, expected)
    prompts = _prompts(2, seed=4)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    hf = hf_reference(checkpoints["mxfp4"])
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        c = out.outputs[0]
        sampled = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert_teacher_forcing(hf, prompt, c.token_ids, sampled, atol=1e-3)


def test_bad_configs_are_refused():
    from deepinfer.model_executor.models.gpt_oss import GptOssForCausalLM

    with pytest.raises(ValueError, match="quant_method='fp8' is not supported"):
        GptOssForCausalLM(tiny_gpt_oss_config(vocab_size=64, quantization_config={"quant_method": "fp8"}), 32)
    cfg = tiny_gpt_oss_config(vocab_size=64)
    cfg.layer_types = ["sliding_attention", "chunked_attention"] * 2
    with pytest.raises(ValueError, match="layer_types must name"):
        GptOssForCausalLM(cfg, 32)
    with pytest.raises(ValueError, match="hidden_size and intermediate_size divisible by 32"):
        GptOssForCausalLM(tiny_gpt_oss_config(vocab_size=64, intermediate_size=48,
                                              quantization_config={"quant_method": "mxfp4"}), 32)
