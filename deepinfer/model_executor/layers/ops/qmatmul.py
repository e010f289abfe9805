"""Quantized weights and their matmul: `QuantWeight` keeps a matrix in ggml's own blocks, byte for
byte as a GGUF file stores them, and `qmatmul(x, w)` multiplies it with the integer kernels
(`qdot.py`: activations quantized to int8 per 32 values, integer dot products per block) on the
CPU, with the Triton kernels that decode the blocks in-kernel on CUDA (`ops/triton/gguf_matmul.py`:
every type here, fp16/bf16/fp32 activations), or dequantizes it for torch's F.linear elsewhere
(`matmul_route` says which).

    data  uint8 [N, row_bytes]   row n: the K / block ggml blocks of weight row n, in order
    kind  the ggml type name     block (values, bytes) in BLOCKS

`data` may be a view of a GGUF file's read-only mapping (loader/gguf_file.py): its pages refuse
writes, so nothing writes into a QuantWeight's data; every method here that changes a layout
(columns, padding, gathered rows) returns a new tensor. Row starts need no alignment: the kernels
load bytes unaligned, a tensor starts on GGUF's 32-byte alignment and a row on any byte.

Batch-1 decode reads every weight once per token, so the bytes held are what bounds its speed:
they are the file's tensor bytes, nothing is widened. Sources: a GGUF file's matrices of the types
in BLOCKS (`loader/gguf_repack.py`), and an fp checkpoint quantized at load (`quantize_weight`:
`int8` -> Q8_0, `int4` -> Q4_1, as llama.cpp's reference quantizer writes them).

`dequantize_ref` decodes every type in plain torch (any device; `qdot.py`'s decoders), with ggml's
formulas:

    Q4_0  d | 16 B nibbles                      d (q - 8)             q 0..15
    Q4_1  d m | 16 B nibbles                    d q + m               q 0..15
    Q5_0  d | 4 B high bits | 16 B nibbles      d (q - 16)            q 0..31
    Q5_1  d m | 4 B high bits | 16 B nibbles    d q + m               q 0..31
    Q8_0  d | 32 int8                           d q
    Q4_K  d dmin | 12 B 6-bit sc, mn | 128 B    d sc_j q - dmin mn_j  per 32 values, q 0..15
    Q5_K  d dmin | 12 B sc, mn | 32 B hi | 128  d sc_j q - dmin mn_j  per 32 values, q 0..31
    Q6_K  128 B low 4 | 64 B high 2 | 16 sc | d d sc_j (q - 32)       per 16 values, q 0..63
    Q2_K  16 sc|mn | 64 B 2-bit | d dmin        d sc_j q - dmin mn_j  per 16 values, q 0..3
    Q3_K  32 B high 1 | 64 B low 2 | 12 sc | d  d (sc_j - 32) (q - 4) per 16 values, q 0..7
    IQ4_NL d | 16 B nibbles                     d kv[q]               kv: 16 int8 values
    IQ4_XS d | 2 B sc high | 4 B sc low | 128   d (sc_j - 32) kv[q]   per 32 values, sc 6 bits
    IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (grids of 4 or 8 values and their signs),
    TQ1_0, TQ2_0 (ternary): 256-value blocks, see iq_blocks.py

(d, m, dmin: fp16. Q4_0..Q5_1: byte j's low nibble is value j, its high nibble value 16 + j; a
high-bit word's bit j belongs to value j. Q4_K/Q5_K: per 32 bytes of nibbles, the low nibbles are
sub-block 2c, the high ones 2c + 1.)
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.ops import qdot

# ggml type -> (values per block, bytes per block)
BLOCKS = {name: (kind.block_values, kind.block_bytes) for name, kind in qdot.KINDS.items()}
QUANTIZE_SCHEMES = {"int8": "Q8_0", "int4": "Q4_1"}  # quantization at load -> the ggml type written


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight kept in ggml blocks: `data` holds each row's blocks exactly as a GGUF file does."""

    data: torch.Tensor  # uint8 [N, row_bytes]
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in BLOCKS:
            raise ValueError(f"QuantWeight: no block layout for ggml type {self.kind!r}; have {', '.join(BLOCKS)}")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or not self.data.is_contiguous():
            raise ValueError(f"QuantWeight {self.kind}: data must be a contiguous 2-D uint8 tensor, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")
        if self.data.shape[1] % self.block_bytes:
            raise ValueError(f"QuantWeight {self.kind}: {self.data.shape[1]} bytes per row is not a whole "
                             f"number of {self.block_bytes}-byte blocks")

    @property
    def block(self) -> int:
        """Values per block: columns are cut only at multiples of it."""
        return BLOCKS[self.kind][0]

    @property
    def block_bytes(self) -> int:
        return BLOCKS[self.kind][1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1] // self.block_bytes * self.block

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index) -> QuantWeight:
        """The weight rows `index` (a slice: a view; or ids for an embedding lookup: a copy), still packed."""
        return QuantWeight(self.data[index].contiguous(), self.kind)

    @staticmethod
    def stacked(weights: Sequence[QuantWeight]) -> QuantWeight:
        """Weights of one type stacked on the output axis (rows concatenated, bytes unchanged): a view
        when each one's rows follow the previous one's in one storage (a GGUF file's neighbouring
        tensors, e.g. ffn_gate then ffn_up), else a copy."""
        first = weights[0]
        if any(w.kind != first.kind or w.data.shape[1] != first.data.shape[1] for w in weights):
            raise ValueError(f"QuantWeight.stacked: parts differ in type or row bytes: "
                             f"{[(w.kind, tuple(w.data.shape)) for w in weights]}")
        rows = sum(w.data.shape[0] for w in weights)
        if _adjacent([w.data for w in weights]):
            return QuantWeight(first.data.as_strided((rows, first.data.shape[1]), first.data.stride()), first.kind)
        if first.data.device.type == "cpu":  # numpy's copy: one thread, no wait for torch's pool
            return QuantWeight(torch.from_numpy(np.concatenate([w.data.numpy() for w in weights])), first.kind)
        return QuantWeight(torch.cat([w.data for w in weights]), first.kind)  # [rows, row_bytes]

    def narrow(self, dim: int, start: int, length: int) -> QuantWeight:
        """Rows (dim 0) or columns (dim 1) [start, start + length), still packed; columns only on block
        boundaries (ValueError otherwise: a block's scales cover all of its values)."""
        if dim == 0:
            return self.rows(slice(start, start + length))
        if start % self.block or length % self.block:
            raise ValueError(f"QuantWeight {self.kind}: columns [{start}, {start + length}) cut its blocks "
                             f"of {self.block} values")
        first, count = start // self.block * self.block_bytes, length // self.block * self.block_bytes
        return QuantWeight(self.data[:, first:first + count].contiguous(), self.kind)

    def padded_rows(self, rows: int) -> QuantWeight:
        """`rows` rows: these, then zero rows (an all-zero block decodes to 0 in every type)."""
        extra = rows - self.shape[0]
        if extra <= 0:
            return self
        return QuantWeight(torch.cat([self.data, self.data.new_zeros(extra, self.data.shape[1])]), self.kind)


