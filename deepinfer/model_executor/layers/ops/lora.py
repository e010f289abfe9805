"""The batched LoRA op: every row of a step adds the low-rank delta of its own adapter slot.

    lora_delta(x [T, in], slot [T] int64 (-1: none), A [S, r, in], B [S, out, r], scale [S]) -> [T, out]

    row t with slot s >= 0:   delta[t] = ((x[t] A[s]^T) B[s]^T) * scale[s]     shrink, then expand
    row t with slot -1:       delta[t] = 0

Rows are grouped by adapter: one shrink and one expand per slot the step uses. A slot holding an
adapter of a smaller rank has its A rows and B columns past that rank zero (they add exact zeros).
The order of operations is PEFT's (`lora_B(lora_A(x)) * scaling`). `scale` is float32 whatever the
dtype of x, A and B (alpha / r need not be exact in bf16).

`lora_delta_ref` is the torch reference; `lora_delta_cpu` (C++) and `lora_delta_triton` (CUDA) return
its result up to float rounding. Which one a call runs is a kernel set's choice (`KernelSet.lora_op`,
layers/kernel_set.py), one of the rules below by the call's device and dtype; its name is part of an
adapted row's cache identity. `lora_delta` / `lora_op_name` are the rule of any device (the CPU
kernel, else Triton on CUDA, else torch).
"""

from __future__ import annotations

from collections.abc import Callable

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
    """x [T, in], slot [T] int64 (-1: no adapter), A [S, r, in], B [S, out, r], scale [S] -> [T, out],
    through the implementation `lora_op_name` names for x's device and dtype."""
    return LORA_OPS[lora_op_name(x.device, x.dtype)](x, slot, A, B, scale)  # [T, out]


def lora_delta_by(choose: Callable[[torch.device, torch.dtype], str]) -> Callable:
    """`lora_delta` through the implementation `choose(x.device, x.dtype)` names (a kernel set's `lora_op`)."""
    def delta(x: torch.Tensor, slot: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
        return LORA_OPS[choose(x.device, x.dtype)](x, slot, A, B, scale)  # [T, out]

    return delta


def lora_cpu_op(device: torch.device, dtype: torch.dtype) -> str:
    """"cpu_kernel" for fp32 on the CPU where the kernel runs (lora_cpu.cpp: a row's bits do not depend
    on the batch or the instruction set), else "torch" (the reference)."""
    if torch.device(device).type == "cpu" and dtype == torch.float32 and lora_cpu_isa() is not None:
        return "cpu_kernel"
    return "torch"


def lora_gpu_op(device: torch.device, dtype: torch.dtype) -> str:
    """"triton" on CUDA where Triton is installed, else "torch" (the reference)."""
    if torch.device(device).type == "cuda":
        from deepinfer.model_executor.layers.ops.triton import triton_available

        if triton_available():
            return "triton"
    return "torch"


def lora_op_name(device: torch.device, dtype: torch.dtype) -> str:
    """The implementation on any device (part of the cache identity): "cpu_kernel" for fp32 on the CPU
    where the kernel runs, "triton" on CUDA, else "torch" (the reference)."""
    op = lora_cpu_op(device, dtype)
    return op if op != "torch" else lora_gpu_op(device, dtype)


def _lora_delta_triton(x, slot, A, B, scale) -> torch.Tensor:
    from deepinfer.model_executor.layers.ops.triton.lora import lora_delta_triton

    return lora_delta_triton(x, slot, A, B, scale)  # [T, out]


LORA_OPS: dict[str, Callable] = {"cpu_kernel": lora_delta_cpu, "triton": _lora_delta_triton,
                                 "torch": lora_delta_ref}


def _check_shapes(x, slot, A, B, scale) -> None:
    T, k = x.shape
    S, r, k_a = A.shape
    if k_a != k or B.shape[0] != S or B.shape[2] != r or scale.shape != (S,) or slot.shape != (T,):
        raise ValueError(f"lora_delta shapes disagree: x {tuple(x.shape)}, slot {tuple(slot.shape)}, "
                         f"A {tuple(A.shape)}, B {tuple(B.shape)}, scale {tuple(scale.shape)}")
