"""The quantized matmul kernels against dequantize-then-matmul, on random shapes (odd sizes too),
for every packed layout and every instruction set this CPU runs."""

import pytest
import torch

from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa
from deepinfer.model_executor.layers.ops.qmatmul import (
    QuantWeight,
    dequantize,
    dequantize_ref,
    qmatmul,
    qmatmul_ref,
    quantize_weight,
)

ISAS = [isa for isa in (1, 2) if kernel_isa() >= isa]


def random_weight(n: int, k: int, bits: int, group: int, seed: int = 0, half: bool = False) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.02
    minv = torch.randn(n, k // group, generator=g) * 0.01
    if half:  # fp16 scales, as GGUF stores them
        scale, minv = scale.half(), minv.half()
    return QuantWeight(q, scale, minv, bits, group, "test")


def test_a_kernel_is_built_on_x86_with_avx2():
    """CI machines have AVX2: the library must build and load there (no silent torch fallback)."""
    assert kernel_isa() >= 1


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (8, 16)])
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 37, 96), (3, 50, 160), (7, 129, 64), (16, 64, 256), (33, 19, 32)])
@pytest.mark.parametrize("half", [False, True])
def test_kernel_matches_dequantize_then_matmul(isa, bits, group, m, n, k, half):
    w = random_weight(n, k, bits, group, seed=m * 1000 + n, half=half)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))  # [m, k]
    y = torch.ops.deepinfer_cpu.qmatmul(x, w.q, w.scale, w.minv, bits, group, isa)  # [m, n]
    torch.testing.assert_close(y, qmatmul_ref(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (8, 16)])
@pytest.mark.parametrize("half", [False, True])
def test_kernel_dequantize_is_exact(isa, bits, group, half):
    w = random_weight(45, 224, bits, group, half=half)
    out = torch.ops.deepinfer_cpu.qdequant(w.q, w.scale, w.minv, bits, group, isa)
    torch.testing.assert_close(out, dequantize_ref(w), rtol=1e-6, atol=1e-7)
    bf16 = torch.ops.deepinfer_cpu.qdequant(w.q, w.scale, w.minv, bits, group, isa, True)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, dequantize_ref(w).to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_qmatmul_keeps_shape_and_dtype(rows):
    w = quantize_weight(torch.randn(24, 64), "int4")
    x = torch.randn(2, rows, 64, dtype=torch.bfloat16)
    y = qmatmul(x, w)
    assert y.shape == (2, rows, 24) and y.dtype == torch.bfloat16
    ref = qmatmul_ref(x, w)
    assert (y.float() - ref).norm() / ref.norm() < 1e-2  # bf16 output (and a bf16 GEMM for many rows)


def test_results_do_not_depend_on_batch_rows():
    """A row's output is the same whether it runs alone or in a batch (row tiles, not row sums)."""
    w = random_weight(70, 128, 4, 32)
    x = torch.randn(9, 128)
    alone = torch.cat([qmatmul(x[i:i + 1], w) for i in range(9)])
    assert torch.equal(alone, qmatmul(x, w))


def test_torch_fallback_without_kernels(isa_env):
    isa_env("none")
    w = random_weight(10, 64, 8, 16)
    x = torch.randn(3, 64)
    torch.testing.assert_close(qmatmul(x, w), qmatmul_ref(x, w))
    torch.testing.assert_close(dequantize(w), dequantize_ref(w))


def test_bad_isa_name_is_named(isa_env):
    with pytest.raises(ValueError, match="DEEPINFER_CPU_ISA.*sse9"):
        isa_env("sse9")
        kernel_isa()


@pytest.mark.parametrize("scheme,tol", [("int8", 0.01), ("int4", 0.15)])
def test_quantize_weight_error_is_bounded(scheme, tol):
    weight = torch.randn(64, 96)
    w = quantize_weight(weight, scheme)
    err = (dequantize_ref(w) - weight).abs().max() / weight.abs().max()
    assert err < tol


def test_quantize_weight_refuses_a_ragged_k():
    with pytest.raises(ValueError, match="K=30"):
        quantize_weight(torch.randn(4, 30), "int8")


def test_scales_of_two_dtypes_are_refused():
    with pytest.raises(ValueError, match="both be float32 or both float16"):
        QuantWeight(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1), torch.zeros(2, 1).half(), 4, 32, "x")


def test_layout_errors_name_the_field():
    with pytest.raises(ValueError, match="bits=4 group=16"):
        QuantWeight(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1), torch.zeros(2, 1), 4, 16, "x")
