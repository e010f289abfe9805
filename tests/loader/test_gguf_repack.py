"""GGUF matrices kept in their own blocks: the bytes are the file's, and they decode (plain torch,
`dequantize_ref`) to what the gguf package's own dequantization gives, for every packed type."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES
from gguf_blocks import finite_scales

from deepinfer.model_executor.layers.ops.qmatmul import BLOCKS, dequantize, dequantize_ref
from deepinfer.model_executor.loader.gguf_repack import PACKED_TYPES, packed_gguf


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid random GGUF data for an [n, k] tensor: random bytes with finite fp16 scales."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    finite_scales(data, kind, rng, -0.05, 0.05)
    return data.reshape(n, -1)


def test_block_table_is_ggmls():
    assert set(PACKED_TYPES) == set(BLOCKS)
    for kind, sizes in BLOCKS.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[kind]] == sizes, kind


@pytest.mark.parametrize("kind", PACKED_TYPES)
@pytest.mark.parametrize("shape", [(3, 256), (17, 512)])
def test_packed_rows_decode_as_gguf_dequantize(kind, shape):
    n, k = shape
    data = random_blocks(kind, n, k)
    expected = torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[kind]).reshape(n, k))
    w = packed_gguf(kind, data, (n, k))
    assert w is not None and w.shape == (n, k) and w.kind == kind
    assert w.data.dtype == torch.uint8 and np.array_equal(w.data.numpy(), data)  # the file's bytes
    assert torch.equal(dequantize_ref(w), expected)
    assert torch.equal(dequantize(w, torch.bfloat16), expected.to(torch.bfloat16))


@pytest.mark.parametrize("kind", PACKED_TYPES)
def test_packed_bytes_are_the_files(kind):
    data = random_blocks(kind, 8, 512)
    w = packed_gguf(kind, data, (8, 512))
    assert w.nbytes == data.nbytes
    assert w.data.data_ptr() == data.ctypes.data  # a view of the caller's buffer (the file's mapping), no copy


@pytest.mark.parametrize("kind", ["F16", "NVFP4", "Q8_1"])
def test_types_without_layout_return_none(kind):
    assert packed_gguf(kind, np.zeros((2, 64), np.uint8), (2, 64)) is None


def test_vectors_stay_dequantized():
    assert packed_gguf("Q8_0", random_blocks("Q8_0", 1, 64), (64,)) is None


def test_a_type_without_kernel_is_dequantized_with_one_log_line(caplog):
    """NVFP4 has no kernel: the loader dequantizes it (the same values as gguf's) and says so once."""
    from deepinfer.model_executor.loader import gguf as gguf_loader
    from deepinfer.model_executor.loader.gguf_file import GGUFTensor

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.NVFP4]
    data = np.random.default_rng(0).integers(0, 256, size=(4, size), dtype=np.uint8)
    tensor = GGUFTensor("blk.0.ffn_up.weight", GGMLQuantizationType.NVFP4, (4, block), data)
    gguf_loader._UNPACKED_LOGGED.discard("NVFP4")
    with caplog.at_level("WARNING", logger="deepinfer.loader"):
        first = gguf_loader.to_hf_tensor(tensor, "qwen2", None, torch.float32, keep_quantized=True)
        gguf_loader.to_hf_tensor(tensor, "qwen2", None, torch.float32, keep_quantized=True)
    assert isinstance(first, torch.Tensor)
    torch.testing.assert_close(first, torch.from_numpy(quants.dequantize(data, GGMLQuantizationType.NVFP4)))
    assert [r.getMessage() for r in caplog.records].count(
        "GGUF type NVFP4 has no quantized kernel: its tensors (e.g. blk.0.ffn_up.weight) are dequantized") == 1


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K"])
def test_llama_qk_rows_are_unpermuted_in_packed_weights(kind):
    """llama.cpp's per-head row order is undone on the packed rows exactly as on dense ones."""
    from types import SimpleNamespace

    from deepinfer.model_executor.loader import gguf as gguf_loader
    from deepinfer.model_executor.loader.gguf_file import GGUFTensor

    data = random_blocks(kind, 8, 256)
    tensor = GGUFTensor("blk.0.attn_q.weight", GGMLQuantizationType[kind], (8, 256), data)
    cfg = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1)
    packed = gguf_loader.to_hf_tensor(tensor, "llama", cfg, torch.float32, keep_quantized=True)
    dense = gguf_loader.to_hf_tensor(tensor, "llama", cfg, torch.float32)
    assert packed.kind == kind and torch.equal(dequantize_ref(packed), dense)
