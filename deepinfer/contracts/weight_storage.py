"""How a checkpoint stores a layer's parameters: the kinds a layer declares, and the bytes each takes.

A layer class that holds weights declares `param_storage = {parameter name: kind}`; a parameter it
does not name is CHECKPOINT, except the `weight` of a linear layer (nn.Linear and its subclasses),
which is LINEAR. The checkpoint's config (`CheckpointFormats`) turns a kind into a stored format:

    kind          stored as                                                  bytes of [..., R, C]
    CHECKPOINT    the checkpoint dtype (torch_dtype); an integer tensor, its own dtype
    FP32          fp32 whatever torch_dtype says (mHC mixers, sinks, position and routing biases)
    LINEAR        a matmul weight [R, C]: "fp8" when quant_method is fp8, else the dtype
    EXPERTS       routed-expert stacks [E, R, C]: expert_dtype ("fp4" / "fp8"), else as LINEAR
    MXFP4_BLOCKS  MXFP4 values as the module holds them packed (2 values per byte)
    MXFP4_SCALES  their UE8M0 scales (values of their own: none)

    fp8   R*C e4m3 bytes + ceil(R/128) * ceil(C/128) block scales of `scale_bytes` (1 UE8M0, 4 fp32)
    fp4   R*C/2 e2m1 bytes + R * ceil(C/32) UE8M0 scale bytes
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CHECKPOINT, FP32, LINEAR, EXPERTS = "checkpoint", "fp32", "linear", "experts"
MXFP4_BLOCKS, MXFP4_SCALES = "mxfp4 blocks", "mxfp4 scales"
FP4_GROUP, FP8_BLOCK = 32, 128
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
               "uint8": 1, "bool": 1}


@dataclass(frozen=True)
class CheckpointFormats:
    """The stored format of each kind in one checkpoint."""

    dtype: str = "bf16"  # a key of DTYPE_BYTES
    linear: str = ""  # "fp8", or "" (the dtype)
    experts: str = ""  # "fp4" / "fp8", or "" (as linear)
    scale_bytes: int = 1  # of one fp8 block scale

    def format_of(self, kind: str) -> str:
        """The stored format of a floating parameter of `kind`."""
        if kind == EXPERTS:
            return self.experts or self.linear or self.dtype
        if kind == LINEAR:
            return self.linear or self.dtype
        return {FP32: "fp32", MXFP4_BLOCKS: MXFP4_BLOCKS, MXFP4_SCALES: MXFP4_SCALES}.get(kind, self.dtype)

    def values_and_bytes(self, fmt: str, shape: tuple[int, ...], row_pieces: tuple[int, ...] = ()) -> tuple[int, int]:
        """(values, stored bytes) of a tensor of `shape` in `fmt`: matrices [..., R, C] for fp8 / fp4, stored
        as separate matrices of `row_pieces` rows each (merged q|k|v, gate|up) when given."""
        numel = math.prod(shape)
        if fmt in (MXFP4_BLOCKS, MXFP4_SCALES):
            return (2 * numel if fmt == MXFP4_BLOCKS else 0), numel
        if fmt not in ("fp8", "fp4"):
            return numel, numel * DTYPE_BYTES[fmt]
        rows, cols = (1, 1, *shape)[-2:]
        copies = numel // (rows * cols) if rows * cols else 0
        if fmt == "fp4":
            return numel, copies * (rows * cols // 2 + rows * math.ceil(cols / FP4_GROUP))
        row_blocks = sum(math.ceil(r / FP8_BLOCK) for r in row_pieces or (rows,))
        scales = row_blocks * math.ceil(cols / FP8_BLOCK) * self.scale_bytes
        return numel, copies * (rows * cols + scales)
