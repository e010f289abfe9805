"""MXFP8 rows: layout, the scale rule, and the round-trip error bound."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.model_executor.layers.ops.cache_common import V41_FORMAT, mxfp8_format
from deepinfer.model_executor.layers.ops.mxfp8 import (
    E4M3_MAX,
    block_exponents,
    dequantize_mxfp8,
    mxfp8_row_bytes,
    quantize_mxfp8,
)


def test_a_512_element_row_takes_528_bytes_as_the_book_computes():
    rows = quantize_mxfp8(torch.randn(3, 512))
    assert rows.shape == (3, 528) and rows.dtype == torch.uint8
    assert mxfp8_row_bytes(512) == V41_FORMAT.bytes_per_row == 528
    assert mxfp8_row_bytes(384) == mxfp8_format(384).bytes_per_row == 396  # SmolLM2: 2 * 3 heads * 64


def test_row_width_must_be_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.randn(1, 40))


def test_scale_is_the_smallest_power_of_two_that_fits_e4m3():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 32] = 448.0, 449.0  # exactly fits at 2^0; needs 2^1
    assert block_exponents(x).tolist() == [[0, 1]]
    x[0, 0] = 1.0  # 1 / 448 -> 2^-8 (256 <= 448 < 512)
    e = block_exponents(x)[0, 0].item()
    assert 1.0 / 2**e <= E4M3_MAX < 1.0 / 2 ** (e - 1)
    assert quantize_mxfp8(x)[0, 64].item() == e + 127  # UE8M0 byte = exponent + 127


def _step_bound(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 step at each value's magnitude and its block's scale 2^e."""
    scale = torch.exp2(e.float()).repeat_interleave(32, dim=-1)  # [N, E]
    mag = (x.abs() / scale).clamp(min=2.0**-6)  # below 2^-6 e4m3 is subnormal: fixed step 2^-9
    return torch.exp2(torch.floor(torch.log2(mag)) - 3) / 2 * scale  # 3 mantissa bits


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.floats(-30, 30), st.integers(0, 2**31 - 1))
def test_round_trip_error_is_within_half_an_e4m3_step(rows, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 128, generator=g) * math.exp(log_scale)
    x[:, 5] = 0.0  # zeros survive exactly
    q = dequantize_mxfp8(quantize_mxfp8(x), 128, torch.float32)
    err = (q - x).abs()
    bound = _step_bound(x, block_exponents(x))
    assert torch.all(err <= bound * (1 + 1e-6) + 1e-30)
    assert torch.all(q[:, 5] == 0)


def test_all_zero_block_and_bf16_output():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    assert torch.equal(dequantize_mxfp8(quantize_mxfp8(x), 32, torch.bfloat16), x)
