"""Quantized matrices are held at their size in the GGUF file (at most 1.05x its tensor bytes, read
by the gguf package's own reader): per packed type on a synthetic file, a tiny model per type the
gguf package quantizes, and the two shipped models."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

from deepinfer import LLM
from deepinfer.model_executor.layers.ops.qmatmul import BLOCKS, QuantWeight
from deepinfer.model_executor.layers.quant_linear import QuantLinear, packed_weights
from deepinfer.model_executor.loader.gguf import packed_file_bytes, to_hf_tensor
from deepinfer.model_executor.loader.gguf_file import read_gguf_file

MAX_RATIO = 1.05
_NAMES = ("blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "blk.0.attn_v.weight")


def _files_quantized_bytes(path: str) -> int:
    """Bytes of the file's 2-D tensors in a packed type, as gguf's GGUFReader reports them."""
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors
               if t.tensor_type.name in BLOCKS and len(t.shape) == 2)


def _random_blocks(kind: str, n: int, k: int, rng) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    return rng.integers(0, 256, size=(n, k // block * size), dtype=np.uint8)


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_each_type_is_held_at_its_file_size(tmp_path, kind):
    rng = np.random.default_rng(0)
    path = str(tmp_path / f"{kind}.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    for name, (n, k) in zip(_NAMES, [(96, 512), (64, 1024), (16, 256)], strict=True):
        writer.add_tensor(name, _random_blocks(kind, n, k, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = read_gguf_file(path).tensors
    assert [t.shape for t in tensors] == [(96, 512), (64, 1024), (16, 256)]
    held = [to_hf_tensor(t, "qwen2", None, torch.float32, keep_quantized=True) for t in tensors]
    assert all(isinstance(w, QuantWeight) and w.kind == kind for w in held)
    in_file = _files_quantized_bytes(path)
    assert sum(w.nbytes for w in held) <= MAX_RATIO * in_file
    assert packed_file_bytes(path) == {kind: in_file}


def _tiny_model(tmp_path, kind: str) -> str:
    config = tiny_hf_config("llama", intermediate_size=128)
    state = random_hf_model(config).state_dict()
    return write_gguf(tmp_path / f"tiny-{kind}.gguf", "llama", config, state, qtype=gguf.GGMLQuantizationType[kind])


def _check_model(llm: LLM, path: str) -> float:
    """The model's packed bytes over the file's quantized tensor bytes; every such tensor stays packed."""
    held = sum(w.nbytes for w in packed_weights(llm.engine.runner.model))
    in_file = _files_quantized_bytes(path)
    assert held >= in_file, "a quantized matrix of the file was dequantized"
    assert held <= MAX_RATIO * in_file, (held, in_file)
    return held / in_file


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_a_tiny_model_holds_its_file_size(tmp_path, kind):
    path = _tiny_model(tmp_path, kind)
    with LLM(path, quantization="gguf", num_blocks=4, block_size=8, max_model_len=32, max_num_seqs=1) as llm:
        _check_model(llm, path)
        assert {w.kind for w in packed_weights(llm.engine.runner.model)} == {kind}


@pytest.mark.real_model
def test_smollm2_holds_its_file_size(default_gguf_path):
    with LLM(default_gguf_path, quantization="gguf", max_model_len=64, max_num_seqs=1) as llm:
        _check_model(llm, default_gguf_path)


@pytest.mark.real_model
def test_gemma3_holds_its_file_size(gemma3_gguf_path):
    """Q4_K, Q5_0, Q6_K and Q8_0 matrices; merged q|k|v of two types are held as parts, not widened."""
    with LLM(gemma3_gguf_path, quantization="gguf", max_model_len=64, max_num_seqs=1) as llm:
        _check_model(llm, gemma3_gguf_path)
        model = llm.engine.runner.model
        kinds = {w.kind for w in packed_weights(model)}
        mixed = [[w.kind for w in m.qweights] for m in model.modules() if isinstance(m, QuantLinear)
                 and len(m.qweights) > 1]
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= kinds
    assert mixed and all(len(set(parts)) == len(parts) for parts in mixed)  # e.g. q|k Q5_0, v Q8_0
