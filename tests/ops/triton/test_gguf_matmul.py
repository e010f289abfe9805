"""GGUF block weights on the GPU path: the Triton kernels that multiply them in their blocks
(ops/triton/gguf_matmul.py), and `dequantize_ref` on the weight's own device.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (small shapes: it is slow);
with CUDA the same tests run them compiled. For every type: the decoders give `gguf.quants.dequantize`'s
values bit for bit, and the product equals F.linear of x and that weight rounded to x's dtype, within
fp32 accumulation, for decode (M = 1, 3: the GEMV launch) and prefill (M = 33: tl.dot), N not a
multiple of any tile, K several blocks (and, for the 32-value types, not a multiple of a slab).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants
from gguf_blocks import finite_scales

from deepinfer.model_executor.layers.ops import iq_blocks, qdot
from deepinfer.model_executor.layers.ops import qmatmul as qm
from deepinfer.model_executor.layers.ops.block_encode import ENCODED_KINDS, encode_blocks
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref, qmatmul
from deepinfer.model_executor.layers.ops.triton import gguf_matmul as gm

KINDS = list(qdot.KINDS)
META = torch.device("meta")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: the kernels interpreted
GGUF_QUANTIZES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}  # the gguf package's quantizer writes these
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
N = 19  # not a multiple of the GEMV's 4 or 8 rows nor of the prefill's 64


def random_weight(kind: str, n: int, k: int, seed: int) -> QuantWeight:
    """Random bytes (every code and sub-block scale) with finite fp16 scales in [-0.006, 0.014)."""
    rng = np.random.default_rng(seed)
    spec = qdot.KINDS[kind]
    data = rng.integers(0, 256, (n, k // spec.block_values * spec.block_bytes), dtype=np.uint8)
    finite_scales(data.reshape(n, -1, spec.block_bytes), kind, rng, -0.006, 0.014)
    return QuantWeight(torch.from_numpy(data), kind)


def values_per_block(kind: str) -> int:
    return qdot.KINDS[kind].block_values


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_ref_runs_on_the_weights_device(kind):
    """On the meta device (no data: a decoder that builds a table or constant on the CPU fails, or
    returns a CPU tensor): every type decodes there, [N, K] fp32."""
    w = random_weight(kind, 3, 2 * values_per_block(kind), seed=1)
    out = dequantize_ref(QuantWeight(w.data.to(META), kind))
    assert (out.device, tuple(out.shape), out.dtype) == (META, w.shape, torch.float32)


def test_decoder_tables_are_built_once_per_device():
    assert iq_blocks.grid("IQ2_S", META) is iq_blocks.grid("IQ2_S", META)
    assert iq_blocks.grid("IQ2_S", META).device == META and iq_blocks.grid("IQ2_S").device.type == "cpu"
    assert iq_blocks.ksigns(META).shape == iq_blocks.ksigns().shape == (128,)
    assert iq_blocks.shifts(2, 4, torch.uint8, META) is iq_blocks.shifts(2, 4, torch.uint8, META)
    assert iq_blocks.shifts(2, 4, torch.uint8, torch.device("cpu")).tolist() == [0, 2, 4, 6]


def quantized_weight(kind: str, n: int, k: int, seed: int) -> QuantWeight:
    """A normal weight quantized by the gguf package or block_encode.py; random blocks for the types
    neither writes (Q4_K, Q5_K, Q6_K)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    if kind in GGUF_QUANTIZES:
        return QuantWeight(torch.from_numpy(quants.quantize(w, GGMLQuantizationType[kind])), kind)
    if kind in ENCODED_KINDS:
        return QuantWeight(torch.from_numpy(np.ascontiguousarray(encode_blocks(w, kind))), kind)
    return random_weight(kind, n, k, seed)


def gguf_dense(w: QuantWeight) -> torch.Tensor:
    """gguf.quants.dequantize of the weight: fp32 [N, K] on the CPU."""
    values = quants.dequantize(w.data.cpu().numpy(), GGMLQuantizationType[w.kind])
    return torch.from_numpy(values.reshape(w.shape))


def k_for(kind: str) -> int:
    """Several blocks: 3 of 32 values (not a multiple of the 256-value GEMV slab), 2 of 256."""
    return 96 if values_per_block(kind) == 32 else 512


