"""Every repacked GGUF block type against the gguf package's own dequantization."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

from deepinfer.model_executor.layers.ops.qmatmul import compact_scales, dequantize, dequantize_ref
from deepinfer.model_executor.loader.gguf_repack import REPACKED_TYPES, repack_gguf

# byte offsets of the fp16 fields (d, m, dmin) in each block: random bytes there could be inf/NaN
_HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid random GGUF data for an [n, k] tensor: random bytes with finite fp16 scales."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for offset in _HALF_FIELDS[kind]:
        halves = rng.uniform(-0.05, 0.05, size=data.shape[0]).astype(np.float16)
        data[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return data.reshape(n, -1)


@pytest.mark.parametrize("kind", REPACKED_TYPES)
@pytest.mark.parametrize("shape", [(3, 256), (17, 512)])
def test_repack_matches_gguf_dequantize(kind, shape):
    n, k = shape
    data = random_blocks(kind, n, k)
    expected = quants.dequantize(data, GGMLQuantizationType[kind]).reshape(n, k)
    w = repack_gguf(kind, data, (n, k))
    assert w is not None and w.shape == (n, k) and w.kind == kind
    torch.testing.assert_close(dequantize_ref(w), torch.from_numpy(expected), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dequantize(w), torch.from_numpy(expected), rtol=1e-6, atol=1e-6)


def test_repacked_sizes_stay_small():
    """Q4_1 keeps 4 bits per value plus its two fp16 numbers per 32 values, as in the file."""
    w = repack_gguf("Q4_1", random_blocks("Q4_1", 8, 256), (8, 256))
    assert w.bits == 4 and w.nbytes == 8 * 256 // 2 + 2 * 8 * 8 * 2


@pytest.mark.parametrize("kind", REPACKED_TYPES)
def test_scales_are_fp16_exactly_where_the_format_stores_them(kind):
    """d and m fields (and -8 d, -16 d) fit fp16 exactly; a K-quant's d * sc generally does not."""
    w = repack_gguf(kind, random_blocks(kind, 4, 256, seed=3), (4, 256))
    expected = torch.float32 if kind.endswith("_K") else torch.float16
    assert w.scale.dtype == w.minv.dtype == expected


def test_compact_scales_keeps_fp32_unless_fp16_is_exact():
    exact = torch.tensor([[0.5, -0.125, 3.0]]), torch.tensor([[0.0, 1.0, -2.0]])
    assert all(t.dtype == torch.float16 for t in compact_scales(*exact))
    inexact = torch.tensor([[0.1, 0.5, 3.0]]), torch.zeros(1, 3)
    assert all(t.dtype == torch.float32 for t in compact_scales(*inexact))


@pytest.mark.parametrize("kind", ["F16", "Q2_K", "IQ4_NL"])
def test_types_without_layout_return_none(kind):
    assert repack_gguf(kind, np.zeros((2, 64), np.uint8), (2, 64)) is None


def test_a_type_without_kernel_is_dequantized_with_one_log_line(caplog):
    """Q2_K has no packed layout: the loader dequantizes it (the same values as gguf's) and says so once."""
    from deepinfer.model_executor.loader import gguf as gguf_loader
    from deepinfer.model_executor.loader.gguf_file import GGUFTensor

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K]
    data = np.random.default_rng(0).integers(0, 256, size=(4, size), dtype=np.uint8)
    data[:, -4:] = np.array([0.01, 0.01], dtype=np.float16).view(np.uint8)  # d, dmin: finite
    tensor = GGUFTensor("blk.0.ffn_up.weight", GGMLQuantizationType.Q2_K, (4, block), data)
    gguf_loader._UNPACKED_LOGGED.discard("Q2_K")
    with caplog.at_level("WARNING", logger="deepinfer.loader"):
        first = gguf_loader.to_hf_tensor(tensor, "qwen2", None, torch.float32, keep_quantized=True)
        gguf_loader.to_hf_tensor(tensor, "qwen2", None, torch.float32, keep_quantized=True)
    assert isinstance(first, torch.Tensor)
    torch.testing.assert_close(first, torch.from_numpy(quants.dequantize(data, GGMLQuantizationType.Q2_K)))
    assert [r.getMessage() for r in caplog.records].count(
        "GGUF type Q2_K has no quantized kernel: its tensors (e.g. blk.0.ffn_up.weight) are dequantized") == 1


def test_llama_qk_rows_are_unpermuted_in_packed_weights():
    """llama.cpp's per-head row order is undone on the packed rows exactly as on dense ones."""
    from types import SimpleNamespace

    from deepinfer.model_executor.loader import gguf as gguf_loader
    from deepinfer.model_executor.loader.gguf_file import GGUFTensor

    data = random_blocks("Q4_1", 8, 64)
    tensor = GGUFTensor("blk.0.attn_q.weight", GGMLQuantizationType.Q4_1, (8, 64), data)
    cfg = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1)
    packed = gguf_loader.to_hf_tensor(tensor, "llama", cfg, torch.float32, keep_quantized=True)
    dense = gguf_loader.to_hf_tensor(tensor, "llama", cfg, torch.float32)
    torch.testing.assert_close(dequantize_ref(packed), dense)