def _adjacent(parts: Sequence[torch.Tensor]) -> bool:
    """Whether contiguous tensors lie back to back, in order, in one storage."""
    storage = parts[0].untyped_storage().data_ptr()
    for before, after in zip(parts[:-1], parts[1:], strict=True):
        if (after.untyped_storage().data_ptr() != storage
                or after.storage_offset() != before.storage_offset() + before.numel()):
            return False
    return True


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as a dense [N, K] tensor of `dtype`, on the weight's device."""
    return dequantize_ref(w).to(dtype)


def dequantize_ref(w: QuantWeight) -> torch.Tensor:
    """Plain torch, ggml's formulas (the kernels' decoding, `qdot.dequantize_ref`): fp32 [N, K], the
    same values as `gguf.quants.dequantize`."""
    return qdot.dequantize_ref(w)


def qmatmul(x: torch.Tensor, w: QuantWeight | Sequence[QuantWeight], levels: int = qdot.ACT_LEVELS) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype. `w` may be the parts of a merged weight stacked on
    the output axis (each its own type): on the CPU the activations are quantized once for all of
    them, in `levels` levels (qdot.py); elsewhere each part is multiplied as `matmul_route` says
    (`levels` is the CPU's: the Triton kernels and F.linear take x as it is)."""
    parts = (w,) if isinstance(w, QuantWeight) else tuple(w)
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if x.device.type == "cpu":
        y = _integer_matmul(x2.float(), parts, levels)  # [M, N] fp32
    else:
        y = device_matmul(x2, parts)  # [M, N]
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def matmul_route(device: torch.device, kind: str, dtype: torch.dtype) -> str:
    """How `qmatmul` multiplies a weight of ggml type `kind` by `dtype` activations on `device`:
    "integer" on the CPU (qdot.py); "triton" on CUDA for the types and dtypes the Triton kernels take
    (ops/triton/gguf_matmul.py, where triton imports); else "dequantize" (dequantize_ref, F.linear)."""
    if device.type == "cpu":
        return "integer"
    kernels = _triton_gguf() if device.type == "cuda" else None
    if kernels is not None and kind in kernels.COVERED and dtype in kernels.DTYPES:
        return "triton"
    return "dequantize"


@functools.cache
def _triton_gguf():
    """The module ops/triton/gguf_matmul.py, or None where triton is missing (imported on first use)."""
    from deepinfer.model_executor.layers.ops.triton import triton_available

    if not triton_available():
        return None
    from deepinfer.model_executor.layers.ops.triton import gguf_matmul

    return gguf_matmul


def device_matmul(x: torch.Tensor, parts: Sequence[QuantWeight]) -> torch.Tensor:
    """x [M, K] (off the CPU) times each part the way `matmul_route` names, outputs side by side:
    [M, N] in x's dtype."""
    ys = [_DEVICE_MATMULS[matmul_route(x.device, p.kind, x.dtype)](x, p) for p in parts]  # [M, N_i] each
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


def _triton_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return _triton_gguf().gguf_matmul(x, w)  # [M, N]: the blocks decoded in-kernel


def _dequantize_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return F.linear(x, dequantize(w, x.dtype))  # [M, N]: the whole weight widened first


_DEVICE_MATMULS = {"triton": _triton_matmul, "dequantize": _dequantize_matmul}


def _integer_matmul(x: torch.Tensor, parts: tuple[QuantWeight, ...], levels: int) -> torch.Tensor:
    """fp32 x [M, K] times each part through the integer kernels, one activation quantization."""
    if len(parts) == 1:
        return qdot.qlinear(x, parts[0], levels=levels)  # [M, N]
    acts = qdot.quantize_acts(x, levels=levels)
    return torch.cat([qdot.qdot(acts, p) for p in parts], dim=-1)  # [M, N]


def qdot_variant() -> str:
    """The integer kernels' variant (instruction set) this process multiplies with."""
    return qdot.qdot_isa()


def qmatmul_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The reference: dequantize in plain torch, then F.linear (fp32)."""
    return F.linear(x.float(), dequantize_ref(w))  # [..., N]


def quantize_weight(weight: torch.Tensor, scheme: str) -> QuantWeight:
    """An fp weight [N, K] quantized at load: "int8" -> Q8_0 (d = absmax / 127 per 32 values), "int4"
    -> Q4_1 (d = (max - min) / 15, m = min per 32), by gguf's port of llama.cpp's reference quantizer.
    K must be a multiple of 32."""
    from gguf import GGMLQuantizationType, quants

    if scheme not in QUANTIZE_SCHEMES:
        raise ValueError(f"quantization scheme must be 'int8' or 'int4', got {scheme!r}")
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"cannot quantize a weight with K={k} in blocks of 32")
    kind = QUANTIZE_SCHEMES[scheme]
    values = weight.detach().float().cpu().numpy()  # [N, K]
    data = quants.quantize(values, GGMLQuantizationType[kind])  # uint8 [N, row_bytes]
    return QuantWeight(torch.from_numpy(data).to(weight.device).contiguous(), kind)


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