def on_device(w: QuantWeight) -> QuantWeight:
    return QuantWeight(w.data.to(DEVICE), w.kind)


def activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)  # [M, K]


def assert_linear(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """got == F.linear(x, dense rounded to x's dtype) within fp32 accumulation (2 K u |x| |w|) and the
    output's rounding to x's dtype."""
    w = dense.to(x.dtype).double()  # [N, K] the weight as the kernels multiply it
    exact = F.linear(x.double(), w)  # [M, N]
    accumulation = 2 * x.shape[1] * 2.0**-24 * F.linear(x.double().abs(), w.abs())  # [M, N]
    bound = accumulation + UNIT_ROUNDOFF[x.dtype] * (exact.abs() + accumulation)
    assert got.dtype == x.dtype and got.shape == exact.shape
    err = (got.double().cpu() - exact).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"


def test_every_type_has_a_kernel_id_equal_to_its_ggml_id():
    from deepinfer.model_executor.layers.ops.triton import gguf_decode

    assert gm.COVERED == set(KINDS)
    assert {name: vars(gguf_decode)[name].value for name in KINDS} == {n: k.ggml_id for n, k in qdot.KINDS.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_decoders_give_gguf_dequantize_bit_for_bit(kind):
    """Random blocks (every code, sign and sub-block scale bit) decoded in-kernel == gguf's floats."""
    w = random_weight(kind, N, k_for(kind), seed=4)
    got = gm.gguf_dequantize(on_device(w))  # [N, K]
    assert torch.equal(got.cpu(), gguf_dense(w))


@pytest.mark.parametrize("m", [1, 3, 33])
@pytest.mark.parametrize("kind", KINDS)
def test_matmul_is_linear_of_the_dequantized_weight(kind, m):
    """Every type at decode (1, 3) and prefill (33) sizes; the activation dtype rotates with the type
    and M, so that each (M, dtype) pair meets seven types."""
    dtype = DTYPES[(KINDS.index(kind) + m) % len(DTYPES)]
    w = quantized_weight(kind, N, k_for(kind), seed=m)
    x = activations(m, w.shape[1], dtype, seed=m)  # [M, K]
    assert_linear(gm.gguf_matmul(x.to(DEVICE), on_device(w)), x, gguf_dense(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "IQ2_XS"])
def test_a_decode_row_is_its_prefill_row(kind, dtype):
    """A row alone (M = 1) is bit for bit the same row among three (the GEMV sums each row on its own);
    against the same row in a prefill batch (tl.dot), the same products summed in another order."""
    w = on_device(quantized_weight(kind, N, k_for(kind), seed=5))
    x = activations(33, w.shape[1], dtype, seed=6).to(DEVICE)  # [33, K]
    prefill = gm.gguf_matmul(x, w)  # [33, N]
    three = gm.gguf_matmul(x[:3], w)  # [3, N]
    dense = gguf_dense(w).to(dtype).double()  # [N, K]
    for i in (0, 2):
        alone = gm.gguf_matmul(x[i:i + 1], w)  # [1, N]
        assert torch.equal(alone, three[i:i + 1])
        scale = F.linear(x[i:i + 1].double().cpu().abs(), dense.abs())  # [1, N]
        bound = 4 * w.shape[1] * 2.0**-24 * scale + UNIT_ROUNDOFF[dtype] * 2 * prefill[i].double().cpu().abs()
        assert ((alone.double() - prefill[i:i + 1].double()).abs().cpu() <= bound).all()


def test_empty_batch_and_bad_inputs():
    w = on_device(random_weight("Q4_0", 5, 64, seed=0))
    x = torch.randn(2, 64, device=DEVICE)  # [M, K]
    assert gm.gguf_matmul(x[:0], w).shape == (0, 5)
    with pytest.raises(ValueError, match="x has K=32, the Q4_0 weight K=64"):
        gm.gguf_matmul(x[:, :32], w)
    with pytest.raises(ValueError, match=r"x must be a 2-D fp16, bf16 or fp32 tensor, got torch.float64"):
        gm.gguf_matmul(x.double(), w)
    with pytest.raises(ValueError, match=r"x must be a 2-D .* \(2, 1, 64\)"):
        gm.gguf_matmul(x[:, None], w)
    with pytest.raises(ValueError, match="needs uint8 data"):
        gm.gguf_matmul(x, qdot_view(w.data[:, :18], "Q4_0", (5, 64)))
    with pytest.raises(ValueError, match="no Triton decoder for weight kind 'Q7_X'"):
        gm.gguf_matmul(x, qdot_view(w.data, "Q7_X", (5, 64)))
    with pytest.raises(ValueError, match="the weight is on meta"):
        gm.gguf_matmul(x, QuantWeight(w.data.to(META), "Q4_0"))


class qdot_view:  # noqa: N801  (a BlockWeight whose fields the checks refuse)
    def __init__(self, data: torch.Tensor, kind: str, shape: tuple[int, int]):
        self.data, self.kind, self.shape = data, kind, shape


@pytest.mark.parametrize("kind", KINDS)
def test_qmatmul_routes_cuda_to_the_kernels_for_every_type(kind):
    """The decision alone (no GPU needed): CUDA takes the kernels for fp16/bf16/fp32, the CPU its
    integer kernels, any other device or dtype the dequantized weight."""
    cuda = torch.device("cuda")
    assert [qm.matmul_route(cuda, kind, dtype) for dtype in DTYPES] == ["triton"] * 3
    assert qm.matmul_route(cuda, kind, torch.float64) == "dequantize"
    assert qm.matmul_route(META, kind, torch.bfloat16) == "dequantize"
    assert qm.matmul_route(torch.device("cpu"), kind, torch.bfloat16) == "integer"


def test_qmatmul_off_the_cpu_dequantizes_on_the_weights_device():
    """A device without the kernels (meta here): each part dequantized there and multiplied by F.linear;
    leading dims and x's dtype kept."""
    parts = [QuantWeight(random_weight(kind, n, 256, seed=n).data.to(META), kind) for kind, n in
             (("Q4_K", 5), ("IQ2_S", 3))]
    y = qmatmul(torch.empty(2, 4, 256, dtype=torch.bfloat16, device=META), parts)  # [2, 4, 8]
    assert (y.device, tuple(y.shape), y.dtype) == (META, (2, 4, 8), torch.bfloat16)


def test_the_triton_route_runs_the_kernel_per_part(monkeypatch):
    """With the route set to "triton" (as CUDA sets it), `device_matmul` runs gguf_matmul once per part,
    each part its own type, and the outputs sit side by side: each equals the part multiplied alone."""
    calls, kernel = [], gm.gguf_matmul

    def spy(x, w):
        calls.append(w.kind)
        return kernel(x, w)

    monkeypatch.setattr(qm, "matmul_route", lambda device, kind, dtype: "triton")
    monkeypatch.setattr(gm, "gguf_matmul", spy)
    parts = [on_device(quantized_weight(kind, n, 256, seed=n)) for kind, n in (("Q6_K", 6), ("Q8_0", 5))]
    x = activations(3, 256, torch.float32, seed=2).to(DEVICE)  # [M, K]
    y = qm.device_matmul(x, parts)  # [M, 11]
    assert calls == ["Q6_K", "Q8_0"] and y.shape == (3, 11)
    assert_linear(y[:, :6], x.cpu(), gguf_dense(parts[0]))
    assert_linear(y[:, 6:], x.cpu(), gguf_dense(parts[1]))


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer.model_executor.layers.ops import qdot
from deepinfer.model_executor.layers.ops.triton import gguf_matmul as gm

assert isinstance(gm._gemv_kernel, triton.runtime.JITFunction), type(gm._gemv_kernel)
pointers = {"x_ptr": "*bf16", "w_ptr": "*u8", "tab": "*u8", "y_ptr": "*bf16"}
scalars = {name: "i32" for name in ("M", "N", "stride_wn", "stride_xm", "stride_ym")}
for name, kind in qdot.KINDS.items():
    constants = {"K": 4096, "KIND": kind.ggml_id, "GRID": 16, "QK": kind.block_values, "BB": kind.block_bytes,
                 "UPCAST": False}
    for kernel, tiles, warps in ((gm._gemv_kernel, {"MB": 8, "BN": 8, "BK": gm.GEMV_BK}, 4),
                                 (gm._mm_kernel, {"BM": 128, "BN": gm.MM_BN, "BK": gm.MM_BK}, 8)):
        sizes = {**constants, **tiles}
        signature = {**pointers, **scalars, **{n: "constexpr" for n in sizes}}
        compiled = triton.compile(ASTSource(kernel, signature, sizes), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps})
        assert kernel is gm._gemv_kernel or "mma" in compiled.asm["ptx"], name  # bf16 dots on tensor cores
print("compiled")
"""


@pytest.mark.subprocess
def test_kernels_compile_for_a_gpu(tmp_path):
    """The real compiler builds the GEMV and the prefill kernel of every type for sm_90 (bf16; the prefill
    dot on tensor cores), no GPU needed: catches what the interpreter lets through (dot shapes, casts,
    constexpr branches)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.fixture
def gpu_check_device() -> torch.device:
    """cuda when torch sees a device; the CPU (the kernels interpreted) under GPU_CHECK_CPU=1, as
    scripts/gpu_check.sh --cpu rehearses the check; else the test is skipped."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("GPU_CHECK_CPU") == "1":
        return torch.device("cpu")
    pytest.skip("needs a CUDA device (scripts/gpu_check.sh runs it; GPU_CHECK_CPU=1 rehearses it on the CPU)")


@pytest.mark.cuda
def test_gpu_matches_dequantize_and_linear_and_times_it(gpu_check_device, capsys):
    """Compiled on a GPU (scripts/gpu_check.sh; interpreted under its --cpu rehearsal): every type's GEMV
    and four types' prefill tile in bf16 against dequantize + F.linear on the same device, then a
    [4096 x 4096] Q4_K and Q6_K weight timed at M = 1 and 512 beside dequantize + F.linear (toy sizes
    on the CPU). Prints `result gguf ...` lines."""
    from deepinfer.model_executor.layers.ops.qmatmul import dequantize

    device = gpu_check_device
    n, k = (300, 1024) if device.type == "cuda" else (N, 256)
    for kind in KINDS:
        for m in (1, 64) if kind in ("Q4_K", "Q6_K", "Q8_0", "IQ2_XXS") else (1,):
            w = QuantWeight(random_weight(kind, n, k, seed=m).data.to(device), kind)
            x = activations(m, k, torch.bfloat16, seed=m).to(device)  # [M, K]
            expected = F.linear(x.float(), dequantize(w, torch.bfloat16).float())  # [M, N]
            torch.testing.assert_close(gm.gguf_matmul(x, w).float(), expected, atol=2e-2, rtol=2e-2,
                                       msg=lambda text, kind=kind, m=m: f"{kind} M={m}: {text}")
    n, k = (4096, 4096) if device.type == "cuda" else (16, 256)
    for kind in ("Q4_K", "Q6_K"):
        w = QuantWeight(random_weight(kind, n, k, seed=3).data.to(device), kind)
        for m in (1, 512) if device.type == "cuda" else (1, 16):
            x = activations(m, k, torch.bfloat16, seed=4).to(device)  # [M, K]
            kernel = _seconds(lambda: gm.gguf_matmul(x, w), device)  # noqa: B023
            torch_path = _seconds(lambda: F.linear(x, dequantize(w, x.dtype)), device)  # noqa: B023
            moved = w.nbytes + 2 * m * (k + n)  # the weight's blocks, x and y once
            with capsys.disabled():
                print(f"\nresult gguf {kind} {n}x{k} M={m:4d} {device.type}: triton {kernel * 1e3:.3f} ms "
                      f"({moved / kernel / 1e9:.0f} GB/s), dequantize+F.linear {torch_path * 1e3:.3f} ms "
                      f"({torch_path / kernel:.1f}x the kernel's time)")


def _seconds(fn, device: torch.device) -> float:
    """The time of one call: triton's do_bench on a GPU (L2 flushed between calls, so the weight comes
    from memory), else the best of a few calls."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=40) * 1e-3
    from deepinfer.model_executor.layers.ops.qmatmul import best_time

    return best_time(fn, repeats=1)
