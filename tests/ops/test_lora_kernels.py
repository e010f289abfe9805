"""Batched LoRA deltas: the C++ kernel (every variant this CPU runs) and the Triton shrink/expand
launches (interpreted on the CPU; compiled for sm_90 in a subprocess; run on a GPU under `-m cuda`)
against the op's formula in float64, at odd shapes with mixed ranks, slot -1 rows and unused slots."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deepinfer.model_executor.layers.ops.lora_kernels import lora_cpu_isas, lora_delta_cpu

# (T, in, out, ranks of the slots: 0 = an unused slot of zeros)
SHAPES = [(1, 37, 53, (5, 0, 3)), (7, 100, 130, (64, 1, 0, 17, 8)), (16, 16, 16, (1, 1)),
          (37, 161, 75, (2, 33, 0, 64)), (5, 3, 7, (2,))]


def make_adapters(ranks: tuple[int, ...], hidden: int, out: int, seed: int):
    """a [S, r_max, in], b [S, out, r_max] with slot s's rank ranks[s] (zeros past it), scale [S] (alpha / r)."""
    gen = torch.Generator().manual_seed(seed)
    max_rank = max(ranks)
    a = torch.zeros(len(ranks), max_rank, hidden)
    b = torch.zeros(len(ranks), out, max_rank)
    for s, rank in enumerate(ranks):
        a[s, :rank] = torch.randn(rank, hidden, generator=gen) / hidden ** 0.5
        b[s, :, :rank] = torch.randn(out, rank, generator=gen)
    scale = torch.tensor([16.0 / max(rank, 1) for rank in ranks])  # [S]
    return a, b, scale


def make_batch(num_tokens: int, hidden: int, ranks: tuple[int, ...], seed: int):
    """x [T, in] and slots [T]: -1 and the used slots mixed (slot 0 and -1 always present when T > 1)."""
    gen = torch.Generator().manual_seed(seed)
    used = [s for s, rank in enumerate(ranks) if rank] or [0]
    pool = torch.tensor([-1, *used])
    slot = pool[torch.randint(0, len(pool), (num_tokens,), generator=gen)]
    if num_tokens > 1:
        slot[:2] = torch.tensor([used[0], -1])
    return torch.randn(num_tokens, hidden, generator=gen), slot


def formula(x, slot, a, b, scale) -> torch.Tensor:
    """The op, row by row in float64: scale[s] * (x[t] @ a[s]^T) @ b[s]^T, 0 for slot -1."""
    y = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, s in enumerate(slot.tolist()):
        if s >= 0:
            y[t] = scale[s].double() * (x[t].double() @ a[s].double().T) @ b[s].double().T
    return y


