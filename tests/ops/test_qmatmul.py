"""`QuantWeight` (a matrix kept in ggml blocks) and `qmatmul`: the integer path against
dequantize-then-matmul for every packed type, merged parts, row and column cuts on block
boundaries, zero padding, and quantization at load against llama.cpp's reference formulas."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf_blocks import finite_scales

from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa
from deepinfer.model_executor.layers.ops.qmatmul import (
    BLOCKS,
    QuantWeight,
    dequantize,
    dequantize_ref,
    qmatmul,
    qmatmul_ref,
    quantize_weight,
)


def random_weight(kind: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """Valid random blocks: a known weight quantized where gguf has a quantizer, else random bytes
    with small finite fp16 fields (gguf_blocks.py)."""
    rng = np.random.default_rng(seed)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        values = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return QuantWeight(torch.from_numpy(quants.quantize(values, GGMLQuantizationType[kind])), kind)
    block, size = BLOCKS[kind]
    data = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    finite_scales(data, kind, rng, 0.0005, 0.002)
    return QuantWeight(torch.from_numpy(data.reshape(n, -1)), kind)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def rounding_bound(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """|x w - x' w| <= sum_i |w_i| |x_i - x'_i| with |x_i - x'_i| <= d / 2 = amax / 254 of x_i's
    block of 32 (round to nearest), plus fp32 slack: [M, N]."""
    amax = x.reshape(x.shape[0], -1, 32).abs().amax(-1).repeat_interleave(32, dim=1)  # [M, K]
    return (amax / 254) @ dequantize_ref(w).abs().T * 1.01 + 1e-4


def test_a_kernel_is_built_on_x86_with_avx2():
    """CI machines have AVX2: the library must build and load there (no silent torch fallback)."""
    assert kernel_isa() >= 1


@pytest.mark.parametrize("kind", list(BLOCKS))
@pytest.mark.parametrize("m,n", [(1, 1), (1, 37), (3, 50), (7, 129), (130, 19)])
def test_qmatmul_matches_dequantize_then_matmul(kind, m, n):
    """Activations are quantized to int8 per 32 values: each output is within that rounding of
    the fp32 product."""
    k = 512
    w = random_weight(kind, n, k, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))  # [m, k]
    y = qmatmul(x, w)  # [m, n]
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert ((y - qmatmul_ref(x, w)).abs() <= rounding_bound(x, w)).all()


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_qmatmul_keeps_shape_and_dtype(rows):
    w = quantize_weight(torch.randn(24, 64), "int4")
    x = torch.randn(2, rows, 64, dtype=torch.bfloat16)
    y = qmatmul(x, w)
    assert y.shape == (2, rows, 24) and y.dtype == torch.bfloat16
    assert relative_error(y, qmatmul_ref(x, w)) < 2e-2  # bf16 output


def test_merged_parts_of_different_types_equal_each_part_alone():
    """q|k|v in Q5_0, Q5_0, Q8_0: one activation quantization, the parts' outputs side by side."""
    parts = [random_weight("Q5_0", 48, 256, 1), random_weight("Q8_0", 16, 256, 2), random_weight("Q6_K", 8, 256, 3)]
    x = torch.randn(4, 256)
    y = qmatmul(x, parts)  # [4, 72]
    alone = torch.cat([qmatmul(x, p) for p in parts], dim=-1)
    torch.testing.assert_close(y, alone, rtol=1e-5, atol=1e-5)
    ref = torch.nn.functional.linear(x, torch.cat([dequantize_ref(p) for p in parts]))
    assert relative_error(y, ref) < 1e-2


def test_results_do_not_depend_on_batch_rows():
    """A row's output is the same whether it runs alone or in a batch (activations are quantized per row)."""
    w = random_weight("Q4_K", 70, 256)
    x = torch.randn(9, 256)
    alone = torch.cat([qmatmul(x[i:i + 1], w) for i in range(9)])
    assert torch.equal(alone, qmatmul(x, w))


