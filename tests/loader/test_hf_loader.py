"""HF checkpoint directories: single and sharded safetensors, tokenizer, identity."""

from __future__ import annotations

import json
import os

import pytest
import torch
from llamacpp_writer import random_hf_model, tiny_hf_config

from deepinfer.model_executor.loader import load_model_source


def _save(tmp_path, arch: str = "llama", **save_kwargs):
    config = tiny_hf_config(arch)
    model = random_hf_model(config)
    model.save_pretrained(tmp_path, **save_kwargs)
    return config, {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_sharded_checkpoint_streams_every_tensor(tmp_path):
    config, original = _save(tmp_path, max_shard_size="20KB")
    with open(tmp_path / "model.safetensors.index.json") as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 1

    source = load_model_source(str(tmp_path))
    assert source.format == "hf" and source.hf_config.model_type == "llama"
    assert source.hf_config.num_hidden_layers == config.num_hidden_layers
    weights = dict(source.iter_weights(torch.float32))
    assert set(weights) == set(original)
    for name, tensor in weights.items():
        assert torch.equal(tensor, original[name]), name


def test_single_file_checkpoint_in_bfloat16(tmp_path):
    _, original = _save(tmp_path, "qwen3")
    weights = dict(load_model_source(str(tmp_path)).iter_weights(torch.bfloat16))
    assert set(weights) == set(original)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, original[name].to(torch.bfloat16)), name


def test_directory_without_tokenizer_has_none(tmp_path):
    _save(tmp_path)
    assert load_model_source(str(tmp_path)).tokenizer is None


def test_tokenizer_files_are_loaded(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    _save(tmp_path)
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model_source(str(tmp_path)).tokenizer
    assert loaded.chat_template == "{{ messages[0]['content'] }}"
    assert loaded.convert_tokens_to_ids("hello") == 1


def test_identity_is_stable_and_tracks_content_changes(tmp_path):
    _save(tmp_path)
    first = load_model_source(str(tmp_path)).identity
    assert first == load_model_source(str(tmp_path) + os.sep).identity
    weights = tmp_path / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert load_model_source(str(tmp_path)).identity == first  # touched, same bytes: same content
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert load_model_source(str(tmp_path)).identity != first  # same path, changed weights


def test_index_naming_a_missing_shard_is_refused(tmp_path):
    _save(tmp_path, max_shard_size="20KB")
    shard = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))[0]
    os.remove(tmp_path / shard)
    with pytest.raises(ValueError, match=shard):
        load_model_source(str(tmp_path))