def assert_close_rel(got: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """|got - expected| <= rel * max|expected| everywhere (elementwise relative error is meaningless where
    a delta cancels to near zero); zero rows exactly zero."""
    scale = expected.abs().max().item()
    assert scale > 0.1
    err = (got.double() - expected).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"
    assert torch.equal(got[expected.abs().sum(1) == 0], torch.zeros_like(got[expected.abs().sum(1) == 0]))


# ---- the C++ kernel ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,hidden,out,ranks", SHAPES)
def test_cpu_kernel_matches_the_formula(num_tokens, hidden, out, ranks):
    assert "plain" in lora_cpu_isas(), "the CPU kernel library did not build"
    a, b, scale = make_adapters(ranks, hidden, out, seed=hidden)
    x, slot = make_batch(num_tokens, hidden, ranks, seed=out)
    expected = formula(x, slot, a, b, scale)  # [T, out] float64
    results = {isa: lora_delta_cpu(x, slot, a, b, scale, isa=isa) for isa in lora_cpu_isas()}
    for isa, got in results.items():
        assert got.dtype == torch.float32 and got.shape == (num_tokens, out)
        assert_close_rel(got, expected, 1e-5)
        assert torch.equal(got, results["plain"]), f"{isa} differs from the portable variant"


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_rows_do_not_depend_on_the_batch(threads):
    """A row alone gives the same bits as the same row in a mixed batch (and as the batch under 1 thread)."""
    a, b, scale = make_adapters((16, 0, 7, 64), 200, 300, seed=1)
    x, slot = make_batch(37, 200, (16, 0, 7, 64), seed=2)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = {isa: lora_delta_cpu(x, slot, a, b, scale, isa=isa) for isa in lora_cpu_isas()}
        torch.set_num_threads(threads)
        for isa, whole in reference.items():
            assert torch.equal(lora_delta_cpu(x, slot, a, b, scale, isa=isa), whole), isa
            for t in (0, 5, 36):
                alone = lora_delta_cpu(x[t : t + 1], slot[t : t + 1], a, b, scale, isa=isa)  # [1, out]
                assert torch.equal(alone, whole[t : t + 1]), (isa, t)
            moved = torch.cat([x[20:], x[:20]]), torch.cat([slot[20:], slot[:20]])  # other neighbours
            assert torch.equal(lora_delta_cpu(*moved, a, b, scale, isa=isa)[17:], whole[:20]), isa
    finally:
        torch.set_num_threads(saved)


def test_cpu_kernel_other_dtypes_and_empty_batches():
    a, b, scale = make_adapters((8, 4), 48, 40, seed=3)
    x, slot = make_batch(9, 48, (8, 4), seed=4)
    got = lora_delta_cpu(x.bfloat16(), slot, a.bfloat16(), b.bfloat16(), scale)  # computed in fp32
    assert got.dtype == torch.bfloat16
    expected = formula(x.bfloat16().float(), slot, a.bfloat16().float(), b.bfloat16().float(), scale)
    assert_close_rel(got.float(), expected, 1e-2)  # the output rounded to bf16 (8 bits)
    empty = lora_delta_cpu(x[:0], slot[:0], a, b, scale)
    assert empty.shape == (0, 40)
    none = lora_delta_cpu(x, torch.full_like(slot, -1), a, b, scale)
    assert torch.equal(none, torch.zeros(9, 40))


def test_bad_inputs_are_refused():
    a, b, scale = make_adapters((4, 4), 32, 16, seed=5)
    x, slot = make_batch(3, 32, (4, 4), seed=6)
    with pytest.raises(ValueError, match=r"slot\[1\] = 2 is outside \[-1, 2\)"):
        lora_delta_cpu(x, torch.tensor([0, 2, -1]), a, b, scale)
    with pytest.raises(ValueError, match="slot must be int64"):
        lora_delta_cpu(x, slot.int(), a, b, scale)
    with pytest.raises(ValueError, match=r"a must be \[S, r_max, 32\]"):
        lora_delta_cpu(x, slot, a[:, :, :16], b, scale)
    with pytest.raises(ValueError, match=r"b must be \[2, out, 4\], got \[2, 16, 3\]"):
        lora_delta_cpu(x, slot, a, b[:, :, :3], scale)
    with pytest.raises(ValueError, match=r"scale must be \[2\]"):
        lora_delta_cpu(x, slot, a, b, scale[:1])
    with pytest.raises(ValueError, match="x must be a floating tensor"):
        lora_delta_cpu(x.int(), slot, a, b, scale)
    with pytest.raises(ValueError, match="isa must be one of"):
        lora_delta_cpu(x, slot, a, b, scale, isa="avx9")


def test_lora_delta_picks_the_kernel_for_fp32_cpu_tensors(isa_env):
    from deepinfer.model_executor.layers.ops.lora import lora_delta, lora_delta_ref, lora_op_name

    a, b, scale = make_adapters((8, 0, 16), 72, 90, seed=10)
    x, slot = make_batch(11, 72, (8, 0, 16), seed=11)
    assert lora_op_name(torch.device("cpu"), torch.float32) == "cpu_kernel"
    got = lora_delta(x, slot, a, b, scale)  # [T, out]
    assert torch.equal(got, lora_delta_cpu(x, slot, a, b, scale))
    torch.testing.assert_close(got, lora_delta_ref(x, slot, a, b, scale), rtol=1e-5, atol=1e-5)
    assert lora_op_name(torch.device("cpu"), torch.bfloat16) == "torch"  # bf16 on the CPU: the reference
    assert torch.equal(lora_delta(x.bfloat16(), slot, a.bfloat16(), b.bfloat16(), scale),
                       lora_delta_ref(x.bfloat16(), slot, a.bfloat16(), b.bfloat16(), scale))
    isa_env("none")
    assert lora_op_name(torch.device("cpu"), torch.float32) == "torch"
    assert torch.equal(lora_delta(x, slot, a, b, scale), lora_delta_ref(x, slot, a, b, scale))


# ---- the Triton kernels ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,hidden,out,ranks", [*SHAPES, (70, 50, 40, (20, 3))])
def test_triton_matches_the_formula(num_tokens, hidden, out, ranks):
    from deepinfer.model_executor.layers.ops.triton.lora import lora_delta_triton

    a, b, scale = make_adapters(ranks, hidden, out, seed=hidden)
    x, slot = make_batch(num_tokens, hidden, ranks, seed=out)
    expected = formula(x, slot, a, b, scale)  # [T, out]
    assert_close_rel(lora_delta_triton(x, slot, a, b, scale), expected, 1e-5)
    got = lora_delta_triton(x.bfloat16(), slot, a.bfloat16(), b.bfloat16(), scale)  # [T, out] bf16
    assert got.dtype == torch.bfloat16
    expected_bf16 = formula(x.bfloat16().float(), slot, a.bfloat16().float(), b.bfloat16().float(), scale)
    assert_close_rel(got.float(), expected_bf16, 1e-2)  # the output rounded to bf16 (8 bits)


def test_triton_grouping_and_block_rows():
    from deepinfer.model_executor.layers.ops.triton.lora import group_rows_by_slot, lora_delta_triton

    order, starts, counts = group_rows_by_slot(torch.tensor([1, 0, -1, 1, 0, 1]), 3)
    assert order.tolist() == [1, 4, 0, 3, 5, 2] and starts.tolist() == [0, 2, 5] and counts.tolist() == [2, 3, 0]
    a, b, scale = make_adapters((8, 16), 40, 72, seed=7)
    x, slot = make_batch(45, 40, (8, 16), seed=8)  # 45 rows: several 16-row blocks per slot
    expected = formula(x, slot, a, b, scale)
    assert_close_rel(lora_delta_triton(x, slot, a, b, scale, block_m=16), expected, 1e-5)
    assert_close_rel(lora_delta_triton(x, slot, a, b, scale, block_m=64), expected, 1e-5)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        lora_delta_triton(x, slot, a, b, scale, block_m=24)


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer.model_executor.layers.ops.triton import lora

rows = {"order_ptr": "*i64", "starts_ptr": "*i64", "counts_ptr": "*i64"}
kernels = {
    lora._shrink_kernel: ({**rows, "x_ptr": "*bf16", "a_ptr": "*bf16", "scale_ptr": "*fp32", "h_ptr": "*fp32",
                           "stride_xt": "i32", "stride_as": "i32", "stride_ar": "i32", "stride_ak": "i32",
                           "stride_ht": "i32"},
                          {"hidden": 4096, "rank": 16, "UPCAST": False, "BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 128}),
    lora._expand_kernel: ({**rows, "h_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "stride_ht": "i32",
                           "stride_bs": "i32", "stride_bn": "i32", "stride_br": "i32", "stride_yt": "i32"},
                          {"out_features": 4096, "rank": 16, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_R": 16}),
}
ptx = {}
for kernel, (signature, sizes) in kernels.items():
    signature = {name: signature.get(name, "constexpr") for name in kernel.arg_names}
    ptx[kernel] = triton.compile(ASTSource(kernel, signature, sizes), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
assert "mma" in ptx[lora._shrink_kernel]  # the bf16 shrink on tensor cores
print("compiled")
"""


@pytest.mark.subprocess
def test_triton_kernels_compile_for_a_gpu(tmp_path):
    """The real compiler (not the interpreter) builds both kernels for sm_90: catches GPU-only errors
    (dot shapes, dtype rules) that the interpreter lets through."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.cuda
def test_gpu_lora_matches_and_times(capsys):
    """On a GPU (or on the CPU under GPU_CHECK_CPU=1, gpu_check.sh --cpu): the compiled kernels against the
    float64 formula, then a [4096 -> 4096] layer with 4 rank-16 adapters timed beside its bf16 F.linear."""
    if not torch.cuda.is_available() and os.environ.get("GPU_CHECK_CPU") != "1":
        pytest.skip("needs a CUDA device (scripts/gpu_check.sh runs it; GPU_CHECK_CPU=1 rehearses it on the CPU)")
    from deepinfer.model_executor.layers.ops.triton.lora import lora_delta_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for num_tokens, hidden, out, ranks in SHAPES:
        a, b, scale = make_adapters(ranks, hidden, out, seed=hidden)
        x, slot = make_batch(num_tokens, hidden, ranks, seed=out)
        expected = formula(x, slot, a, b, scale)
        args = [t.to(device) for t in (x, slot, a, b, scale)]
        assert_close_rel(lora_delta_triton(*args).cpu(), expected, 1e-5)
    _time_layer(device, capsys)


def _time_layer(device: str, capsys) -> None:
    """Prints `result lora ...` lines: the deltas' time beside the base layer's bf16 matmul."""
    import time

    from deepinfer.model_executor.layers.ops.triton.lora import lora_delta_triton

    hidden, out = (4096, 4096) if device == "cuda" else (64, 96)
    a, b, scale = (t.to(device) for t in make_adapters((16, 16, 16, 16), hidden, out, seed=9))
    a, b = a.bfloat16(), b.bfloat16()
    weight = torch.randn(out, hidden, device=device, dtype=torch.bfloat16)
    for num_tokens in (1, 16, 256, 4096) if device == "cuda" else (1, 16):
        x = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16)
        slot = torch.arange(num_tokens, device=device) % 4
        timings = {}
        for name, run in (("lora", lambda: lora_delta_triton(x, slot, a, b, scale)),  # noqa: B023
                          ("linear", lambda: torch.nn.functional.linear(x, weight))):  # noqa: B023
            run()
            if device == "cuda":
                torch.cuda.synchronize()
            start, reps = time.perf_counter(), 50 if device == "cuda" else 1
            for _ in range(reps):
                run()
            if device == "cuda":
                torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - start) / reps * 1e3
        with capsys.disabled():
            print(f"\nresult lora {device} [{hidden} -> {out}] 4 adapters r=16 T={num_tokens:5d}: "
                  f"{timings['lora']:.3f} ms, base linear {timings['linear']:.3f} ms "
                  f"(ratio {timings['lora'] / timings['linear']:.2f})")