def test_torch_fallback_without_kernels(isa_env):
    isa_env("none")
    w = random_weight("Q4_1", 10, 64)
    x = torch.randn(3, 64)
    assert relative_error(qmatmul(x, w), qmatmul_ref(x, w)) < 1e-2
    assert torch.equal(dequantize(w), dequantize_ref(w))


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_cuts_and_padding_stay_packed(kind):
    w = random_weight(kind, 12, 768)
    dense = dequantize_ref(w)  # [12, 768]
    block = w.block
    assert w.shape == (12, 768) and w.nbytes == 12 * 768 // block * BLOCKS[kind][1]
    assert torch.equal(dequantize_ref(w.narrow(0, 3, 5)), dense[3:8])
    assert torch.equal(dequantize_ref(w.narrow(1, block, 2 * block)), dense[:, block:3 * block])
    assert torch.equal(dequantize_ref(w.rows(torch.tensor([7, 0, 7]))), dense[[7, 0, 7]])
    padded = w.padded_rows(15)
    assert padded.shape == (15, 768) and torch.equal(dequantize_ref(padded)[12:], torch.zeros(3, 768))
    with pytest.raises(ValueError, match=f"cut its blocks of {block} values"):
        w.narrow(1, 16, block)


def test_layout_errors_name_the_field():
    with pytest.raises(ValueError, match="no block layout for ggml type 'NVFP4'"):
        QuantWeight(torch.zeros(2, 36, dtype=torch.uint8), "NVFP4")
    with pytest.raises(ValueError, match="19 bytes per row"):
        QuantWeight(torch.zeros(2, 19, dtype=torch.uint8), "Q4_0")
    with pytest.raises(ValueError, match="contiguous 2-D uint8"):
        QuantWeight(torch.zeros(2, 18, dtype=torch.int8), "Q4_0")


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _llama_cpp_q8_0(w: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_0_ref in torch: d = amax / 127, q = roundf(x / d) -> [N, blocks * 34] bytes."""
    blocks = w.reshape(w.shape[0], -1, 32)  # [N, nb, 32]
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = _round_away(blocks * torch.where(d == 0, 0.0, 1.0 / d)).to(torch.int8)
    return torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(w.shape[0], -1)


def _llama_cpp_q4_1(w: torch.Tensor) -> torch.Tensor:
    """quantize_row_q4_1_ref in torch: d = (max - min) / 15, m = min, q = (x - min) / d + 0.5
    truncated to 0..15; byte j = q_j | q_{16+j} << 4 -> [N, blocks * 20] bytes."""
    blocks = w.reshape(w.shape[0], -1, 32)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.trunc((blocks - lo) * torch.where(d == 0, 0.0, 1.0 / d) + 0.5).clamp(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([d.half().view(torch.uint8), lo.half().view(torch.uint8), nibbles], dim=-1).reshape(w.shape[0], -1)


@pytest.mark.parametrize("scheme,kind,reference",
                         [("int8", "Q8_0", _llama_cpp_q8_0), ("int4", "Q4_1", _llama_cpp_q4_1)])
def test_quantize_weight_writes_llama_cpps_blocks(scheme, kind, reference):
    weight = torch.randn(64, 96)
    weight[3, :32] = 0  # an all-zero block: d = 0
    w = quantize_weight(weight, scheme)
    assert w.kind == kind and w.shape == (64, 96)
    assert torch.equal(w.data, reference(weight))


@pytest.mark.parametrize("scheme,tol", [("int8", 0.01), ("int4", 0.15)])
def test_quantize_weight_error_is_bounded(scheme, tol):
    weight = torch.randn(64, 96)
    w = quantize_weight(weight, scheme)
    err = (dequantize_ref(w) - weight).abs().max() / weight.abs().max()
    assert err < tol


def test_quantize_weight_refuses_a_ragged_k():
    with pytest.raises(ValueError, match="K=30"):
        quantize_weight(torch.randn(4, 30), "int8")
