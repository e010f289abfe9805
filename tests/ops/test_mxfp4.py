"""MXFP4 weights (ops/mxfp4.py): the torch reference against a hand-decoded E2M1 table and against
transformers' own dequantization; the C++ kernel (every variant this CPU runs) and the Triton grouped
expert GEMM (interpreted on the CPU) against the reference's dequantize-then-matmul, at odd shapes."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from deepinfer.model_executor.layers.mxfp4_moe import OssExperts, oss_swiglu
from deepinfer.model_executor.layers.ops.mxfp4 import (
    dequantize_mxfp4,
    mxfp4_isas,
    mxfp4_matmul,
    mxfp4_matmul_ref,
    quantize_mxfp4,
)

# E2M1 by hand: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal (m * 0.5)
HAND_E2M1 = {code: (-1.0 if code & 8 else 1.0) * (((code & 1) * 0.5) if not (code >> 1) & 3
                                                   else 2.0 ** (((code >> 1) & 3) - 1) * (1 + (code & 1) / 2))
             for code in range(16)}


def random_packed(*lead: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes in every nibble and scale bytes 2^-8 .. 2^2 around 1: blocks [..., n, k/32, 16], scales."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, n, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(119, 130, (*lead, n, k // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_reference_decodes_the_hand_table():
    assert HAND_E2M1[1] == 0.5 and HAND_E2M1[7] == 6.0 and HAND_E2M1[13] == -3.0  # the table itself, spot-checked
    codes = torch.arange(32) % 16  # [32]: every code, twice
    blocks = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(1, 1, 16)  # value 2j low, 2j + 1 high
    for s in (0, 1, 120, 127, 130, 254):
        got = dequantize_mxfp4(blocks, torch.tensor([[s]], dtype=torch.uint8))  # [1, 32]
        expected = torch.tensor([math.ldexp(HAND_E2M1[int(c)], s - 127) for c in codes])
        assert torch.equal(got[0], expected), s
        assert torch.equal(torch.signbit(got[0]), torch.signbit(expected))  # code 8 is -0.0


def test_reference_matches_transformers_dequantization():
    """transformers dequantizes GPT-OSS's experts to [E, K, N]; ours is [E, N, K]: the same numbers."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_packed(3, n=40, k=96)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 96, 40]
    assert torch.equal(theirs, dequantize_mxfp4(blocks, scales).transpose(1, 2))


def test_quantize_rounds_to_the_nearest_value_ties_to_even():
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 5.9, 6.0, 0.3])  # ties, then not
    w = torch.cat([grid, torch.zeros(20)]).view(1, 32)  # one block, max 6: scale 2^0
    blocks, scales = quantize_mxfp4(w)
    assert scales.item() == 127
    got = dequantize_mxfp4(blocks, scales)[0, :12]
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -2.0, 6.0, 6.0, 0.5]


def test_quantize_keeps_representable_weights_and_picks_the_nearest():
    blocks, scales = random_packed(2, n=9, k=64, seed=1)
    exact = dequantize_mxfp4(blocks, scales)  # [2, 9, 64]
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(exact)), exact)
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))  # [5, 64]
    qb, qs = quantize_mxfp4(w)
    got = dequantize_mxfp4(qb, qs)  # [5, 64]
    scale = torch.exp2(qs.float() - 127).repeat_interleave(32, dim=1)  # [5, 64]
    candidates = torch.tensor(list(HAND_E2M1.values()))[None, None, :] * scale[..., None]  # [5, 64, 16]
    best = (w[..., None] - candidates).abs().amin(-1)  # [5, 64]
    assert torch.equal((w - got).abs(), best)
    assert (w.abs().unflatten(1, (2, 32)).amax(-1) / qs.float().sub(127).exp2() <= 6).all()  # nothing clipped


