"""MXFP4 weights: E2M1 values (4 bits, two per byte) with one UE8M0 scale byte per 32 values.

The layout of GPT-OSS checkpoints (`*_blocks`, `*_scales`), for a matrix W [N, K] (one row per
output feature; K a multiple of 32; stacks of experts add leading dims):

    blocks  uint8 [N, K/32, 16]   byte j of block b: value 32b + 2j in its low nibble,
                                  value 32b + 2j + 1 in its high nibble
    scales  uint8 [N, K/32]       s: the block's values are multiplied by 2^(s - 127)

    code (4 bits)  0    1    2    3    4    5    6    7    8 .. 15
    E2M1 value     0   0.5   1   1.5   2    3    4    6    the same, negative (bit 3 = sign)

so W[n, 32b + i] = E2M1[nibble i of block b] * 2^(s - 127): exact in fp32 for every byte but 255
(NaN in the OCP MX format; never written by `quantize_mxfp4`). `dequantize_mxfp4` is the torch
reference and gives what transformers' MXFP4 integration dequantizes (its layout transposed: HF's
expert parameters are [E, K, N]).

`mxfp4_matmul(x, blocks, scales)` is y = x @ W^T in fp32 without dequantizing W: the C++ kernel
(`mxfp4_cpu.cpp`: AVX-512, AVX2 + FMA or portable C++, the same bits, one fixed order of fp32
operations per output whatever the batch) on the CPU, the reference elsewhere.
`ops/triton/mxfp4.py` runs the same weights as a grouped expert GEMM on the GPU.

`quantize_mxfp4` makes such weights from floats: per block the scale 2^e with
e = ceil(log2(max|w| / 6)) (the smallest power of two that keeps every value within E2M1's 6),
values rounded to the nearest E2M1 value, ties to the even code.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa

BLOCK = 32  # values per scale byte
BLOCK_BYTES = BLOCK // 2  # packed bytes per block
SCALE_BIAS = 127
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
ISA_NAMES = {0: "plain", 1: "avx2", 2: "avx512"}  # the kernel's variants (`isa=` of mxfp4_matmul)
# midpoints between consecutive E2M1 magnitudes: rounding to the nearest value
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "weight") -> tuple[int, int]:
    """(N, K) of packed weights blocks [..., N, K/32, 16] and scales [..., N, K/32] (ValueError naming
    `name` and the shapes when they do not fit)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK_BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks must be [..., N, K/32, {BLOCK_BYTES}] and scales [..., N, K/32]; "
                         f"got {tuple(blocks.shape)} and {tuple(scales.shape)}")
    return blocks.shape[-3], blocks.shape[-2] * BLOCK


def mxfp4_nbytes(blocks: torch.Tensor, scales: torch.Tensor) -> int:
    """Bytes the packed weights take: 17 per 32 values."""
    return blocks.numel() * blocks.element_size() + scales.numel() * scales.element_size()


# ---- the torch reference ------------------------------------------------------------------


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., N, K/32, 16], scales [..., N, K/32] -> W [..., N, K] in `dtype` (computed in fp32)."""
    n, k = check_mxfp4(blocks, scales)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)  # [16]
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., N, K/32, 16, 2]
    values = table[codes].flatten(-2)  # [..., N, K/32, 32]: value 2j then 2j + 1
    exponents = scales.to(torch.int32) - SCALE_BIAS  # [..., N, K/32]
    weights = torch.ldexp(values, exponents.unsqueeze(-1))  # [..., N, K/32, 32], exact
    return weights.flatten(-2).to(dtype)  # [..., N, K]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., N, K] (K a multiple of 32) -> (blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32])."""
    if w.dim() < 2 or w.shape[-1] % BLOCK:
        raise ValueError(f"quantize_mxfp4: the last dim must be a multiple of {BLOCK}, got shape {tuple(w.shape)}")
    wb = w.float().unflatten(-1, (-1, BLOCK))  # [..., N, K/32, 32]
    amax = wb.abs().amax(-1)  # [..., N, K/32]
    e = torch.ceil(torch.log2(amax / E2M1_MAX))  # -inf for an all-zero block
    e = e.nan_to_num(-SCALE_BIAS, neginf=-SCALE_BIAS, posinf=SCALE_BIAS).clamp(-SCALE_BIAS, SCALE_BIAS)  # [.., N, K/32]
    scaled = (wb / torch.exp2(e).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)  # [..., N, K/32, 32]
    codes = _nearest_codes(scaled)  # [..., N, K/32, 32] uint8
    pairs = codes.unflatten(-1, (BLOCK_BYTES, 2))  # [..., N, K/32, 16, 2]
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)  # [..., N, K/32, 16]
    return blocks.contiguous(), (e.to(torch.int32) + SCALE_BIAS).to(torch.uint8)


