"""GGUF name mapping, q/k un-permutation, Gemma norm offsets and config, on tiny random models.

Each tiny HF model is written the way llama.cpp's converter writes it (see conftest), then loaded
by our loader and by transformers' own GGUF tensor path (`load_gguf_checkpoint`, the code behind
`from_pretrained(gguf_file=...)`, which needs accelerate only for module placement). Both must
agree tensor for tensor, and with the original HF weights.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from llamacpp_writer import CHAT_TEMPLATE, random_hf_model, tiny_hf_config, write_gguf

from deepinfer.model_executor.loader import load_model_source
from deepinfer.model_executor.loader.gguf import gguf_to_hf_name, unpermute_qk

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
Q = gguf.GGMLQuantizationType


def transformers_tensors(path: str, config) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only its parameter names are used, for the name mapping
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]


@pytest.mark.parametrize("qtype", [None, Q.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_weights_match_transformers_and_original(tiny_gguf, arch, qtype):
    path, config, original = tiny_gguf(arch, qtype=qtype)
    source = load_model_source(path)
    ours = dict(source.iter_weights(torch.float32))
    reference = transformers_tensors(path, config)

    assert set(ours) == set(original) == set(reference)
    for name, tensor in ours.items():
        assert tensor.shape == original[name].shape, name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
        tolerance = 1e-6 if qtype is None else 0.02  # Q8_0: absmax/127 per block of 32
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=tolerance * 4, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_config_matches_original(tiny_gguf, arch):
    path, config, _ = tiny_gguf(arch)
    ours = load_model_source(path).hf_config
    for field in [
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_parameters",
        "bos_token_id",
        "eos_token_id",
    ]:
        assert getattr(ours, field) == getattr(config, field), field
    assert ours.rms_norm_eps == pytest.approx(config.rms_norm_eps, rel=1e-6)
    assert ours.head_dim == getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    if arch == "gemma3":
        for field in ["layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_activation"]:
            assert getattr(ours, field) == getattr(config, field), field


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_config_agrees_with_transformers_gguf_config(tiny_gguf, arch):
    """Where transformers' GGUF config path is complete (llama, qwen2), ours must agree with it."""
    import os

    from transformers import AutoConfig

    path, _, _ = tiny_gguf(arch)
    ours = load_model_source(path).hf_config.to_dict()
    theirs = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).to_dict()
    ignored = {"architectures", "head_dim", "_name_or_path", "unk_token_id", "transformers_version",
               "eog_from_token_texts"}  # ours: the vocabulary's end-of-generation tokens count by their text
    differing = {key for key in set(ours) | set(theirs) if ours.get(key) != theirs.get(key)} - ignored
    assert not differing, {key: (ours.get(key), theirs.get(key)) for key in differing}


def test_tied_embeddings_have_no_lm_head(tiny_gguf):
    path, config, _ = tiny_gguf("qwen2", tie_word_embeddings=True)
    source = load_model_source(path)
    assert config.tie_word_embeddings and source.hf_config.tie_word_embeddings
    assert "lm_head.weight" not in dict(source.iter_weights(torch.float32))


def test_untied_lm_head_is_loaded(tiny_gguf):
    path, config, original = tiny_gguf("llama")
    weights = dict(load_model_source(path).iter_weights(torch.float32))
    assert not load_model_source(path).hf_config.tie_word_embeddings
    torch.testing.assert_close(weights["lm_head.weight"], original["lm_head.weight"])


def test_tokenizer_and_chat_template_come_from_metadata(tiny_gguf):
    path, _, _ = tiny_gguf("llama")
    tokenizer = load_model_source(path).tokenizer
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.encode("ab", add_special_tokens=False) == [5]  # the merge "a b" -> "ab"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False)
    assert text == "<s>user: ab</s>"


LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
UNUSUAL_ROPE = {
    "factor": 16.0,
    "low_freq_factor": 2.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 4096,
}


@pytest.mark.parametrize("rope, with_original", [(LLAMA31_ROPE, False), (UNUSUAL_ROPE, True)])
def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path, rope, with_original):
    """llama.cpp stores Llama 3 scaling as per-frequency divisors; the config must get it back."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, **rope}
    config = tiny_hf_config(
        "llama", rope_parameters=rope, hidden_size=128, num_attention_heads=2, max_position_embeddings=131072
    )
    config.num_key_value_heads, config.head_dim = 1, 64
    extra = {}
    if with_original:
        original = rope["original_max_position_embeddings"]
        extra["llama.rope.scaling.original_context_length"] = (original, gguf.GGUFValueType.UINT32)
    path = write_gguf(
        tmp_path / "l3.gguf", "llama", config, random_hf_model(config).state_dict(), extra=extra
    )
    source = load_model_source(path)
    ours = source.hf_config.rope_parameters
    assert ours["rope_type"] == "llama3" and set(ours) == set(rope)
    for key in (
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        assert ours[key] == pytest.approx(rope[key], rel=1e-4), key
    assert "rope_freqs.weight" not in dict(source.iter_weights(torch.float32))


def test_linear_rope_scaling_from_metadata(tmp_path):
    config = tiny_hf_config("qwen2")
    extra = {
        "qwen2.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
        "qwen2.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32),
    }
    path = write_gguf(
        tmp_path / "lin.gguf", "qwen2", config, random_hf_model(config).state_dict(), extra=extra
    )
    rope = load_model_source(path).hf_config.rope_parameters
    assert rope == {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}


def test_unpermute_inverts_llama_cpp_permutation():
    from llamacpp_writer import llama_cpp_permute

    weight = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3)  # 4 heads of 8 rows
    permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), 4))
    assert permuted[:4, 0].tolist() == [0, 12, 3, 15]  # rows 0, 4, 1, 5 of head 0
    assert torch.equal(unpermute_qk(permuted, 4), weight)
    bias = torch.arange(32, dtype=torch.float32)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias.numpy(), 4)), 4), bias)


@pytest.mark.parametrize(
    "arch, gguf_name, hf_name",
    [
        ("llama", "token_embd.weight", "model.embed_tokens.weight"),
        ("llama", "output.weight", "lm_head.weight"),
        ("llama", "output_norm.weight", "model.norm.weight"),
        ("llama", "blk.11.ffn_norm.weight", "model.layers.11.post_attention_layernorm.weight"),
        ("qwen2", "blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
        ("qwen3", "blk.2.attn_q_norm.weight", "model.layers.2.self_attn.q_norm.weight"),
        ("gemma3", "blk.1.ffn_norm.weight", "model.layers.1.pre_feedforward_layernorm.weight"),
        ("gemma3", "blk.1.post_ffw_norm.weight", "model.layers.1.post_feedforward_layernorm.weight"),
    ],
)
def test_name_table(arch, gguf_name, hf_name):
    assert gguf_to_hf_name(arch, gguf_name) == hf_name


def test_unknown_tensor_name_is_refused():
    with pytest.raises(ValueError, match="blk.0.attn_q_norm.weight"):
        gguf_to_hf_name("llama", "blk.0.attn_q_norm.weight")
