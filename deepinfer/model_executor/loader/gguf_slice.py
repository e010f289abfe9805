"""A GGUF tensor read slice by slice, for a tensor-parallel rank that holds only part of it.

`GGUFSlice` has what `ShardSpec.read` asks of a lazy tensor (`.shape`, `.narrow`, `.read`); the
bytes it decodes are those of the slice, taken from the file's mapping:

    rows      [start, start + length) of [N, K]: those rows' bytes, each row whole
    columns   [start, start + length): in every row the blocks that hold them, from the block where
              `start` falls to the one where the slice ends (at most one block more on each side),
              decoded, then cut to the columns

A slice of a llama q/k weight must hold whole heads (the file's rows are interleaved per head).
Decoded slices are what the whole tensor decodes to, cut the same way: values alike, a `QuantWeight`
when the tensor is kept quantized. Columns of a quantized weight that cut a block (32 values, 256
for K-quants) cannot stay packed: those are dequantized, with one log line.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import torch

from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref
from deepinfer.model_executor.loader.gguf_file import GGUFTensor

# (tensor, heads it holds or None) -> the decoded tensor in HF layout, or a QuantWeight
Decode = Callable[[GGUFTensor, "int | None"], "torch.Tensor | QuantWeight"]
_VALUE_TYPES = ("F32", "F16")  # their data are values [N, K]; every other type's are bytes [N, row bytes]
logger = logging.getLogger("deepinfer.loader")


class GGUFSlice:
    """One GGUF tensor, not decoded yet; `head_rows`: rows per head when slices must keep heads whole."""

    def __init__(self, tensor: GGUFTensor, decode: Decode, head_rows: int | None = None):
        self.tensor, self._decode, self._head_rows = tensor, decode, head_rows
        self.shape = torch.Size(tensor.shape)

    def read(self) -> torch.Tensor | QuantWeight:
        return self._decode(self.tensor, None)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor | QuantWeight:
        if len(self.shape) == 1:  # norms and biases: small, read whole
            return self.read().narrow(0, start, length)
        if dim == 0:
            return self._rows(start, length)
        return self._columns(start, length)

    def _rows(self, start: int, length: int) -> torch.Tensor | QuantWeight:
        heads = None
        if self._head_rows:
            if start % self._head_rows or length % self._head_rows:
                raise ValueError(f"GGUF tensor {self.tensor.name!r}: rows [{start}, {start + length}) cut its "
                                 f"heads of {self._head_rows} rows")
            heads = length // self._head_rows
        data = self.tensor.data[start:start + length]  # [length, row bytes or K]
        return self._decode(self._part(data, (length, *self.shape[1:])), heads)

    def _columns(self, start: int, length: int) -> torch.Tensor | QuantWeight:
        n, end = self.shape[0], start + length
        if self.tensor.tensor_type.name in _VALUE_TYPES:
            return self._decode(self._part(self.tensor.data[:, start:end], (n, length)), None)
        from gguf import GGML_QUANT_SIZES

        block, block_bytes = GGML_QUANT_SIZES[self.tensor.tensor_type]
        first, last = start // block, -(-end // block)  # the blocks that hold the columns
        data = self.tensor.data[:, first * block_bytes:last * block_bytes]  # [N, bytes of those blocks]
        decoded = self._decode(self._part(data, (n, (last - first) * block)), None)
        return _cut_columns(decoded, start - first * block, length, self.tensor.name)

    def _part(self, data: np.ndarray, shape: tuple[int, ...]) -> GGUFTensor:
        return dataclasses.replace(self.tensor, shape=shape, data=np.ascontiguousarray(data))


def _cut_columns(w: torch.Tensor | QuantWeight, start: int, length: int, name: str) -> torch.Tensor | QuantWeight:
    """Columns [start, start + length) of a decoded block range; a QuantWeight whose blocks they cut
    is dequantized first."""
    if isinstance(w, QuantWeight) and (start % w.block or length % w.block):
        if w.kind not in _CUT_LOGGED:
            _CUT_LOGGED.add(w.kind)
            logger.warning("a rank's columns of %s tensor %s cut its blocks of %d: dequantized", w.kind, name, w.block)
        w = dequantize_ref(w)  # [N, columns of the blocks] fp32
    return w.narrow(1, start, length)


_CUT_LOGGED: set[str] = set()
