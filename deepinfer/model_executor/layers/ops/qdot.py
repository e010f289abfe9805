"""Integer dot products over GGUF blocks as stored in the file: y[M, N] = x[M, K] @ W[N, K]^T.

The activations are quantized per row in blocks of 32 (`quantize_acts`):

    d = max|x| / 127 (fp32), set to 0 below 2^-126 (no subnormal scale, 1/d stays finite)
    q = round_half_even(x * (1 / d)) clamped to [-127, 127]  (d == 0: q = 0)
    sums = sum of q per 16 values (int32)

in one or two levels (`levels`; `ACT_LEVELS` by default): x's own quantization, then that of its
residual r = x - q * d (fp32, the product rounded before the difference); with two, a row's result
is the sum of the two levels' products, level 1 + level 2, one fp32 add. One level (llama.cpp's Q8
activations) keeps about 8 bits of each value, two about 15. The second level doubles the integer
work: decode, which reads each weight once per token, hardly notices; prefill chunks, bound by the
integer work, take up to twice as long. Which layers take which is the caller's choice
(`quant_linear.activation_levels`: two where the rounding shows in the tokens, one elsewhere).

The weight `w` is read, never converted: `w.data` uint8 [N, row_bytes] holds each row's ggml
blocks (bytes as in the GGUF file), `w.kind` the ggml type name and `w.shape` (N, K). Every weight
block is split into units (sub-blocks) of U values, so that each unit's value is
w = A * (code - offset) + B: an unsigned code, a kind's constant offset (Q4_0 8, Q5_0 16, Q3_K 4,
Q6_K 32, else 0; Q8_0's codes are signed bytes, IQ4_NL's and IQ4_XS's 4-bit codes index the signed
values IQ4_VALUES, the grid i-quants' and ternary kinds' values are signed bytes read by iq_blocks.py),
a scale A and, for Q4_1, Q5_1, Q2_K, Q4_K and Q5_K, a min B (A = d * sc, B = -dmin * m for the
K-quants; both exact in fp32). U = 16 for Q2_K, Q3_K, Q6_K, IQ2_XS, IQ2_S and IQ1_M, 32 for every
other kind.

Per output (m, n) the units are combined in ascending order, each in fp32, in exactly this order:

    i  = sum over the unit of (code - offset) * q       exact (int32)
    c  = (A * d_act) * float(i)                         d_act: the activation block's scale
    c  = c + (B * d_act) * float(s)                     only kinds with a min; s: the unit's sum of q
    acc = acc + c                                       acc starts at +0.0

Every multiply and add is a separately rounded fp32 operation (no fused multiply-add), so the
result of a row is the same bits whatever M, the row's position, the thread count or the
instruction set: `qdot_cpu.cpp` runs these steps with lanes across outputs, and `qdot_ref` here
runs them in plain torch (the integer sums in float64, exact as every partial sum is an integer
below 2^53).

`qdot_isa()` names the kernel variant this process uses: "avx512_vnni", "avx_vnni", "avx2",
"plain" (portable C++, the same integers) or "none" (no kernel library: the torch reference).
`DEEPINFER_CPU_ISA` caps it (see cpu_kernels.py); calls of at most eight activation rows (decode,
verification) run the variant `few_rows.py` measured fastest on this CPU, the same bits. The
functions below take `isa=` to run another variant (tests, benchmarks).

A layer calls `qlinear(x, w)` (one kernel call: quantize, then dot); weights stacked on the output
axis share one `quantize_acts(x)` and take a `qdot(acts, part)` each. A layer that calls once per
step checks its parts once per load instead, in the kernels' tile layout where one exists
(kernel_weights.py). The result depends only on the row, the weight and the kind, never on how many
rows come together, so decode, verification and prefill of the same token give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from deepinfer.model_executor.layers.ops import iq_blocks
from deepinfer.model_executor.layers.ops.cpu_kernels import qdot_level, qdot_levels
from deepinfer.model_executor.layers.ops.few_rows import FEW_ROWS, few_row_level

ACT_BLOCK = 32  # activation values per scale d
ACT_LEVELS = 2  # quantization levels of the activations (x, then its residual)
SUM_BLOCK = 16  # activation values per sum
MIN_SCALE = 2.0**-126  # smaller activation scales are stored as 0 (the block quantizes to zeros)
ISA_NAMES = {0: "none", 1: "plain", 2: "avx2", 3: "avx_vnni", 4: "avx512_vnni"}


class Kind(NamedTuple):
    """One ggml block type: its ggml type id (the kernel's `kind`), values and bytes per block,
    values per unit (one scale), the code offset, and whether units have a min."""

    ggml_id: int
    block_values: int
    block_bytes: int
    unit: int
    offset: int
    has_min: bool


KINDS = {
    "Q4_0": Kind(2, 32, 18, 32, 8, False),
    "Q4_1": Kind(3, 32, 20, 32, 0, True),
    "Q5_0": Kind(6, 32, 22, 32, 16, False),
    "Q5_1": Kind(7, 32, 24, 32, 0, True),
    "Q8_0": Kind(8, 32, 34, 32, 0, False),
    "Q4_K": Kind(12, 256, 144, 32, 0, True),
    "Q5_K": Kind(13, 256, 176, 32, 0, True),
    "Q6_K": Kind(14, 256, 210, 16, 32, False),
    "Q2_K": Kind(10, 256, 84, 16, 0, True),
    "Q3_K": Kind(11, 256, 110, 16, 4, False),
    "IQ4_NL": Kind(20, 32, 18, 32, 0, False),
    "IQ4_XS": Kind(23, 256, 136, 32, 0, False),
    "IQ2_XXS": Kind(16, 256, 66, 32, 0, False),
    "IQ2_XS": Kind(17, 256, 74, 16, 0, False),
    "IQ2_S": Kind(22, 256, 82, 16, 0, False),
    "IQ3_XXS": Kind(18, 256, 98, 32, 0, False),
    "IQ3_S": Kind(21, 256, 110, 32, 0, False),
    "IQ1_S": Kind(19, 256, 50, 32, 0, False),
    "IQ1_M": Kind(29, 256, 56, 16, 0, False),
    "TQ1_0": Kind(34, 256, 54, 32, 0, False),
    "TQ2_0": Kind(35, 256, 66, 32, 0, False),
}
# The 4-bit non-linear kinds' 16 values (ggml's kvalues_iq4nl): a code is an index into them.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
GRID_KINDS = frozenset(iq_blocks.DECODERS)  # the grid i-quants and ternary kinds (iq_blocks.py)
_GRID_IDS = frozenset(KINDS[name].ggml_id for name in GRID_KINDS)
SIGNED = {"Q8_0", "IQ4_NL", "IQ4_XS", *GRID_KINDS}  # kinds whose values are signed bytes (no offset)
ALIASES = {"int8": "Q8_0", "int4": "Q4_1"}  # weights quantized at load arrive as these blocks


class BlockWeight(Protocol):
    """What qdot reads of a weight (`QuantWeight` has these)."""

    data: torch.Tensor  # uint8 [N, row_bytes]
    kind: str

    @property
    def shape(self) -> tuple[int, int]: ...


@dataclass(frozen=True)
class QuantActs:
    """Activations quantized per row in blocks of 32 (see the module docstring)."""

    q: torch.Tensor  # int8 [levels * M, K]: level 1's rows, then level 2's
    d: torch.Tensor  # fp32 [levels * M, K/32]
    sums: torch.Tensor  # int32 [levels * M, K/16]
    levels: int = 1

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0] // self.levels, self.q.shape[1]


def check_levels(levels: int) -> None:
    if levels not in (1, 2):
        raise ValueError(f"qdot: activation levels must be 1 or 2, got {levels!r}")


def kind_of(w: BlockWeight) -> Kind:
    """The `Kind` of w (ValueError for a type without a kernel)."""
    name = ALIASES.get(w.kind, w.kind)
    if name not in KINDS:
        raise ValueError(f"qdot: no integer kernel for weight kind {w.kind!r}; have {', '.join(KINDS)}")
    return KINDS[name]


def check_weight(w: BlockWeight) -> Kind:
    """The weight's Kind after checking its bytes match its shape."""
    kind = kind_of(w)
    n, k = w.shape
    if k % kind.block_values:
        raise ValueError(f"qdot: K={k} is not a multiple of {w.kind}'s {kind.block_values}-value blocks")
    expected = (n, k // kind.block_values * kind.block_bytes)
    if w.data.dtype != torch.uint8 or tuple(w.data.shape) != expected:
        raise ValueError(f"qdot: {w.kind} weight of shape {(n, k)} needs uint8 data {expected}, got "
                         f"{w.data.dtype} {tuple(w.data.shape)}")
    return kind


# ---- choosing the kernel ------------------------------------------------------------------


def qdot_isa() -> str:
    """The kernel variant this process uses (decided once; DEEPINFER_CPU_ISA caps it)."""
    return ISA_NAMES[qdot_level()]


def _resolve(isa: str | None, rows: int | None = None) -> int:
    """The kernel level for `isa` (None: this process's choice; for a call of at most FEW_ROWS
    activation `rows`, the few-row variant `few_rows.py` measured)."""
    if isa is None:
        level = qdot_level()
        return few_row_level(level) if rows is not None and rows <= FEW_ROWS and level >= 2 else level
    levels = {v: k for k, v in ISA_NAMES.items()}
    if isa not in levels:
        raise ValueError(f"qdot: isa must be one of {', '.join(levels)}; got {isa!r}")
    if levels[isa] and levels[isa] not in qdot_levels():
        raise ValueError(f"qdot: this CPU (or build) cannot run {isa!r}")
    return levels[isa]


# ---- the API ------------------------------------------------------------------------------


def quantize_acts(x: torch.Tensor, *, isa: str | None = None, levels: int = ACT_LEVELS) -> QuantActs:
    """x fp32 [M, K] (K a multiple of 32) -> QuantActs; the kernel when there is one."""
    check_levels(levels)
    level = _resolve(isa)
    if level and x.device.type == "cpu":
        q, d, sums = torch.ops.deepinfer_cpu.quantize_acts.default(x.float(), level, levels)
        return QuantActs(q, d, sums, levels)
    return quantize_acts_ref(x, levels)


def qdot(acts: QuantActs, w: BlockWeight, *, isa: str | None = None) -> torch.Tensor:
    """acts [M, K] times w [N, K]^T -> fp32 [M, N]; the kernel when there is one."""
    kind = check_weight(w)
    if acts.q.shape[1] != w.shape[1]:
        raise ValueError(f"qdot: activations have K={acts.q.shape[1]}, the weight K={w.shape[1]}")
    level = _resolve(isa, acts.q.shape[0])
    if level and w.data.device.type == "cpu":
        if kind.ggml_id in _GRID_IDS:
            iq_blocks.hand_over_tables()
        return torch.ops.deepinfer_cpu.qdot.default(acts.q, acts.d, acts.sums, w.data, kind.ggml_id, w.shape[1],
                                                    level, acts.levels)  # [M, N]: level 1 + level 2
    return qdot_ref(acts, w)


def _sum_levels(y: torch.Tensor, levels: int) -> torch.Tensor:
    """[levels * M, N] -> [M, N]: level 1 + level 2 (one fp32 add per output)."""
    if levels == 1:
        return y
    m = y.shape[0] // levels
    return y[:m] + y[m:]


def qlinear(x: torch.Tensor, w: BlockWeight, *, isa: str | None = None, levels: int = ACT_LEVELS) -> torch.Tensor:
    """x fp32 [..., K] @ W^T -> fp32 [..., N]: quantize the activations in `levels` levels, then the
    integer dot (one kernel call, the same bits as quantize_acts then qdot)."""
    kind = check_weight(w)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"qlinear: x has K={x.shape[-1]}, the weight K={k}")
    check_levels(levels)
    flat = x.dim() == 2  # the layers' case: no reshapes (a microsecond each, per layer and step)
    x2 = x if flat else x.reshape(-1, k)  # [M, K]
    level = _resolve(isa, x2.shape[0] * levels)
    if level and x.is_cpu and w.data.is_cpu:
        x2 = x2 if x2.dtype is torch.float32 else x2.float()
        if kind.ggml_id in _GRID_IDS:
            iq_blocks.hand_over_tables()
        y = torch.ops.deepinfer_cpu.qlinear.default(x2, w.data, kind.ggml_id, k, level, levels)  # [M, N]
    else:
        y = qdot_ref(quantize_acts_ref(x2.float(), levels), w)
    return y if flat else y.reshape(*x.shape[:-1], n)


# ---- the torch reference ------------------------------------------------------------------


def quantize_acts_ref(x: torch.Tensor, levels: int = ACT_LEVELS) -> QuantActs:
    """Plain torch, the same bits as the kernel."""
    one = _quantize_level_ref(x)
    if levels == 1:
        return one
    m, k = x.shape
    residual = x.float() - (one.q.float().reshape(m, -1, ACT_BLOCK) * one.d[..., None]).reshape(m, k)  # [M, K]
    two = _quantize_level_ref(residual)
    return QuantActs(*(torch.cat([a, b]) for a, b in ((one.q, two.q), (one.d, two.d), (one.sums, two.sums))), 2)


def _quantize_level_ref(x: torch.Tensor) -> QuantActs:
    """One level: x fp32 [M, K] -> q, d, sums."""
    m, k = x.shape
    if k % ACT_BLOCK:
        raise ValueError(f"quantize_acts: K={k} is not a multiple of {ACT_BLOCK}")
    xb = x.float().reshape(m, k // ACT_BLOCK, ACT_BLOCK)  # [M, K/32, 32]
    amax = xb.abs().amax(-1)  # [M, K/32]
    d = amax / torch.full_like(amax, 127.0)  # a true division, as the kernel's
    d = torch.where(d < MIN_SCALE, torch.zeros_like(d), d)
    inv = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / torch.where(d == 0, torch.ones_like(d), d))
    q = torch.round(xb * inv[..., None]).clamp_(-127, 127).to(torch.int8).reshape(m, k)  # [M, K], half to even
    sums = q.reshape(m, k // SUM_BLOCK, SUM_BLOCK).sum(-1, dtype=torch.int32)  # [M, K/16]
    return QuantActs(q, d, sums)


def weight_codes_ref(w: BlockWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(values, A, B): values = code - offset, int16 [N, K]; the unit scales A and mins B fp32
    [N, K/U] (B None for kinds without a min), read from the blocks in plain torch."""
    kind = check_weight(w)
    n, k = w.shape
    blocks = w.data.reshape(n, k // kind.block_values, kind.block_bytes)  # [N, nb, bytes]
    decode = _DECODERS[ALIASES.get(w.kind, w.kind)]
    codes, a, b = decode(blocks)  # codes [N, nb, values], a/b [N, nb, units]
    values = codes.to(torch.int16).reshape(n, k) - kind.offset  # [N, K]
    return values, a.reshape(n, -1), None if b is None else b.reshape(n, -1)


def dequantize_ref(w: BlockWeight) -> torch.Tensor:
    """The weight as fp32 [N, K] (w = A * value + B per unit)."""
    kind = kind_of(w)
    values, a, b = weight_codes_ref(w)
    n, k = values.shape
    out = values.reshape(n, -1, kind.unit).float() * a[..., None]  # [N, K/U, U]
    if b is not None:
        out = out + b[..., None]
    return out.reshape(n, k)


def qdot_ref(acts: QuantActs, w: BlockWeight) -> torch.Tensor:
    """Plain torch: the kernel's integers (exact) and floats (the same order) -> fp32 [M, N]."""
    kind = check_weight(w)
    values, a, b = weight_codes_ref(w)  # [N, K], [N, K/U]
    m, k = acts.q.shape
    n, u = values.shape[0], kind.unit
    vq = values.reshape(n, k // u, u).double().permute(1, 2, 0)  # [S, U, N]
    aq = acts.q.reshape(m, k // u, u).double().permute(1, 0, 2)  # [S, M, U]
    unit_sums = (acts.sums if u == SUM_BLOCK else acts.sums.reshape(m, -1, 2).sum(-1)).float().T  # [S, M]
    d_act = acts.d.repeat_interleave(ACT_BLOCK // u, dim=1).T  # [S, M]: each unit's activation scale
    acc = torch.zeros(m, n)  # [M, N]
    step = max(1, (1 << 22) // max(1, m * n))  # units per batch: ~32 MB of float64 sums
    for s0 in range(0, k // u, step):
        units = slice(s0, s0 + step)
        isum = torch.bmm(aq[units], vq[units]).float()  # [s, M, N]: exact integers
        c = (a.T[units, None, :] * d_act[units, :, None]) * isum  # [s, M, N]
        if b is not None:
            c = c + (b.T[units, None, :] * d_act[units, :, None]) * unit_sums[units, :, None]
        for term in c:  # in ascending order, one fp32 add each
            acc = acc + term
    return _sum_levels(acc, acts.levels)  # [M, N]


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block, as fp32 [N, nb]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., L] -> codes [..., 2L]: the low nibbles, then the high nibbles."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Little-endian bit planes: bytes [..., count/8] -> bit j at [..., j] (0 or 1)."""
    shifts = iq_blocks.shifts(1, 8, torch.uint8, qh.device)
    return ((qh[..., :, None] >> shifts) & 1).reshape(*qh.shape[:-1], count)


def _q4_0(blocks):
    return _nibbles(blocks[..., 2:18]), _f16(blocks, 0)[..., None], None


def _q4_1(blocks):
    return _nibbles(blocks[..., 4:20]), _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]


def _q5_0(blocks):
    return _nibbles(blocks[..., 6:22]) | (_bits(blocks[..., 2:6], 32) << 4), _f16(blocks, 0)[..., None], None


def _q5_1(blocks):
    codes = _nibbles(blocks[..., 8:24]) | (_bits(blocks[..., 4:8], 32) << 4)
    return codes, _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]


def _q8_0(blocks):
    return blocks[..., 2:34].view(torch.int8), _f16(blocks, 0)[..., None], None


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 8 six-bit scales and mins packed in bytes 4..15 -> A, B fp32 [N, nb, 8]."""
    s = blocks[..., 4:16].to(torch.int32)  # [N, nb, 12]
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=-1)  # [N, nb, 8]
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return _f16(blocks, 0)[..., None] * sc.float(), -(_f16(blocks, 2)[..., None] * mn.float())


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K qs [N, nb, 128]: 32 bytes per pair of units, low nibbles first -> codes [N, nb, 256]."""
    return _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 256)


def _q4_k(blocks):
    return (_k_nibbles(blocks[..., 16:144]), *_k_scales(blocks))


def _q5_k(blocks):
    qh = blocks[..., 16:48]  # [N, nb, 32]: bit u of byte l is the high bit of value 32u + l
    high = (qh[..., None, :] >> iq_blocks.shifts(1, 8, torch.uint8, qh.device)[:, None]) & 1  # [N, nb, 8, 32]
    return (_k_nibbles(blocks[..., 48:176]) | (high.reshape(*qh.shape[:-1], 256) << 4), *_k_scales(blocks))


def _q6_k(blocks):
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 64)  # per half of 128 values
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=-1)  # [N, nb, 2, 128]
    high = (qh >> iq_blocks.shifts(2, 4, torch.uint8, qh.device)[:, None]) & 3  # [N, nb, 2, 4, 32]
    codes = (low | (high.reshape(*lead, 2, 128) << 4)).reshape(*lead, 256)
    scales = blocks[..., 192:208].view(torch.int8).float()  # [N, nb, 16]
    return codes, _f16(blocks, 208)[..., None] * scales, None


def _two_bit_planes(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K qs [N, nb, 64]: per half of 128 values 32 bytes, whose bits 2j..2j+1 hold values
    32j .. 32j + 31 of the half -> codes 0..3 [N, nb, 256]."""
    lead = qs.shape[:-1]
    planes = qs.reshape(*lead, 2, 1, 32) >> iq_blocks.shifts(2, 4, torch.uint8, qs.device)[:, None]  # [.., 2, 4, 32]
    return (planes & 3).reshape(*lead, 256)


def _q2_k(blocks):
    sc = blocks[..., 0:16]  # [N, nb, 16]: low nibble the unit's scale, high nibble its min
    d, dmin = _f16(blocks, 80)[..., None], _f16(blocks, 82)[..., None]
    return _two_bit_planes(blocks[..., 16:80]), d * (sc & 0xF).float(), -(dmin * (sc >> 4).float())


def _q3_k(blocks):
    lead = blocks.shape[:-1]
    hmask = blocks[..., 0:32]  # bit b of byte l: the high bit of value 32b + l
    high = (hmask[..., None, :] >> iq_blocks.shifts(1, 8, torch.uint8, hmask.device)[:, None]) & 1  # [N, nb, 8, 32]
    codes = _two_bit_planes(blocks[..., 32:96]) | (high.reshape(*lead, 256) << 2)
    s = blocks[..., 96:108]  # 16 six-bit scales: low nibbles in bytes 0..7, high pairs in 8..11
    low = torch.cat([s[..., 0:8] & 0xF, s[..., 0:8] >> 4], dim=-1)  # [N, nb, 16]
    pairs = (s[..., None, 8:12] >> iq_blocks.shifts(2, 4, torch.uint8, s.device)[:, None]) & 3  # [N, nb, 4, 4]
    scales = (low | (pairs.reshape(*lead, 16) << 4)).float() - 32.0
    return codes, _f16(blocks, 108)[..., None] * scales, None


def _iq4_lookup(nibbles: torch.Tensor) -> torch.Tensor:
    return iq_blocks.constant(IQ4_VALUES, torch.int16, nibbles.device)[nibbles.long()]


def _iq4_nl(blocks):
    return _iq4_lookup(_nibbles(blocks[..., 2:18])), _f16(blocks, 0)[..., None], None


def _iq4_xs(blocks):
    lead = blocks.shape[:-1]
    high = blocks[..., 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [N, nb, 1]
    high = (high >> iq_blocks.shifts(2, 8, torch.int32, high.device)) & 3  # [N, nb, 8]
    sl = blocks[..., 4:8].to(torch.int32)  # [N, nb, 4]: sub-blocks 2i (low nibble) and 2i + 1
    low = torch.stack([sl & 0xF, sl >> 4], dim=-1).reshape(*lead, 8)
    scales = (low | (high << 4)).float() - 32.0
    codes = _nibbles(blocks[..., 8:136].reshape(*lead, 8, 16)).reshape(*lead, 256)
    return _iq4_lookup(codes), _f16(blocks, 0)[..., None] * scales, None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q2_K": _q2_k, "Q3_K": _q3_k,
             "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, **iq_blocks.DECODERS}
