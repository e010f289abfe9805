"""The block encoders (block_encode.py, iq_encode.py) against the gguf package's dequantization: what
they write decodes, by gguf and by our reference alike, to the encoded values within each type's
rounding."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from deepinfer.model_executor.layers.ops import iq_encode
from deepinfer.model_executor.layers.ops.block_encode import encode_blocks
from deepinfer.model_executor.layers.ops.qdot import KINDS
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref

# relative RMS error of a normal matrix with a few 5x outlier columns, encoded then decoded by gguf
# (measured 0.078, 0.079, 0.150, 0.274; gguf's own Q4_0 gets 0.095 on the same matrix)
RMS_BOUND = {"IQ4_NL": 0.09, "IQ4_XS": 0.09, "Q3_K": 0.17, "Q2_K": 0.30}
# the grid and ternary types (measured 0.352, 0.300, 0.258, 0.185, 0.140, 0.469, 0.424, 0.522, 0.522)
GRID_BOUND = {"IQ2_XXS": 0.38, "IQ2_XS": 0.33, "IQ2_S": 0.28, "IQ3_XXS": 0.20, "IQ3_S": 0.155,
              "IQ1_S": 0.50, "IQ1_M": 0.46, "TQ1_0": 0.56, "TQ2_0": 0.56}
ALL_BOUNDS = RMS_BOUND | GRID_BOUND


def _matrix(n: int, k: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    x[:, :7] *= 5
    return x


def _round_trip(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    data = encode_blocks(x, kind)
    return data, quants.dequantize(data, GGMLQuantizationType[kind]).reshape(x.shape)


def _rel(x: np.ndarray, decoded: np.ndarray) -> float:
    return float(np.sqrt(((decoded - x) ** 2).mean() / (x**2).mean()))


@pytest.mark.parametrize("kind", list(ALL_BOUNDS))
def test_encoded_blocks_decode_to_the_values_within_the_types_rounding(kind):
    x = _matrix(96, 1024, seed=len(kind))
    data, decoded = _round_trip(x, kind)
    block, size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    assert data.dtype == np.uint8 and data.shape == (96, 1024 // block * size)
    assert _rel(x, decoded) <= ALL_BOUNDS[kind]


@pytest.mark.parametrize("kind", [k for k in ALL_BOUNDS if k in KINDS])
def test_our_decoders_read_a_quantizers_blocks_as_gguf_does(kind):
    data, decoded = _round_trip(_matrix(8, 512, seed=3), kind)
    ours = dequantize_ref(QuantWeight(torch.from_numpy(data), kind))
    assert torch.equal(ours, torch.from_numpy(decoded))


@pytest.mark.parametrize("kind", list(GRID_BOUND))
def test_the_scale_search_beats_its_first_candidate(kind, monkeypatch):
    """The same matrix with only the scale that maps each sub-block's largest value onto the grid's
    largest level (TQ: also gguf's own quantizer, d = max |x|) decodes worse."""
    x = _matrix(32, 1024, seed=7)
    searched = _rel(x, _round_trip(x, kind)[1])
    if kind.startswith("TQ"):
        plain = quants.quantize(x, GGMLQuantizationType[kind])
        assert searched < _rel(x, quants.dequantize(plain, GGMLQuantizationType[kind]).reshape(x.shape))
    monkeypatch.setattr(iq_encode, "_TRIES", np.ones(1, np.float32))
    monkeypatch.setattr(iq_encode, "_TRIES_1", np.ones(1, np.float32))
    assert searched < _rel(x, _round_trip(x, kind)[1])


@pytest.mark.parametrize("kind", list(GRID_BOUND))
def test_grid_types_keep_zeros_and_the_sign_of_a_single_value(kind):
    """A grid has no zero row, so a lone value's neighbours decode to small values, and its own value
    to the least squares fit of the row nearest to it: its sign and some of its size (IQ2_XXS, the
    sparsest grid, keeps about half: -1.45 with squared error 4.7 against the zero row's 9)."""
    x = np.zeros((2, 512), np.float32)
    x[1, 37] = -3.0
    _, decoded = _round_trip(x, kind)
    assert (decoded[0] == 0).all() and np.isfinite(decoded).all() and (decoded[1, 256:] == 0).all()
    assert decoded[1, 37] <= -1.0 and ((decoded[1] - x[1]) ** 2).sum() < 0.6 * (x[1] ** 2).sum()


@pytest.mark.parametrize("kind", list(RMS_BOUND))
def test_zeros_and_a_single_value_are_kept(kind):
    x = np.zeros((2, 256), np.float32)
    x[1, 37] = -3.0
    decoded = quants.dequantize(encode_blocks(x, kind), GGMLQuantizationType[kind]).reshape(x.shape)
    assert (decoded[0] == 0).all() and np.isfinite(decoded).all()
    assert abs(decoded[1, 37] + 3.0) <= 0.1 and np.abs(np.delete(decoded[1], 37)).max() <= 0.3


def test_a_matrix_larger_than_a_chunk_encodes_as_its_parts(monkeypatch):
    """Blocks are encoded a chunk at a time; the chunks' bytes are the whole's."""
    x = _matrix(4, 1024, seed=5)
    whole = encode_blocks(x, "IQ2_XS")
    monkeypatch.setattr("deepinfer.model_executor.layers.ops.block_encode._CHUNK", 3)
    assert np.array_equal(encode_blocks(x, "IQ2_XS"), whole)


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="no encoder for 'Q9_K'"):
        encode_blocks(np.zeros((1, 256)), "Q9_K")
    with pytest.raises(ValueError, match="K=96 is not a multiple of Q3_K's 256-value blocks"):
        encode_blocks(np.zeros((1, 96)), "Q3_K")
    with pytest.raises(ValueError, match="K=288 is not a multiple of IQ1_M's 256-value blocks"):
        encode_blocks(np.zeros((1, 288)), "IQ1_M")
