"""The decode step's small ops as single kernel calls (`fused_cpu.cpp`).

A batch-1 decode step of a small model is mostly small ops: per layer two RMSNorms (eight torch
ops each), RoPE on q and k (ten), a cache store (six) and a gathered, masked SDPA over the cache.
On fp32 CPU tensors with the kernel library built (`kernel_isa() > 0`) each is one call. Anywhere
else (bf16 activations, another device, `DEEPINFER_CPU_ISA=none`) these functions return None
(store_rows: False) and the caller runs its torch code, which computes the same function: results
differ only in float rounding (the order of each sum).
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa


def _isa(*tensors: torch.Tensor) -> int:
    """The kernel instruction set for these tensors, or 0 where the torch path must run."""
    for t in tensors:
        if t.dtype is not torch.float32 or t.device.type != "cpu":
            return 0
    return kernel_isa()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor | None:
    """x [..., E] -> x / rms(x) * (offset + weight) [..., E] (layers/norm.py's RMSNorm)."""
    isa = _isa(x, weight)
    return torch.ops.deepinfer_cpu.rms_norm(x, weight, eps, offset, isa) if isa else None


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, H, D], k [T, H_kv, D] rotated (rotate-half layout, layers/rotary.py) by the rows of
    the tables cos, sin [P, D] at positions [T] -> new (q, k); the inputs are not written."""
    isa = _isa(q, k, cos, sin)
    return torch.ops.deepinfer_cpu.rope(q, k, positions, cos, sin, isa) if isa else None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I] (layers/activation.py)."""
    isa = _isa(x) if x.dim() == 2 else 0
    return torch.ops.deepinfer_cpu.silu_mul(x, isa) if isa else None


def _plain_rows(cache) -> bool:
    """True when a layer cache keeps plain fp32 / bf16 rows the kernels can read and write.

    A layer cache (worker/cache_engine.LayerCache) exposes `rows2d` [lines, row], `rows_per_unit`,
    `lines_per_unit`, `layer_offset` and its `codec`."""
    return not cache.codec.fp8 and cache.rows2d.dtype in (torch.float32, torch.bfloat16)


def store_rows(cache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> bool:
    """Write k, v [T, H_kv, D] (v None: a shared K = V row) as the rows of flat slots [T] in one
    call; False: not done here (an fp8 cache, non-fp32 inputs, no kernels), the caller stores
    them its own way."""
    v = k if v is None else v  # a one-part row reads k only
    if not (_isa(k, v) and _plain_rows(cache)):
        return False
    torch.ops.deepinfer_cpu.store_rows(cache.rows2d, slots, k, v, cache.rows_per_unit, cache.lines_per_unit,
                                       cache.layer_offset)
    return True


def decode_attention(cache, q: torch.Tensor, index: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q [N, H, D] over the cached rows at index [N, L] (-1: nothing) -> [N, H, D], reading each
    named row once and no padding; None where the kernel does not apply (see store_rows)."""
    isa = _isa(q)
    if not (isa and _plain_rows(cache)):
        return None
    q = q if q.stride(-1) == 1 else q.contiguous()
    return torch.ops.deepinfer_cpu.decode_attn(q, cache.rows2d, index, cache.codec.num_kv_heads,
                                               cache.rows_per_unit, cache.lines_per_unit, cache.layer_offset,
                                               scale, isa)
