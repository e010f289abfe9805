"""Gemma 3 270M (Q4_K_M GGUF, shipped as PyPI chunk packages) against transformers' GGUF path.

The package (installed by `make test`) joins its chunk packages into one file. The file holds
Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors, norms stored as 1 + w, and no chat template.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from deepinfer.model_executor.layers.ops.qmatmul import dequantize_ref
from deepinfer.model_executor.loader import load_model_source
from deepinfer.model_executor.loader.gguf import dequantize_tensor
from deepinfer.model_executor.loader.gguf_file import read_gguf_file
from deepinfer.model_executor.loader.gguf_repack import packed_gguf

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma_path(gemma3_gguf_path):
    return gemma3_gguf_path


def test_config_supplies_gemma3_design(gemma_path):
    config = load_model_source(gemma_path).hf_config
    assert config.model_type == "gemma3_text" and config.vocab_size == 262144
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (18, 640, 2048)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 256
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [5, 11, 17]
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1000000.0
    assert config.hidden_activation == "gelu_pytorch_tanh" and config.tie_word_embeddings


def test_k_quants_match_transformers_kernels(gemma_path):
    from transformers.integrations.gguf.dequant import dequantize

    checked = set()
    for tensor in read_gguf_file(gemma_path).tensors:
        if tensor.tensor_type.name in ("Q4_K", "Q6_K") and tensor.name.startswith(("blk.0.", "blk.5.")):
            raw = torch.from_numpy(np.array(tensor.data)).reshape(-1)
            theirs = dequantize(raw, int(tensor.tensor_type), torch.float32).reshape(tensor.shape)
            assert torch.equal(dequantize_tensor(tensor, torch.float32), theirs), tensor.name
            packed = packed_gguf(tensor.tensor_type.name, tensor.data, tensor.shape)  # kept in its blocks
            assert torch.equal(dequantize_ref(packed), theirs), tensor.name
            checked.add(tensor.tensor_type.name)
    assert checked == {"Q4_K", "Q6_K"}


def test_weights_equal_transformers(gemma_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, name = os.path.split(gemma_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory, gguf_file=name))
    theirs = load_gguf_checkpoint(gemma_path, return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = dict(load_model_source(gemma_path).iter_weights(torch.float32))
    assert set(ours) == set(theirs)
    for key, tensor in ours.items():
        assert torch.equal(tensor, theirs[key]), key
