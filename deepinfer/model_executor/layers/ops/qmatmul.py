"""Quantized weights and their matmul: `QuantWeight` (the one packed layout every source format is
repacked into) and `qmatmul(x, w)`, which runs the CPU kernel (`qmatmul_cpu.cpp`) or, without one,
the plain-torch reference that computes the same function (dequantize, then F.linear).

    bits 4   q uint8 [N, K/2]  per group of 32: low nibbles hold values 0..15, high nibbles 16..31
    bits 8   q int8  [N, K]    groups of 16 or 32
    scale, minv  [N, K/G]      w = q * scale + minv; both fp32, or both fp16 where fp16 holds
                               every one exactly (`compact_scales`: GGUF's d and m are fp16)

Sources (`loader/gguf_repack.py`, `quantize_weight` here): GGUF Q4_0, Q4_1, Q4_K -> 4 bits;
Q8_0, Q5_0, Q5_1, Q5_K -> 8 bits in groups of 32; Q6_K (16-value sub-blocks) -> 8 bits in groups
of 16; an fp checkpoint quantized at load -> int8 (symmetric) or int4 (asymmetric), groups of 32.
Every repacking is exact: scales and mins are the products GGUF's own dequantization forms, in fp32,
or in fp16 when that loses nothing (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): 2 bytes fewer per 32 weights
each, which batch-1 decode, bound by reading the weights, turns into time.

From DENSE_MIN_ROWS (128) rows on (prefill chunks) the weight is dequantized once and torch's GEMM
multiplies, faster there than re-widening each group per row tile; whether that GEMM runs in bf16
(2x fp32's speed with AVX-512 BF16) is measured once per process.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa

GROUP_SIZES = {4: (32,), 8: (16, 32)}


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight kept quantized; `kind` names the source format (e.g. "Q4_1", "int8")."""

    q: torch.Tensor  # uint8 [N, K/2] (4 bits) or int8 [N, K] (8 bits)
    scale: torch.Tensor  # fp32 or fp16 [N, K/G]
    minv: torch.Tensor  # the same dtype as scale [N, K/G]
    bits: int
    group: int
    kind: str

    def __post_init__(self) -> None:
        if self.group not in GROUP_SIZES.get(self.bits, ()):
            raise ValueError(f"QuantWeight: bits={self.bits} group={self.group} is not a packed layout; "
                             f"have {GROUP_SIZES}")
        n, k = self.shape
        if self.scale.shape != (n, k // self.group) or self.minv.shape != self.scale.shape:
            raise ValueError(f"QuantWeight {self.kind}: scale {tuple(self.scale.shape)} / minv "
                             f"{tuple(self.minv.shape)} do not match [{n}, {k // self.group}]")
        if self.scale.dtype != self.minv.dtype or self.scale.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"QuantWeight {self.kind}: scale and minv must both be float32 or both float16, "
                             f"got {self.scale.dtype} and {self.minv.dtype}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.minv))

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The weight rows `index` (an embedding lookup), still packed."""
        return QuantWeight(self.q[index], self.scale[index], self.minv[index], self.bits, self.group, self.kind)

    def narrow(self, dim: int, start: int, length: int) -> QuantWeight:
        """Rows (dim 0) or columns (dim 1) [start, start + length), still packed; columns only on
        group boundaries (ValueError otherwise: a group's scale cannot be cut)."""
        if dim == 0:
            return self.rows(slice(start, start + length))
        if start % self.group or length % self.group:
            raise ValueError(f"QuantWeight {self.kind}: columns [{start}, {start + length}) cut its groups "
                             f"of {self.group}")
        per_byte = 2 if self.bits == 4 else 1
        groups = slice(start // self.group, (start + length) // self.group)
        parts = (self.q[:, start // per_byte:(start + length) // per_byte], self.scale[:, groups], self.minv[:, groups])
        return QuantWeight(*(t.contiguous() for t in parts), self.bits, self.group, self.kind)

    def padded_rows(self, rows: int) -> QuantWeight:
        """`rows` rows: these, then rows whose values are all zero (q, scale and min 0)."""
        extra = rows - self.shape[0]
        if extra <= 0:
            return self
        pad = [torch.cat([t, t.new_zeros(extra, t.shape[1])]) for t in (self.q, self.scale, self.minv)]
        return QuantWeight(*pad, self.bits, self.group, self.kind)


def compact_scales(scale: torch.Tensor, minv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scale, minv -> fp16 if fp16 holds every value exactly, else unchanged."""
    half = scale.half(), minv.half()
    if torch.equal(half[0].float(), scale) and torch.equal(half[1].float(), minv):
        return half
    return scale, minv


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as a dense [N, K] tensor of `dtype` (kernel when available, else torch)."""
    isa = kernel_isa()
    if isa and w.q.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        bf16 = dtype == torch.bfloat16
        return torch.ops.deepinfer_cpu.qdequant.default(w.q, w.scale, w.minv, w.bits, w.group, isa, bf16)  # [N, K]
    return dequantize_ref(w).to(dtype)


def dequantize_ref(w: QuantWeight) -> torch.Tensor:
    """Plain torch: the same values as the kernel's, fp32 [N, K]."""
    n, k = w.shape
    if w.bits == 4:
        packed = w.q.view(n, k // 32, 16)  # [N, groups, 16]
        values = torch.cat([packed & 0xF, packed >> 4], dim=-1)  # [N, groups, 32]
    else:
        values = w.q.view(n, k // w.group, w.group)  # [N, groups, G]
    out = values.float() * w.scale.float()[..., None] + w.minv.float()[..., None]  # [N, groups, G]
    return out.reshape(n, k)


def qmatmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, W never materialized for a few rows."""
    isa = kernel_isa()
    if isa and x.dim() == 2 and x.dtype is torch.float32 and x.shape[0] < dense_path().min_rows \
            and x.device.type == "cpu":  # the decode step's case, without reshapes or casts
        return torch.ops.deepinfer_cpu.qmatmul.default(x, w.q, w.scale, w.minv, w.bits, w.group, isa)  # [M, N]
    x2 = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    if not isa or x.device.type != "cpu":
        y = F.linear(x2, dequantize(w))  # [M, N]: the plain-torch path, fp32
    elif x2.shape[0] < dense_path().min_rows:
        y = torch.ops.deepinfer_cpu.qmatmul.default(x2, w.q, w.scale, w.minv, w.bits, w.group, isa)  # [M, N]
    else:
        dtype = dense_path().dtype
        y = F.linear(x2.to(dtype), dequantize(w, dtype)).float()  # [M, N]
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[1])


def qmatmul_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The reference: dequantize in plain torch, then F.linear (fp32)."""
    return F.linear(x.float(), dequantize_ref(w))  # [..., N]


@dataclass(frozen=True)
class DensePath:
    """Where many rows go: from `min_rows` rows on, dequantize the weight and multiply with torch's
    GEMM in `dtype` (bf16 only where it is clearly faster than fp32, e.g. AVX-512 BF16 or AMX)."""

    min_rows: int
    dtype: torch.dtype


# From this many rows (prefill chunks) the dense path runs; a decode batch of up to 64 requests
# stays on the kernel. Measured end to end (cpu32, AMD EPYC): the kernel for 32-row decode steps
# gave 152 tok/s, dequantizing every weight for them 129 tok/s, although an isolated [2048, 2048]
# probe favoured the dense path from 32 rows: per-shape probes miss the whole model's traffic.
DENSE_MIN_ROWS = 128
_BF16_WIN = 0.75  # bf16 GEMM for many rows only when it takes under 75% of fp32's time
_PROBE_SHAPE = (2048, 2048)  # 2 MiB packed, 8 MiB as bf16


@functools.cache
def dense_path() -> DensePath:
    """The GEMM dtype measured once per process (~0.1 s) on a 4-bit weight of _PROBE_SHAPE and a
    256-row chunk, on one thread: the ratio carries over to more threads, and one thread is not
    stalled by a busy core."""
    if not kernel_isa():
        return DensePath(0, torch.float32)
    with torch.inference_mode(), one_thread():
        w = quantize_weight(torch.randn(*_PROBE_SHAPE), "int4")
        x = torch.randn(256, _PROBE_SHAPE[1])  # [256, k]: a prefill chunk
        fp32 = best_time(lambda: F.linear(x, dequantize(w)))
        bf16 = best_time(lambda: F.linear(x.bfloat16(), dequantize(w, torch.bfloat16)))
    return DensePath(DENSE_MIN_ROWS, torch.bfloat16 if bf16 < _BF16_WIN * fp32 else torch.float32)


@contextlib.contextmanager
def one_thread():
    """Run a timing probe on one intra-op thread, then restore the count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def best_time(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` timed calls of `fn` (after one warm-up call), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def quantize_weight(weight: torch.Tensor, scheme: str, group: int = 32) -> QuantWeight:
    """An fp weight [N, K] quantized at load: "int8" symmetric (absmax / 127 per group) or "int4"
    asymmetric (min..max over 15 steps per group). K must be a multiple of `group`."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"cannot quantize a weight with K={k} in groups of {group}")
    w = weight.detach().float().reshape(n, k // group, group)  # [N, groups, G]
    if scheme == "int8":
        scale = w.abs().amax(-1) / 127.0  # [N, groups]
        q = torch.round(w / _nonzero(scale)[..., None]).clamp_(-127, 127).to(torch.int8)  # [N, groups, G]
        return QuantWeight(q.reshape(n, k), scale, torch.zeros_like(scale), 8, group, "int8")
    if scheme == "int4":
        lo, hi = w.amin(-1), w.amax(-1)  # [N, groups]
        scale = (hi - lo) / 15.0
        q = torch.round((w - lo[..., None]) / _nonzero(scale)[..., None]).clamp_(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)  # [N, groups, 16]
        return QuantWeight(packed.reshape(n, k // 2), scale, lo.contiguous(), 4, 32, "int4")
    raise ValueError(f"quantization scheme must be 'int8' or 'int4', got {scheme!r}")


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)
