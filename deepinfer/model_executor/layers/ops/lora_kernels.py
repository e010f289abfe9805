"""Batched LoRA deltas on the CPU: the rows of one batch use different adapters (multi-LoRA serving).

    lora_delta_cpu(x [T, in], slot [T] int64, a [S, r_max, in], b [S, out, r_max], scale [S] fp32) -> [T, out]

    y[t] = scale[s] * (x[t] @ a[s]^T) @ b[s]^T    for a row with slot[t] = s >= 0 (shrink, then expand)
    y[t] = 0                                      for slot[t] = -1 (no adapter)

Adapters live in S slots of stacked matrices; an adapter of rank r < r_max fills rows 0..r-1 of its
`a[s]` and columns 0..r-1 of its `b[s]`, the rest zeros. The kernel is `lora_cpu.cpp`: rows grouped
by slot, fp32 accumulation in one fixed order per row (so a row's result does not depend on the
other rows of the call, the thread count or the instruction set: AVX-512, AVX2 + FMA or portable
C++). `ops/lora.py` holds the torch reference and picks this kernel for fp32 CPU tensors;
`ops/triton/lora.py` is the GPU twin.
"""

from __future__ import annotations

import functools

import torch

from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa

ISA_NAMES = {0: "plain", 1: "avx2", 2: "avx512"}  # the kernel's variants (`isa=` of lora_delta_cpu)
_LEVELS = {name: level for level, name in ISA_NAMES.items()}


def check_lora_args(x: torch.Tensor, slot: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    scale: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(T, in, S, r_max, out) of lora_delta's arguments; ValueError naming the first that does not fit."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"lora_delta: x must be a floating [T, in] tensor, got {x.dtype} {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if slot.shape != (num_tokens,) or slot.dtype != torch.int64:
        raise ValueError(f"lora_delta: slot must be int64 [{num_tokens}], got {slot.dtype} {tuple(slot.shape)}")
    if a.dim() != 3 or a.shape[2] != hidden:
        raise ValueError(f"lora_delta: a must be [S, r_max, {hidden}], got {tuple(a.shape)}")
    num_slots, max_rank = a.shape[:2]
    if b.dim() != 3 or b.shape[0] != num_slots or b.shape[2] != max_rank:
        raise ValueError(f"lora_delta: b must be [{num_slots}, out, {max_rank}], got {tuple(b.shape)}")
    if scale.shape != (num_slots,):
        raise ValueError(f"lora_delta: scale must be [{num_slots}], got {tuple(scale.shape)}")
    return num_tokens, hidden, num_slots, max_rank, b.shape[1]


def lora_cpu_isa() -> str | None:
    """The kernel variant this process uses ("avx512", "avx2"), or None: no kernel (no library,
    DEEPINFER_CPU_ISA=plain/none, or a CPU without AVX2); callers then use the torch reference."""
    level = kernel_isa()
    return ISA_NAMES[level] if level else None


def lora_cpu_isas() -> tuple[str, ...]:
    """The kernel variants this CPU and build run ("plain" always, with the library)."""
    return _variants() if kernel_isa() else ()


@functools.cache
def _variants() -> tuple[str, ...]:
    """The variants the loaded library runs on this CPU (asked once)."""
    mask = int(torch.ops.deepinfer_cpu.lora_cpu_isas())
    return tuple(name for level, name in ISA_NAMES.items() if mask >> level & 1)


def lora_delta_cpu(x: torch.Tensor, slot: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                   *, isa: str | None = None) -> torch.Tensor:
    """The deltas [T, out] in x's dtype, computed in fp32 by the C++ kernel (`isa` picks a variant,
    default this process's). CPU tensors; other float dtypes are converted to fp32 first.
    ValueError (from the kernel's checks) for bad shapes, a slot outside [-1, S) or a variant this CPU
    does not run."""
    isa = isa or lora_cpu_isa()
    if isa not in lora_cpu_isas():
        raise ValueError(f"lora_delta_cpu: isa must be one of {lora_cpu_isas()} on this CPU, got {isa!r}")
    if not (x.is_cpu and slot.is_cpu and a.is_cpu and b.is_cpu and scale.is_cpu):
        raise ValueError("lora_delta_cpu: every tensor must be on the CPU")
    y = torch.ops.deepinfer_cpu.lora_delta.default(_fp32(x, "x"), slot, _fp32(a, "a"), _fp32(b, "b"),
                                                   _fp32(scale, "scale"), _LEVELS[isa])  # [T, out] fp32
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _fp32(t: torch.Tensor, name: str) -> torch.Tensor:
    """`t` as float32 (itself when it is); ValueError for a tensor that is not floating."""
    if t.dtype == torch.float32:
        return t
    if not t.is_floating_point():
        raise ValueError(f"lora_delta_cpu: {name} must be a floating tensor, got {t.dtype}")
    return t.float()
