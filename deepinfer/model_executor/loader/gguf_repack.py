"""Which GGUF matrices stay quantized: a 2-D tensor of a type the integer kernels multiply becomes a
`QuantWeight` (layers/ops/qmatmul.py) of its own rows of blocks, unchanged: a view of the file's
read-only mapping (loader/gguf_file.py), so a matrix costs no memory beyond the file's pages in the
page cache. Only a layout the kernels cannot read in place is copied (llama's q/k rows put back in
HF order, a tensor-parallel rank's columns, a padded vocabulary).

    type   values / bytes per block   block                                  the kernel decodes
    Q4_0   32 / 18                    d | 16 B nibbles                       d (q - 8)
    Q4_1   32 / 20                    d m | 16 B nibbles                     d q + m
    Q5_0   32 / 22                    d | 4 B high bits | 16 B nibbles       d (q - 16)
    Q5_1   32 / 24                    d m | 4 B high bits | 16 B nibbles     d q + m
    Q8_0   32 / 34                    d | 32 int8                            d q
    Q4_K   256 / 144                  d dmin | 12 B 6-bit sc, mn | 128 B     d sc_j q - dmin mn_j, j per 32
    Q5_K   256 / 176                  d dmin | 12 B sc, mn | 32 B hi | 128   d sc_j q - dmin mn_j, j per 32
    Q6_K   256 / 210                  128 B low 4 | 64 B high 2 | 16 sc | d  d sc_j (q - 32), j per 16
    Q2_K   256 / 84                   16 sc|mn | 64 B 2-bit | d dmin         d sc_j q - dmin mn_j, j per 16
    Q3_K   256 / 110                  32 B high 1 | 64 B low 2 | 12 sc | d   d (sc_j - 32) (q - 4), j per 16
    IQ4_NL 32 / 18                    d | 16 B nibbles                       d kv[q] (kv: 16 int8 values)
    IQ4_XS 256 / 136                  d | 2 B sc high | 4 B sc low | 128 B   d (sc_j - 32) kv[q], j per 32
    IQ2_XXS 66, IQ2_XS 74, IQ2_S 82, IQ3_XXS 98, IQ3_S 110, IQ1_S 50, IQ1_M 56, TQ1_0 54, TQ2_0 66 bytes
           per 256 values: grid rows and signs, or ternary digits (layers/ops/iq_blocks.py)

(d, m, dmin: fp16; q the block's unsigned integer code; sc_j, mn_j the sub-block's 6- or 8-bit
scale and min.) Any other type returns None: the caller dequantizes it and logs the type once.
"""

from __future__ import annotations

import numpy as np

from deepinfer.model_executor.layers.ops.qmatmul import BLOCKS, QuantWeight
from deepinfer.model_executor.loader.gguf_file import as_tensor

PACKED_TYPES = tuple(BLOCKS)


def packed_gguf(kind: str, data: np.ndarray, shape: tuple[int, ...]) -> QuantWeight | None:
    """The 2-D tensor `shape` [N, K] stored as GGUF blocks `data` (uint8): a view of `data`'s memory
    (the file's mapping when `data` is a view of it); None if `kind` (the ggml type name) stays
    dequantized."""
    if not is_packed(kind, shape):
        return None
    rows = as_tensor(np.asarray(data, dtype=np.uint8).reshape(shape[0], -1))  # [N, row bytes], not copied
    return QuantWeight(rows, kind)


def is_packed(kind: str, shape: tuple[int, ...]) -> bool:
    """Whether a GGUF tensor of type `kind` and torch shape `shape` is kept in its blocks."""
    return kind in BLOCKS and len(shape) == 2
