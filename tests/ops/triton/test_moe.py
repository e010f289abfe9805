"""The Triton grouped expert GEMM (ops/triton/moe.py) against the torch expert loop of DeepSeek-V4.

The reference is `FusedExperts` (layers/fused_moe.py) on its CPU path: one `F.linear` pair per
active expert, clamped SwiGLU, fp32 weighted scatter-add. On a machine without CUDA the kernels run
under the Triton interpreter, so shapes stay small. Routed ids leave some experts without tokens.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from deepinfer.model_executor.layers.fused_moe import FusedExperts
from deepinfer.model_executor.layers.kernel_set import TRITON_KERNELS
from deepinfer.model_executor.layers.ops.triton import moe as triton_moe
from deepinfer.model_executor.layers.ops.triton.moe import align_pairs_by_expert, fused_experts, max_padded_blocks

E, H, I = 8, 64, 32
USED_EXPERTS = torch.tensor([0, 1, 2, 4, 5, 6])  # experts 3 and 7 never get a token


def make_experts(hidden: int = H, inter: int = I, limit: float | None = 0.75,
                 dtype: torch.dtype = torch.float32) -> FusedExperts:
    """Experts with N(0, 0.3) weights: gate/up values reach beyond a 0.75 limit on both sides."""
    experts = FusedExperts(E, hidden, inter, limit)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * 0.3)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * 0.3)
    return experts.to(dtype)


def make_routing(num_tokens: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k], topk_weights [T, k]): k distinct experts of USED_EXPERTS per token."""
    gen = torch.Generator().manual_seed(seed)
    picks = [USED_EXPERTS[torch.randperm(len(USED_EXPERTS), generator=gen)[:top_k]] for _ in range(num_tokens)]
    ids = torch.stack(picks) if picks else torch.zeros(0, top_k, dtype=torch.long)  # [T, k]
    return ids, torch.rand(num_tokens, top_k, generator=gen)


def run_both(experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, **kwargs):
    """(kernel output, torch-loop output) for the same experts and routing."""
    with torch.no_grad():
        got = fused_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj, experts.swiglu_limit,
                            **kwargs)  # [T, H]
        return got, experts(x, ids, weights)  # [T, H]


@pytest.mark.parametrize("num_tokens,top_k,block_m", [(13, 2, 16), (40, 6, 16), (9, 4, 32)])
def test_align_pairs_groups_each_expert_in_padded_blocks(num_tokens, top_k, block_m):
    ids, _ = make_routing(num_tokens, top_k)
    sorted_pairs, block_expert, offsets = align_pairs_by_expert(ids, E, block_m)
    num_pairs, flat = ids.numel(), ids.reshape(-1)
    assert sorted_pairs.numel() == block_expert.numel() * block_m == max_padded_blocks(num_pairs, E, block_m) * block_m
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (sorted_pairs[sorted_pairs >= num_pairs] == num_pairs).all()
    start = 0
    for e in range(E):
        count = int((flat == e).sum())
        blocks = -(-count // block_m)
        assert int(offsets[e]) == start
        run = sorted_pairs[start:start + blocks * block_m]  # [blocks*B]
        assert sorted(run[:count].tolist()) == sorted((flat == e).nonzero().flatten().tolist())
        assert (run[count:] == num_pairs).all()
        assert (block_expert[start // block_m:start // block_m + blocks] == e).all()
        start += blocks * block_m
    assert (block_expert[start // block_m:] == -1).all()
    assert int(offsets[E]) == start and start % block_m == 0


@pytest.mark.parametrize("num_tokens,top_k,limit", [(1, 2, 0.75), (7, 3, None), (40, 6, 0.75), (16, 5, 10.0)])
def test_matches_torch_loop_fp32(num_tokens, top_k, limit):
    experts = make_experts(limit=limit)
    ids, weights = make_routing(num_tokens, top_k, seed=num_tokens)
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(2))  # [T, H]
    got, expected = run_both(experts, x, ids, weights)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, H)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_limit_changes_the_result():
    """The clamp is live at these shapes, so the parity tests above check it rather than pass around it."""
    ids, weights = make_routing(12, 3)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(3))  # [T, H]
    clamped, _ = run_both(make_experts(limit=0.75), x, ids, weights)
    free, _ = run_both(make_experts(limit=None), x, ids, weights)
    assert (clamped - free).abs().max() > 0.1


def test_odd_sizes_and_wider_row_blocks():
    """H and I that are neither powers of two nor multiples of 16; 32-row blocks; int32 ids."""
    experts = make_experts(hidden=48, inter=24)
    ids, weights = make_routing(21, 3, seed=5)
    x = torch.randn(21, 48, generator=torch.Generator().manual_seed(4))  # [T, 48]
    got, expected = run_both(experts, x, ids.int(), weights, block_m=32)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_matches_torch_loop_bf16():
    experts = make_experts(dtype=torch.bfloat16)
    ids, weights = make_routing(24, 4, seed=6)
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(5)).bfloat16()  # [T, H]
    got, expected = run_both(experts, x, ids, weights)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1.6e-2)  # about one bf16 step at |y| ~ 1


def test_fp32_weights_with_bf16_activations_use_bf16_weights():
    """Weight tiles are cast to the activation dtype: the same as running on weights cast beforehand."""
    experts = make_experts()
    ids, weights = make_routing(10, 2, seed=7)
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(6)).bfloat16()  # [T, H]
    with torch.no_grad():
        got = fused_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj, 0.75)  # [T, H]
        expected = experts.to(torch.bfloat16)(x, ids, weights)  # [T, H]
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1.6e-2)


