"""One layer's cache rows: the row codec (one token's state <-> one row of bytes) and the layer's
view of its group's allocation (load and store at flat slots).

The worker's cache engine (worker/cache_engine.py) allocates the groups and hands each layer a
`LayerCache`; the attention backends, the kernels (ops/fused.py, ops/triton/) and the models read
rows through it. A kernel reads its public fields: `rows2d` [lines, row], `rows_per_unit`,
`lines_per_unit`, `layer_offset` and `codec` (`fp8`, `int8`, `num_kv_heads`, `num_elements`, `shared_kv`).
Quantized rows (MXFP8, q8) are bytes: `rows2d` is uint8 and a load dequantizes them.
"""

from __future__ import annotations

import torch

from deepinfer.contracts.cache import RowSpec
from deepinfer.model_executor.layers.ops.addressing import cache_line
from deepinfer.model_executor.layers.ops.cache_common import (
    KVCacheFormat,
    mxfp8_format,
    q8_format,
    unquantized_format,
)
from deepinfer.model_executor.layers.ops.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from deepinfer.model_executor.layers.ops.q8 import dequantize_q8, quantize_q8

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class RowCodec:
    """One layer's cached state of one token <-> one row of bytes.

    Separate K and V (Llama family): the row is K|V of all KV heads, 2 * H_kv * D elements.
    Shared K = V (a latent row, as DeepSeek-V4 stores one 512-element row per token): the row is
    H_kv * D elements and serves as both K and V; a 512-element MXFP8 row is 528 bytes.
    int8 rows (ops/q8.py: an fp32 scale per 32 int8 values, 144 bytes per 128-value head) hold
    separate K and V only, with head sizes that are multiples of 32.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str,
                 shared_kv: bool = False):
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.row_dtype = torch.bfloat16 if kv_cache_dtype == "bfloat16" else dtype  # plain rows' element type
        self.shared_kv = shared_kv
        self.num_parts = 1 if shared_kv else 2
        self.num_elements = self.num_parts * num_kv_heads * head_dim
        self.fp8, self.int8 = kv_cache_dtype == "fp8", kv_cache_dtype == "int8"
        self.quantized = self.fp8 or self.int8  # rows of bytes, dequantized on load
        if self.int8 and (shared_kv or head_dim % 32):
            raise ValueError("kv_cache_dtype='int8' rows hold separate K and V heads of a multiple of 32 values, "
                             f"got {'a shared K = V row' if shared_kv else f'head_dim={head_dim}'}")
        what = "K=V latent row" if shared_kv else "K|V row"
        self.format: KVCacheFormat = (
            mxfp8_format(self.num_elements, f"MXFP8 {what}") if self.fp8 else
            q8_format(self.num_elements, f"q8 {what}") if self.int8 else
            unquantized_format(self.num_elements, _DTYPE_NAMES[self.row_dtype], what))

    @classmethod
    def for_row(cls, row: RowSpec, dtype: torch.dtype, kv_cache_dtype: str) -> RowCodec:
        """The codec of a declared row; a width the format cannot hold is refused naming row.field."""
        try:
            return cls(row.num_kv_heads, row.head_dim, dtype, kv_cache_dtype, shared_kv=row.shared_kv)
        except ValueError as exc:
            raise ValueError(f"{row.field}={row.head_dim} cannot be cached in this row format: {exc}") from exc

    @property
    def row_bytes(self) -> int:
        return self.format.bytes_per_row

    def encode(self, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        """k, v [T, H_kv, D] -> rows [T, row_bytes] uint8 (v is not stored when K = V)."""
        flat = k.flatten(1) if self.shared_kv else torch.cat((k.flatten(1), v.flatten(1)), dim=1)  # [T, E]
        if self.fp8:
            return quantize_mxfp8(flat)  # [T, row_bytes]
        if self.int8:
            return quantize_q8(flat)  # [T, row_bytes]
        return flat.to(self.row_dtype).contiguous().view(torch.uint8)  # [T, row_bytes]

    def as_kv(self, flat: torch.Tensor) -> torch.Tensor:
        """[..., E] -> [..., 2, H_kv, D]; a shared row is the same memory seen as K and as V."""
        kv = flat.unflatten(-1, (self.num_parts, self.num_kv_heads, self.head_dim))  # [..., 1|2, H_kv, D]
        return kv.expand(*kv.shape[:-3], 2, -1, -1) if self.shared_kv else kv

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., row_bytes] uint8 -> [..., 2, H_kv, D] in the compute dtype."""
        if self.fp8:
            return self.as_kv(dequantize_mxfp8(rows, self.num_elements, self.dtype))  # [..., 2, H_kv, D]
        if self.int8:
            return self.as_kv(dequantize_q8(rows, self.dtype))  # [..., 2, H_kv, D]
        return self.as_kv(rows.contiguous().view(self.row_dtype).to(self.dtype))  # [..., 2, H_kv, D]


class LayerCache:
    """One layer's view of its group: load rows at flat slots, store rows at flat slots.

    `view` is the book's (units, rows_per_unit, 1, row_bytes) view. Reads and writes go through
    the same memory seen as one row per line, `rows2d` [units * layers * R, row], where the
    row of flat slot u * R + r of layer l is line u * layers * R + l * R + r: one index_select
    (a memcpy per row) instead of a two-index gather.
    """

    def __init__(self, view: torch.Tensor, rows2d: torch.Tensor, index_in_group: int, codec: RowCodec):
        self.view = view  # (units, rows_per_unit, 1, row_bytes) uint8
        self.rows2d = rows2d  # [units * layers * R, row] uint8, or the compute dtype for plain rows
        self.codec = codec
        self.rows_per_unit = view.shape[1]
        self.lines_per_unit = rows2d.shape[0] // view.shape[0]
        self.layer_offset = index_in_group * self.rows_per_unit

    def _lines(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat slots [...] -> lines of `rows2d` [...]."""
        return cache_line(slots, self.rows_per_unit, self.lines_per_unit, self.layer_offset)

    def load(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [...] (-1 reads some row: the caller masks it) -> [..., 2, H_kv, D]."""
        lines = self._lines(slots.clamp(min=0))
        rows = self.rows2d.index_select(0, lines.flatten()).view(*slots.shape, self.rows2d.shape[1])  # [..., row]
        return self.codec.decode(rows) if self.codec.quantized else self.codec.as_kv(rows)  # [..., 2, H_kv, D]

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Write rows for k, v [T, H_kv, D] (v None: a shared K = V row) at distinct flat slots [T]:
        the torch reference of the kernel sets' `store_rows` hook (layers/kernel_set.py)."""
        rows = self.codec.encode(k, v)  # [T, row_bytes] uint8
        if not self.codec.quantized:
            rows = rows.view(self.rows2d.dtype)  # [T, row]
        self.rows2d.index_copy_(0, self._lines(slots), rows)
