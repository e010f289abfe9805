"""The decode step's small ops as single kernel calls (`fused_cpu.cpp`, Gemma's GeGLU included), and
the batch-invariant path's attention (`invariant_cpu.cpp`), each paired with the torch function it
replaces.

A batch-1 decode step of a small model is mostly small ops: per layer two RMSNorms (eight torch
ops each), RoPE on q and k (ten), a cache store (six) and a gathered, masked SDPA over the cache.
On fp32 CPU tensors with the kernel library built (`kernel_isa() > 0`) each is one call. Anywhere
else (bf16 activations, another device, MXFP8 cache rows, `DEEPINFER_CPU_ISA=none`) the caller's
torch reference runs, which computes the same function: results differ only in float rounding.

A `FusedOp` is such a pair called as one function. The choice is made once per call class (the
dtypes and devices of its tensors, the cache's row format, the instruction set; never values):
the first call of a class picks the kernel or the reference, later calls of that class run the
pick. Callers never test for "not available".

    norm = rms_norm_op(torch_rms_norm)      # layers/norm.py
    y = norm(x, weight, eps, offset)        # [..., E]: the kernel for fp32 CPU x, else torch_rms_norm
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import torch

from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa

_FP32_CPU = (torch.float32, "cpu")
_PLAIN_ROWS = (torch.float32, torch.bfloat16)  # cache rows the kernels read and write (not MXFP8)
_Q8_ROWS = torch.uint8  # uint8 rows that are not MXFP8: q8 rows (ops/q8.py), for the store and invariant attention


class FusedOp:
    """One op: `kernel(isa, *args)` for the call classes it serves, `reference(*args)` for the others.

    `kind(*args)` names a call's class (hashable, from dtypes, devices and formats only);
    `serves(kind)` says whether the kernel computes calls of that class."""

    def __init__(self, kernel: Callable, kind: Callable[..., Hashable], serves: Callable[[Hashable], bool],
                 reference: Callable):
        self.kernel, self.kind, self.serves, self.reference = kernel, kind, serves, reference
        self._picks: dict[tuple, Callable] = {}  # (kind, isa) -> the function its calls run

    def __call__(self, *args):
        key = (self.kind(*args), kernel_isa())
        run = self._picks.get(key)
        if run is None:
            run = self._picks[key] = self.pick(*key)
        return run(*args)

    def pick(self, kind: Hashable, isa: int) -> Callable:
        """The function calls of class `kind` run under instruction set `isa` (0: none)."""
        return functools.partial(self.kernel, isa) if isa and self.serves(kind) else self.reference


def _kinds(*tensors: torch.Tensor) -> tuple:
    return tuple((t.dtype, t.device.type) for t in tensors)


def _all_fp32_cpu(kinds: tuple) -> bool:
    return all(k == _FP32_CPU for k in kinds)


def rms_norm_op(reference: Callable) -> FusedOp:
    """(x [..., E], weight [E], eps, offset=0.0) -> x / rms(x) * (offset + weight) [..., E]
    (layers/norm.py's RMSNorm)."""
    def kernel(isa, x, weight, eps, offset=0.0):
        return torch.ops.deepinfer_cpu.rms_norm(x, weight, eps, offset, isa)

    return FusedOp(kernel, lambda x, weight, eps, offset=0.0: _kinds(x, weight), _all_fp32_cpu, reference)


def rope_op(reference: Callable) -> FusedOp:
    """(q [T, H, D], k [T, H_kv, D], positions [T], cos, sin [P, D]) -> new (q, k), rotated
    (rotate-half layout, layers/rotary.py) by the tables' rows at positions; the inputs are not written."""
    def kernel(isa, q, k, positions, cos, sin):
        return torch.ops.deepinfer_cpu.rope(q, k, positions, cos, sin, isa)

    return FusedOp(kernel, lambda q, k, positions, cos, sin: _kinds(q, k, cos, sin), _all_fp32_cpu, reference)


def silu_and_mul_op(reference: Callable) -> FusedOp:
    """(x [T, 2I] = [gate | up]) -> silu(gate) * up [T, I] (layers/activation.py); 2-d x only."""
    def kernel(isa, x):
        return torch.ops.deepinfer_cpu.silu_mul(x, isa)

    return FusedOp(kernel, lambda x: (_kinds(x), x.dim()), lambda kind: _all_fp32_cpu(kind[0]) and kind[1] == 2,
                   reference)


def _rows_kind(cache, *tensors: torch.Tensor) -> tuple:
    """A cache call's class: its tensors' kinds and the cache's row format."""
    return _kinds(*tensors), bool(cache.codec.fp8), cache.rows2d.dtype


def _serves_rows(kind: tuple) -> bool:
    """fp32 CPU inputs and plain (fp32 / bf16, not MXFP8) cache rows."""
    kinds, fp8, row_dtype = kind
    return _all_fp32_cpu(kinds) and not fp8 and row_dtype in _PLAIN_ROWS


def _serves_rows_q8(kind: tuple) -> bool:
    """fp32 CPU inputs and plain or q8 (not MXFP8) cache rows."""
    kinds, fp8, row_dtype = kind
    return _all_fp32_cpu(kinds) and not fp8 and (row_dtype in _PLAIN_ROWS or row_dtype == _Q8_ROWS)


def store_rows_op(reference: Callable) -> FusedOp:
    """(cache, slots [T], k [T, H_kv, D], v [T, H_kv, D] | None) -> None: write k, v (v None: a shared
    K = V row) as the rows of flat slots in one call. `cache` is a layer cache
    (attention/layer_cache.LayerCache): `rows2d` [lines, row], `rows_per_unit`, `lines_per_unit`,
    `layer_offset` and its `codec`."""
    def kernel(isa, cache, slots, k, v):
        v = k if v is None else v  # a one-part row reads k only
        torch.ops.deepinfer_cpu.store_rows(cache.rows2d, slots, k, v, cache.rows_per_unit, cache.lines_per_unit,
                                           cache.layer_offset)

    def kind(cache, slots, k, v):
        return _rows_kind(cache, k, k if v is None else v)

    return FusedOp(kernel, kind, _serves_rows_q8, reference)


def _cap(softcap: float | None) -> float:
    """A soft-cap as the C++ kernels take it: 0 for none."""
    return 0.0 if softcap is None else float(softcap)


def _sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """Sink logits [H] as the C++ kernels take them: float32, contiguous (or None)."""
    return None if sinks is None else sinks.detach().float().contiguous()


def decode_attention_op(reference: Callable) -> FusedOp:
    """(cache, q [N, H, D], index [N, L] (-1: nothing), scale, lens, softcap, sinks) -> [N, H, D], reading
    each named row once and no padding (`lens`, a bound on each index row's named columns, is not
    needed); softcap (None: none) caps the scaled logits, s = cap * tanh(s / cap); sinks [H] (None:
    none) join each head's softmax denominator with no value."""
    def kernel(isa, cache, q, index, scale, lens=None, softcap=None, sinks=None):
        q = q if q.stride(-1) == 1 else q.contiguous()
        return torch.ops.deepinfer_cpu.decode_attn(q, cache.rows2d, index, cache.codec.num_kv_heads,
                                                   cache.rows_per_unit, cache.lines_per_unit, cache.layer_offset,
                                                   scale, isa, _cap(softcap), _sinks(sinks))

    def kind(cache, q, index, scale, lens=None, softcap=None, sinks=None):
        return _rows_kind(cache, q)

    return FusedOp(kernel, kind, _serves_rows, reference)


def gelu_tanh_and_mul_op(reference: Callable) -> FusedOp:
    """(x [T, 2I] = [gate | up]) -> gelu_tanh(gate) * up [T, I] (layers/activation.py, Gemma's GeGLU),
    every element with the same bits at any position (invariant_cpu.cpp); 2-d x only."""
    def kernel(isa, x):
        return torch.ops.deepinfer_cpu.gelu_tanh_mul(x, isa)

    return FusedOp(kernel, lambda x: (_kinds(x), x.dim()), lambda kind: _all_fp32_cpu(kind[0]) and kind[1] == 2,
                   reference)


def invariant_decode_attention_op(reference: Callable) -> FusedOp:
    """(cache, q [N, H, D], index [N, L], first [N], scale, softcap, sinks) -> [N, H, D], batch-invariant:
    column c of index row n holds absolute position first[n] + c (-1: not visible); each query
    reduces over its keys in fixed chunks of 512 and blocks of 64 at absolute offsets, the chunks'
    partials merged in chunk order (invariant_cpu.cpp), so its bits depend on its own keys alone,
    and equal those of `invariant_prefill_attention_op` for the same query. softcap and sinks as in
    `decode_attention_op`."""
    def kernel(isa, cache, q, index, first, scale, softcap=None, sinks=None):
        q = q if q.stride(-1) == 1 else q.contiguous()
        return torch.ops.deepinfer_cpu.invariant_decode_attn(q, cache.rows2d, index, first, cache.codec.num_kv_heads,
                                                             cache.rows_per_unit, cache.lines_per_unit,
                                                             cache.layer_offset, scale, isa, _cap(softcap),
                                                             _sinks(sinks))

    def kind(cache, q, index, first, scale, softcap=None, sinks=None):
        return _rows_kind(cache, q)

    return FusedOp(kernel, kind, _serves_rows_q8, reference)


def invariant_prefill_attention_op(reference: Callable) -> FusedOp:
    """(cache, q [n, H, D], k, v [n, H_kv, D], loaded [n_old, 2, H_kv, D] (as `cache.load` returns
    them), positions [n], start, window, scale) -> [n, H, D], batch-invariant: row r of [loaded |
    chunk] holds position start + r; the chunk's rows are taken as the cache stores them (q8 rows:
    quantized and read back, over the loads' dequantized fp32 rows); query p
    sees positions max(0, p - window + 1) .. p (window None: 0 .. p). The same bits per query as
    `invariant_decode_attention_op`. Decode and prefill pick from the same call class (q and the
    cache), so a query never runs one path in one step and the other path in another. softcap and
    sinks (last, optional) as in `decode_attention_op`."""
    def kernel(isa, cache, q, k, v, loaded, positions, start, window, scale, softcap=None, sinks=None):
        q = q if q.stride(-1) == 1 else q.contiguous()
        if cache.rows2d.dtype == _Q8_ROWS:  # q8 rows: the chunk as a later read returns it, over fp32 loaded rows
            k, v = torch.ops.deepinfer_cpu.q8_round(k), torch.ops.deepinfer_cpu.q8_round(v)
        return torch.ops.deepinfer_cpu.invariant_prefill_attn(q, k, v, loaded, positions, start,
                                                              -1 if window is None else window, scale, isa,
                                                              _cap(softcap), _sinks(sinks))

    def kind(cache, q, k, v, loaded, positions, start, window, scale, softcap=None, sinks=None):
        return _rows_kind(cache, q)

    return FusedOp(kernel, kind, _serves_rows_q8, reference)
