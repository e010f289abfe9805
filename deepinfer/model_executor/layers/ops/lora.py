"""The batched LoRA op: every row of a step adds the low-rank delta of its own adapter slot.

    lora_delta(x [T, in], slot [T] int64 (-1: none), A [S, r, in], B [S, out, r], scale [S]) -> [T, out]

    row t with slot s >= 0:   delta[t] = ((x[t] A[s]^T) B[s]^T) * scale[s]     shrink, then expand
    row t with slot -1:       delta[t] = 0

Rows are grouped by adapter: one shrink and one expand per slot the step uses. A slot holding an
adapter of a smaller rank has its A rows and B columns past that rank zero (they add exact zeros).
The order of operations is PEFT's (`lora_B(lora_A(x)) * scaling`). `scale` is float32 whatever the
dtype of x, A and B (alpha / r need not be exact in bf16).

`lora_delta_ref` is the torch reference; `lora_delta` is what the layers call, the one place a
faster kernel (C++ on the CPU, Triton on CUDA) is chosen for a call; it returns the reference's
result up to float rounding. `lora_op_name` names the implementation `lora_delta` takes for a
device and dtype: it is part of an adapted row's cache identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.ops.lora_kernels import lora_cpu_isa, lora_delta_cpu


def lora_delta_ref(x: torch.Tensor, slot: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   scale: torch.Tensor) -> torch.Tensor:
    """The torch reference of `lora_delta` (see the module docstring for shapes)."""
    _check_shapes(x, slot, A, B, scale)
    out = x.new_zeros(x.shape[0], B.shape[1])  # [T, out]
    for s in torch.unique(slot).tolist():  # ascending; -1 first
        if s < 0:
            continue
        rows = (slot == s).nonzero()[:, 0]  # [n]
        shrunk = F.linear(x.index_select(0, rows), A[s])  # [n, r]
        out.index_copy_(0, rows, (F.linear(shrunk, B[s]) * scale[s]).to(out.dtype))  # [n, out]
    return out


def lora_delta(x: torch.Tensor, slot: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               scale: torch.Tensor) -> torch.Tensor:
    """x [T, in], slot [T] int64 (-1: no adapter), A [S, r, in], B [S, out, r], scale [S] -> [T, out]."""
    op = lora_op_name(x.device, x.dtype)
    if op == "cpu_kernel":  # lora_cpu.cpp: a row's bits do not depend on the batch or the instruction set
        return lora_delta_cpu(x, slot, A, B, scale)
    if op == "triton":
        from deepinfer.model_executor.layers.ops.triton.lora import lora_delta_triton

        return lora_delta_triton(x, slot, A, B, scale)
    return lora_delta_ref(x, slot, A, B, scale)


def lora_op_name(device: torch.device, dtype: torch.dtype) -> str:
    """The implementation `lora_delta` runs on `device` in `dtype` (part of the cache identity): "cpu_kernel"
    for fp32 on the CPU where the kernel runs, "triton" on CUDA, else "torch" (the reference)."""
    device = torch.device(device)
    if device.type == "cpu" and dtype == torch.float32 and lora_cpu_isa() is not None:
        return "cpu_kernel"
    if device.type == "cuda":
        from deepinfer.model_executor.layers.ops.triton import triton_available

        if triton_available():
            return "triton"
    return "torch"


def _check_shapes(x, slot, A, B, scale) -> None:
    T, k = x.shape
    S, r, k_a = A.shape
    if k_a != k or B.shape[0] != S or B.shape[2] != r or scale.shape != (S,) or slot.shape != (T,):
        raise ValueError(f"lora_delta shapes disagree: x {tuple(x.shape)}, slot {tuple(slot.shape)}, "
                         f"A {tuple(A.shape)}, B {tuple(B.shape)}, scale {tuple(scale.shape)}")