@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (3, 7, 96), (17, 33, 160), (6, 130, 64)])
def test_cpu_kernel_matches_dequantize_then_matmul(m, n, k):
    assert "plain" in mxfp4_isas(), "the CPU kernel library did not build"
    blocks, scales = random_packed(n=n, k=k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))  # [M, K]
    expected = mxfp4_matmul_ref(x, blocks, scales)  # [M, N]
    results = {isa: mxfp4_matmul(x, blocks, scales, isa=isa) for isa in mxfp4_isas()}
    for isa, got in results.items():
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * math.sqrt(k), msg=isa)
        assert torch.equal(got, results["plain"]), f"{isa} differs from the portable variant"


def test_cpu_kernel_rows_do_not_depend_on_the_batch_or_threads():
    blocks, scales = random_packed(n=37, k=224, seed=3)
    x = torch.randn(11, 224, generator=torch.Generator().manual_seed(4))  # [11, K]: fused and buffered panels
    whole = mxfp4_matmul(x, blocks, scales)  # [11, N]
    for rows in (slice(0, 1), slice(3, 7), slice(2, 11)):
        assert torch.equal(mxfp4_matmul(x[rows], blocks, scales), whole[rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(mxfp4_matmul(x, blocks, scales), whole)
    finally:
        torch.set_num_threads(threads)


def test_without_the_kernel_the_reference_runs(isa_env):
    isa_env("none")
    blocks, scales = random_packed(n=5, k=64)
    x = torch.randn(2, 3, 64)  # [2, 3, K]: leading dims kept
    got = mxfp4_matmul(x, blocks, scales)  # [2, 3, 5]
    assert got.shape == (2, 3, 5) and torch.equal(got.view(6, 5), mxfp4_matmul_ref(x.view(6, 64), blocks, scales))


def test_bad_inputs_are_refused():
    blocks, scales = random_packed(n=4, k=64)
    with pytest.raises(ValueError, match="the weight K=64"):
        mxfp4_matmul(torch.randn(2, 32), blocks, scales)
    with pytest.raises(ValueError, match="blocks must be"):
        mxfp4_matmul(torch.randn(2, 64), blocks, scales[:, :1])
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(3, 48))
    with pytest.raises(ValueError, match="isa must be one of"):
        mxfp4_matmul(torch.randn(2, 64), blocks, scales, isa="avx9")


# ---- experts: the Triton grouped GEMM and the per-expert path -----------------------------------------

E = 8
USED = torch.tensor([0, 2, 3, 5, 6, 7])  # experts 1 and 4 get no token


def packed_experts(hidden: int, inter: int, seed: int = 0, limit: float = 7.0) -> OssExperts:
    """Experts with random MXFP4 weights (values up to 6 * 2^2) and biases: gate/up values pass the limit."""
    experts = OssExperts(E, hidden, inter, packed=True, swiglu_limit=limit)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = random_packed(E, n=getattr(experts, f"{name}_scales").shape[1],
                                           k=getattr(experts, f"{name}_scales").shape[2] * 32, seed=seed)
            getattr(experts, f"{name}_blocks").copy_(blocks)
            getattr(experts, f"{name}_scales").copy_(scales - 5)  # values ~ 2^-6: outputs of order 1
            getattr(experts, f"{name}_bias").copy_(torch.randn(getattr(experts, f"{name}_bias").shape,
                                                               generator=gen))
    return experts


def routing(num_tokens: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([USED[torch.randperm(len(USED), generator=gen)[:top_k]] for _ in range(num_tokens)])  # [T, k]
    return ids, torch.rand(num_tokens, top_k, generator=gen).softmax(-1)


def reference_experts(experts: OssExperts, x, ids, weights) -> torch.Tensor:
    """Token by token on dequantized weights, in float64: sum_j w_j * (act(x W1^T + b1) W2^T + b2)."""
    w1 = dequantize_mxfp4(experts.gate_up_proj_blocks, experts.gate_up_proj_scales).double()  # [E, 2I, H]
    w2 = dequantize_mxfp4(experts.down_proj_blocks, experts.down_proj_scales).double()  # [E, H, I]
    b1, b2 = experts.gate_up_proj_bias.double(), experts.down_proj_bias.double()
    out = torch.zeros(x.shape, dtype=torch.float64)  # [T, H]
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist(), strict=True):
            act = oss_swiglu(w1[e] @ x[t].double() + b1[e], experts.alpha, experts.limit)  # [I]
            out[t] += w * (w2[e] @ act + b2[e])
    return out


@pytest.mark.parametrize("num_tokens,top_k,hidden,inter", [(1, 2, 64, 32), (13, 2, 96, 160), (21, 4, 160, 64)])
def test_triton_experts_match_the_reference(num_tokens, top_k, hidden, inter):
    from deepinfer.model_executor.layers.ops.triton.mxfp4 import mxfp4_experts

    experts = packed_experts(hidden, inter, seed=num_tokens)
    ids, weights = routing(num_tokens, top_k, seed=hidden)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(inter))  # [T, H]
    expected = reference_experts(experts, x, ids, weights)  # [T, H] float64
    gate_up = (experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.gate_up_proj_bias.detach())
    down = (experts.down_proj_blocks, experts.down_proj_scales, experts.down_proj_bias.detach())
    got = mxfp4_experts(x, ids, weights, gate_up, down, experts.alpha, experts.limit)  # [T, H]
    assert got.dtype == torch.float32 and expected.abs().max() > 1
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(experts(x, ids, weights).double(), expected, rtol=1e-5, atol=1e-5)  # the C++ path
    got_bf16 = mxfp4_experts(x.bfloat16(), ids, weights, gate_up, down, experts.alpha, experts.limit)
    torch.testing.assert_close(got_bf16.double(), expected, rtol=3e-2, atol=3e-2)  # bf16 activations


