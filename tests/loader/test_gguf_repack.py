"""Every repacked GGUF block type against the gguf package's own dequantization."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

from deepinfer.model_executor.layers.ops.qmatmul import dequantize, dequantize_ref
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
    """4-bit types keep 4 bits per value plus two fp32 numbers per 32 values."""
    w = repack_gguf("Q4_1", random_blocks("Q4_1", 8, 256), (8, 256))
    assert w.bits == 4 and w.nbytes == 8 * 256 // 2 + 2 * 8 * 8 * 4


@pytest.mark.parametrize("kind", ["F16", "Q2_K", "IQ4_NL"])
def test_types_without_layout_return_none(kind):
    assert repack_gguf(kind, np.zeros((2, 64), np.uint8), (2, 64)) is None
