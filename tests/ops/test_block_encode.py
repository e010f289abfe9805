"""The block encoders (block_encode.py) against the gguf package's dequantization: what they write
decodes, by gguf and by our reference alike, to the encoded values within each type's rounding."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from deepinfer.model_executor.layers.ops.block_encode import encode_blocks
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref

# relative RMS error of a normal matrix with a few 5x outlier columns, encoded then decoded by gguf
# (measured 0.078, 0.079, 0.150, 0.274; gguf's own Q4_0 gets 0.095 on the same matrix)
RMS_BOUND = {"IQ4_NL": 0.09, "IQ4_XS": 0.09, "Q3_K": 0.17, "Q2_K": 0.30}


def _matrix(n: int, k: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    x[:, :7] *= 5
    return x


@pytest.mark.parametrize("kind", list(RMS_BOUND))
def test_encoded_blocks_decode_to_the_values_within_the_types_rounding(kind):
    x = _matrix(96, 1024, seed=len(kind))
    data = encode_blocks(x, kind)
    decoded = quants.dequantize(data, GGMLQuantizationType[kind]).reshape(x.shape)
    rel = np.sqrt(((decoded - x) ** 2).mean() / (x**2).mean())
    assert rel <= RMS_BOUND[kind], rel
    ours = dequantize_ref(QuantWeight(torch.from_numpy(data), kind))
    assert torch.equal(ours, torch.from_numpy(decoded))  # our decoders on a quantizer's blocks


@pytest.mark.parametrize("kind", list(RMS_BOUND))
def test_zeros_and_a_single_value_are_kept(kind):
    x = np.zeros((2, 256), np.float32)
    x[1, 37] = -3.0
    decoded = quants.dequantize(encode_blocks(x, kind), GGMLQuantizationType[kind]).reshape(x.shape)
    assert (decoded[0] == 0).all() and np.isfinite(decoded).all()
    assert abs(decoded[1, 37] + 3.0) <= 0.1 and np.abs(np.delete(decoded[1], 37)).max() <= 0.3


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="no encoder for 'Q9_K'"):
        encode_blocks(np.zeros((1, 256)), "Q9_K")
    with pytest.raises(ValueError, match="K=96 is not a multiple of Q3_K's 256-value blocks"):
        encode_blocks(np.zeros((1, 96)), "Q3_K")