def test_empty_batch_and_bad_inputs():
    experts = make_experts()
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    ids, weights = make_routing(5, 2)
    x = torch.randn(5, H)  # [T, H]
    assert fused_experts(x[:0], ids[:0], weights[:0], gate_up, down).shape == (0, H)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 8\), got 3\.\.9"):
        fused_experts(x, ids + 3, weights, gate_up, down)
    with pytest.raises(ValueError, match="topk_weights must have shape"):
        fused_experts(x, ids, weights[:, :1], gate_up, down)
    with pytest.raises(ValueError, match="topk_ids must be an integer"):
        fused_experts(x, ids.float(), weights, gate_up, down)
    with pytest.raises(ValueError, match="gate_up_proj must have shape"):
        fused_experts(x[:, :32], ids, weights, gate_up, down)
    with pytest.raises(ValueError, match="down_proj must have shape"):
        fused_experts(x, ids, weights, gate_up, down[:, :, :16])
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        fused_experts(x, ids, weights, gate_up, down, block_m=24)


def test_fused_experts_module_dispatches_to_the_kernel(monkeypatch):
    """Bound to the Triton kernel set (as binding the Triton backend does), `FusedExperts.forward` returns the
    kernel's result."""
    experts = make_experts()
    ids, weights = make_routing(11, 3, seed=8)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(7))  # [T, H]
    with torch.no_grad():
        expected = experts(x, ids, weights)  # [T, H] torch loop
    assert experts.kernels is not TRITON_KERNELS  # off unless bound to the Triton backend
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return fused_experts(*args, **kwargs)

    experts.kernels = TRITON_KERNELS
    monkeypatch.setattr(triton_moe, "fused_experts", spy)
    with torch.no_grad():
        got = experts(x, ids, weights)  # [T, H]
    assert calls == [{"check_ids": False}]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="topk_ids"):
        experts(x, ids + 5, weights)


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer.model_executor.layers.ops.triton import moe

assert isinstance(moe._down_kernel, triton.runtime.JITFunction), type(moe._down_kernel)
strides = lambda *names: {n: "i32" for n in names}
sizes = {"hidden": 7168, "inter": 2048, "UPCAST": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}
kernels = {
    moe._gate_up_act_kernel: ({"x_ptr": "*bf16", "w_ptr": "*bf16", "act_ptr": "*bf16", "sorted_pairs_ptr": "*i64",
                               "block_expert_ptr": "*i32", "num_pairs": "i32", "top_k": "i32", "limit": "fp32",
                               **strides("stride_xt", "stride_we", "stride_wn", "stride_wk", "stride_ar")},
                              {**sizes, "HAS_LIMIT": True}),
    moe._down_kernel: ({"act_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*fp32", "sorted_pairs_ptr": "*i64",
                        "block_expert_ptr": "*i32", "weights_ptr": "*fp32", "num_pairs": "i32",
                        **strides("stride_ar", "stride_we", "stride_wn", "stride_wk", "stride_yp")}, sizes),
}
for kernel, (signature, constants) in kernels.items():
    signature = {**signature, **{name: "constexpr" for name in constants}}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert "mma" in compiled.asm["ptx"], kernel.__name__  # bf16 dots on tensor cores
print("compiled")
"""


@pytest.mark.subprocess
def test_kernels_compile_for_a_gpu(tmp_path):
    """The real compiler (not the interpreter) builds both kernels for sm_90 with bf16 tensor-core dots.

    No GPU is needed: triton's bundled ptxas compiles for a named target. Catches GPU-only errors
    (dot shapes, early returns, dtype rules) that the interpreter lets through.
    """
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.fixture
def gpu_check_device() -> str:
    """cuda when torch sees a device; the CPU (the kernels interpreted) under GPU_CHECK_CPU=1, as
    scripts/gpu_check.sh --cpu rehearses the check; else the test is skipped."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("GPU_CHECK_CPU") == "1":
        return "cpu"
    pytest.skip("needs a CUDA device (scripts/gpu_check.sh runs it; GPU_CHECK_CPU=1 rehearses it on the CPU)")


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_cuda_matches_cpu_torch_loop(num_tokens, gpu_check_device, monkeypatch):
    """`FusedExperts` bound to the Triton kernel set (as the Triton backend binds it) runs the grouped GEMM,
    compiled on a GPU (interpreted under gpu_check.sh --cpu), and agrees with the same experts' CPU torch loop.
    scripts/gpu_check.sh runs it (`-m cuda`); tests/test_gpu_check_script.py checks that its step selects it."""
    reference = FusedExperts(16, 256, 96, 0.75)  # I = 96: masked column tiles
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    experts = copy.deepcopy(reference).to(gpu_check_device)
    experts.kernels = TRITON_KERNELS
    calls = []

    def spy(x, *args, **kwargs):
        calls.append(x.dtype)
        return fused_experts(x, *args, **kwargs)

    monkeypatch.setattr(triton_moe, "fused_experts", spy)
    ids = torch.stack([torch.randperm(12, generator=gen)[:6] for _ in range(num_tokens)])  # [T, 6]; 12..15 idle
    weights, x = torch.rand(num_tokens, 6, generator=gen), torch.randn(num_tokens, 256, generator=gen)  # [T, 6], [T, H]
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        with torch.no_grad():
            expected = reference.to(dtype)(x.to(dtype), ids, weights)  # [T, H] torch loop on the CPU
            got = experts.to(dtype)(*(t.to(gpu_check_device) for t in (x.to(dtype), ids, weights)))  # [T, H] kernel
        torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)
    assert calls == [torch.float32, torch.bfloat16], "the grouped GEMM ran once per dtype"