def test_the_limit_is_live():
    """At these weights gate and up pass the clamp, so the parity tests check it rather than pass around it."""
    experts = packed_experts(64, 32)
    ids, weights = routing(9, 2)
    x = torch.randn(9, 64) * 4  # [T, H]
    with torch.no_grad():
        clamped = experts(x, ids, weights)
        experts.limit = 100.0
        free = experts(x, ids, weights)
    assert (clamped - free).abs().max() > 0.1


def test_dense_experts_in_hf_layout_match_packed_ones():
    """A checkpoint saved dequantized holds gate_up_proj [E, H, 2I] and down_proj [E, I, H] (HF's layout)."""
    packed = packed_experts(64, 96, seed=5)
    dense = OssExperts(E, 64, 96, packed=False, swiglu_limit=7.0)
    with torch.no_grad():
        dense.gate_up_proj.copy_(dequantize_mxfp4(packed.gate_up_proj_blocks, packed.gate_up_proj_scales).mT)
        dense.down_proj.copy_(dequantize_mxfp4(packed.down_proj_blocks, packed.down_proj_scales).mT)
        dense.gate_up_proj_bias.copy_(packed.gate_up_proj_bias)
        dense.down_proj_bias.copy_(packed.down_proj_bias)
        ids, weights = routing(7, 2)
        x = torch.randn(7, 64)  # [T, H]
        torch.testing.assert_close(dense(x, ids, weights), packed(x, ids, weights), rtol=1e-5, atol=1e-5)
    assert packed.weight_bytes() * 32 * 4 == dense.weight_bytes() * 17  # 17 bytes per 32 values vs 4 per value


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer.model_executor.layers.ops.triton import mxfp4

common = {"sorted_pairs_ptr": "*i64", "block_expert_ptr": "*i32", "num_pairs": "i32", "w_ptr": "*u8", "s_ptr": "*u8",
          "b_ptr": "*bf16"}
sizes = {"hidden": 2880, "inter": 2880, "UPCAST": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128}
kernels = {
    mxfp4._gate_up_kernel: {**common, "x_ptr": "*bf16", "act_ptr": "*bf16", "top_k": "i32", "alpha": "fp32",
                            "limit": "fp32", "stride_xt": "i32", "stride_ar": "i32"},
    mxfp4._down_kernel: {**common, "act_ptr": "*bf16", "y_ptr": "*fp32", "weights_ptr": "*fp32", "stride_ar": "i32",
                         "stride_yp": "i32"},
}
for kernel, signature in kernels.items():
    signature = {name: signature[name] if name in signature else "constexpr" for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, sizes), target=GPUTarget("cuda", 90, 32))
    assert "mma" in compiled.asm["ptx"], kernel.__name__  # bf16 dots on tensor cores