def _nearest_codes(v: torch.Tensor) -> torch.Tensor:
    """Values within [-6, 6] -> the E2M1 codes of their nearest values (ties to the even code), uint8."""
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=v.device)
    mag = v.abs().contiguous()
    lower = torch.bucketize(mag, mids, right=False)  # a midpoint itself counts to the lower value
    upper = torch.bucketize(mag, mids, right=True)  # ... and here to the upper one
    code = torch.where(lower % 2 == 0, lower, upper)  # they differ only on a tie
    sign = ((v < 0) & (code > 0)).to(torch.int64) << 3
    return (code | sign).to(torch.uint8)


def mxfp4_matmul_ref(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T -> fp32 [M, N]: dequantize, then one fp32 matmul."""
    return x.float() @ dequantize_mxfp4(blocks, scales).T  # [M, N]


# ---- the kernel ---------------------------------------------------------------------------


def mxfp4_isa() -> str | None:
    """The kernel variant this process uses ("avx512", "avx2"), or None: the torch reference (no
    kernel library, DEEPINFER_CPU_ISA=plain/none, or a CPU without AVX2)."""
    level = kernel_isa()
    return ISA_NAMES[level] if level else None


def mxfp4_isas() -> tuple[str, ...]:
    """The kernel variants this CPU and build run ("plain" always, with the library)."""
    if not kernel_isa():
        return ()
    mask = int(torch.ops.deepinfer_cpu.mxfp4_cpu_isas())
    return tuple(name for level, name in ISA_NAMES.items() if mask >> level & 1)


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, *,
                 isa: str | None = None) -> torch.Tensor:
    """x [..., K] @ W^T -> fp32 [..., N] for W in MXFP4 (blocks [N, K/32, 16], scales [N, K/32]): the
    C++ kernel for CPU tensors when the library runs here (`isa` picks a variant, default this
    process's), else the torch reference."""
    n, k = check_mxfp4(blocks, scales)
    if blocks.dim() != 3:
        raise ValueError(f"mxfp4_matmul: one matrix at a time; blocks have shape {tuple(blocks.shape)}")
    if x.shape[-1] != k:
        raise ValueError(f"mxfp4_matmul: x has K={x.shape[-1]}, the weight K={k}")
    isa = isa or mxfp4_isa()
    x2 = x.reshape(-1, k)  # [M, K]
    if isa is None or not (x.is_cpu and blocks.is_cpu):
        y = mxfp4_matmul_ref(x2, blocks, scales)  # [M, N]
    else:
        if isa not in mxfp4_isas():
            raise ValueError(f"mxfp4_matmul: isa must be one of {mxfp4_isas()} on this CPU, got {isa!r}")
        level = {name: level for level, name in ISA_NAMES.items()}[isa]
        y = torch.ops.deepinfer_cpu.mxfp4_matmul.default(x2.float(), blocks.reshape(n, k // 2),
                                                       scales, level)  # [M, N]
    return y.reshape(*x.shape[:-1], n)
