"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' GGUF path."""

from __future__ import annotations

import os
import time

import pytest
import torch

from deepinfer.model_executor.loader import default_model_path, load_model_source

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def source():
    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    start = time.perf_counter()
    loaded = load_model_source(None)
    loaded.load_seconds = time.perf_counter() - start
    assert loaded.path == path
    return loaded


@pytest.fixture(scope="module")
def reference(source):
    """transformers' dequantized tensors for the same file (its config, its tensor processor)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    start = time.perf_counter()
    config = AutoConfig.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(source.path, return_tensors=True, model_to_load=skeleton)["tensors"]
    return config, tensors, time.perf_counter() - start


def test_config_matches_the_file(source, reference):
    config = source.hf_config
    assert source.format == "gguf" and config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert config.vocab_size == 49152 and config.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5) and config.tie_word_embeddings
    theirs = reference[0].to_dict()
    for key, value in config.to_dict().items():
        # eog_from_token_texts is ours: the vocabulary's end-of-generation tokens count by their text
        if key not in ("architectures", "transformers_version", "_name_or_path", "eog_from_token_texts"):
            assert theirs.get(key) == value, key


def test_tokenizer_and_chat_template(source):
    from transformers import AutoTokenizer

    tokenizer = source.tokenizer
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    auto = AutoTokenizer.from_pretrained(
        os.path.dirname(source.path), gguf_file=os.path.basename(source.path)
    )
    assert type(tokenizer) is type(auto)
    text = "Hello, world! Über naïve café — 1234 tokens?"
    assert tokenizer.encode(text) == auto.encode(text)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_weights_equal_transformers(source, reference):
    tensors = reference[1]
    weights = dict(source.iter_weights(torch.float32))
    assert set(weights) == set(tensors)  # tied: no lm_head in either
    for layer in (0, 17, 29):
        for proj in ("q_proj", "k_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert torch.equal(weights[name], tensors[name]), name
    assert torch.equal(weights["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, tensors[name], rtol=0, atol=0, msg=name)


def test_load_time(source, reference):
    start = time.perf_counter()
    count = sum(tensor.numel() for _, tensor in source.iter_weights(torch.bfloat16))
    seconds = source.load_seconds + time.perf_counter() - start
    theirs = reference[2]
    print(f"SmolLM2 config+tokenizer {source.load_seconds:.2f} s, total with bf16 weights {seconds:.2f} s; "
          f"transformers' GGUF load of the same file {theirs:.2f} s")
    assert count == 134_515_008
    # against a baseline of the same run (a busy machine slows both), not a number of seconds:
    # typically several times faster than transformers' own GGUF loader
    assert seconds < theirs, (seconds, theirs)