print("compiled")
"""


@pytest.mark.subprocess
def test_triton_kernels_compile_for_a_gpu(tmp_path):
    """The real compiler (not the interpreter) builds both kernels for sm_90 with tensor-core dots: catches
    GPU-only errors (dot shapes, reshapes and splits, dtype rules) that the interpreter lets through."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.cuda
def test_gpu_experts_match_and_time(capsys):
    """On a GPU (or on the CPU under GPU_CHECK_CPU=1, gpu_check.sh --cpu): the compiled kernels against the
    float64 reference, then one GPT-OSS-20B-sized layer (32 experts, top-4, H = I = 2880) timed."""
    if not torch.cuda.is_available() and os.environ.get("GPU_CHECK_CPU") != "1":
        pytest.skip("needs a CUDA device (scripts/gpu_check.sh runs it; GPU_CHECK_CPU=1 rehearses it on the CPU)")
    from deepinfer.model_executor.layers.ops.triton.mxfp4 import mxfp4_experts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts = packed_experts(160, 96, seed=7)
    ids, weights = routing(37, 4)
    x = torch.randn(37, 160)  # [T, H]
    expected = reference_experts(experts, x, ids, weights)  # [T, H]
    args = [t.detach().to(device) for t in (experts.gate_up_proj_blocks, experts.gate_up_proj_scales,
                                            experts.gate_up_proj_bias, experts.down_proj_blocks,
                                            experts.down_proj_scales, experts.down_proj_bias)]
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        got = mxfp4_experts(x.to(device, dtype), ids.to(device), weights.to(device), args[:3], args[3:],
                            experts.alpha, experts.limit)  # [T, H]
        torch.testing.assert_close(got.double().cpu(), expected, rtol=tol, atol=tol)
    _time_layer(device, capsys)


def _time_layer(device: str, capsys) -> None:
    """Prints `result mxfp4 ...` lines: a 20B-sized layer's experts at decode and prefill batch sizes."""
    import time

    from deepinfer.model_executor.layers.ops.triton.mxfp4 import mxfp4_experts

    num_experts, hidden, top_k = (32, 2880, 4) if device == "cuda" else (4, 64, 2)
    blocks = [torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
              for shape in ((num_experts, 2 * hidden, hidden // 32, 16), (num_experts, hidden, hidden // 32, 16))]
    scales = [torch.full(b.shape[:-1], 120, dtype=torch.uint8, device=device) for b in blocks]
    biases = [torch.zeros(num_experts, 2 * hidden, device=device), torch.zeros(num_experts, hidden, device=device)]
    for tokens in (1, 64, 1024) if device == "cuda" else (1, 8):
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)  # [T, H]
        ids = torch.stack([torch.randperm(num_experts, device=device)[:top_k] for _ in range(tokens)])  # [T, k]
        weights = torch.full((tokens, top_k), 1.0 / top_k, device=device)

        def run():
            return mxfp4_experts(x, ids, weights, (blocks[0], scales[0], biases[0]),  # noqa: B023
                                 (blocks[1], scales[1], biases[1]), 1.702, 7.0)

        run()
        if device == "cuda":
            torch.cuda.synchronize()
        start, reps = time.perf_counter(), 20 if device == "cuda" else 1
        for _ in range(reps):
            run()
        if device == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / reps * 1e3
        read = sum(b.numel() + s.numel() for b, s in zip(blocks, scales, strict=True)) * min(
            1.0, tokens * top_k / num_experts)  # bytes of the experts the batch touches (about)
        with capsys.disabled():
            print(f"\nresult mxfp4 experts {device} E={num_experts} H=I={hidden} k={top_k} T={tokens:5d}: "
                  f"{ms:.3f} ms ({read / ms / 1e6:.0f} GB/s of packed weights)")
