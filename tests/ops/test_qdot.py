"""The integer dot-product kernels (qdot_cpu.cpp) over GGUF blocks: activation quantization and
qdot bit for bit against their plain-torch references, for every block type and every kernel
variant this CPU runs; exact against the gguf package's dequantize where every product and sum is
exact in fp32; within fp32 rounding of a float64 matmul otherwise; and the same bits for a row
whatever the batch, its position in it and the thread count."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf_blocks import half_fields, put_scale

from deepinfer.model_executor.layers.ops import cpu_kernels
from deepinfer.model_executor.layers.ops import qdot as qd
from deepinfer.model_executor.layers.ops.block_encode import ENCODED_KINDS, encode_blocks
from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa, qdot_level, qdot_levels

VARIANTS = [qd.ISA_NAMES[level] for level in qdot_levels()]  # every variant this CPU runs
KINDS = list(qd.KINDS)
GGUF_QUANTIZES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}  # the gguf package quantizes these
ENCODES = set(ENCODED_KINDS)  # block_encode.py does these
# Shapes covering N in {1, 3, 17, 67}, M in {1, 2, 3, 4, 5, 8, 33, 130} (up to 4 rows: the fused
# path; more: panels of 8 and 4, 2, 1), three K each.
SHAPES = [(1, 1, 0), (2, 3, 1), (3, 67, 2), (4, 17, 0), (5, 17, 2), (8, 67, 0), (33, 17, 1), (130, 3, 2)]
K_CHOICES = {256: (256, 512, 768), 32: (32, 96, 160)}


class Blocks:
    """A weight as qdot reads it: ggml blocks `data` uint8 [N, row_bytes], `kind`, `shape`."""

    def __init__(self, data: np.ndarray, kind: str, k: int):
        self.data = torch.from_numpy(np.ascontiguousarray(data))
        self.kind, self.shape = kind, (data.shape[0], k)

    def dequantized(self) -> torch.Tensor:
        """The gguf package's dequantization, float64 [N, K]."""
        values = quants.dequantize(self.data.numpy(), GGMLQuantizationType[self.kind])
        return torch.from_numpy(values.reshape(self.shape)).double()


def random_blocks(kind: str, n: int, k: int, seed: int) -> Blocks:
    """Random bytes (every code and 6-bit scale, Q8_0's -128 too) with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    spec = qd.KINDS[kind]
    data = rng.integers(0, 256, (n, k // spec.block_values * spec.block_bytes), dtype=np.uint8)
    blocks = data.reshape(n, -1, spec.block_bytes)
    for at in half_fields(kind):
        put_scale(blocks, kind, at, (rng.random((n, blocks.shape[1], 1)) - 0.3) * 0.02)
    return Blocks(data, kind, k)


def quantized_blocks(kind: str, n: int, k: int, seed: int) -> Blocks:
    """A random normal weight quantized by the gguf package or block_encode.py (random blocks where
    neither can)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    if kind in GGUF_QUANTIZES:
        return Blocks(quants.quantize(w, GGMLQuantizationType[kind]), kind, k)
    if kind in ENCODES:
        return Blocks(encode_blocks(w, kind), kind, k)
    return random_blocks(kind, n, k, seed)


def exact_blocks(kind: str, n: int, k: int, seed: int) -> Blocks:
    """Blocks whose fp16 scales are powers of two (2^-6 or 2^-7) and whose sub-block scales and mins
    are at most 3: every product and partial sum of qdot is exact in fp32."""
    w = random_blocks(kind, n, k, seed)
    rng = np.random.default_rng(seed + 1)
    spec = qd.KINDS[kind]
    blocks = w.data.numpy().reshape(n, -1, spec.block_bytes)
    for at in half_fields(kind):
        sign = rng.choice([-1.0, 1.0], (n, blocks.shape[1], 1)) if at == 2 and kind in ("Q4_1", "Q5_1") else 1.0
        put_scale(blocks, kind, at, sign * 2.0 ** -rng.integers(6, 8, (n, blocks.shape[1], 1)))
    if kind in ("Q4_K", "Q5_K"):  # 6-bit scales and mins 0..3: the upper bits of all 12 bytes clear
        blocks[..., 4:16] &= np.uint8(0x03)
    if kind == "Q6_K":
        blocks[..., 192:208] = rng.integers(-3, 4, (n, blocks.shape[1], 16)).astype(np.int8).view(np.uint8)
    if kind == "Q2_K":  # 4-bit scales and mins 0..3
        blocks[..., 0:16] &= np.uint8(0x33)
    if kind == "Q3_K":  # 6-bit scales 32 + (-2..1): low nibbles 0, 1, 14 or 15 with high pairs 2, 2, 1, 1
        low = rng.choice(np.array([0, 1, 14, 15], dtype=np.uint8), (n, blocks.shape[1], 16))
        high = np.where(low < 2, 2, 1).astype(np.uint8)
        blocks[..., 96:104] = low[..., :8] | (low[..., 8:] << 4)
        blocks[..., 104:108] = sum(high[..., 4 * i:4 * i + 4] << (2 * i) for i in range(4)).astype(np.uint8)
    if kind == "IQ4_XS":  # 6-bit scales 32 + (0 or 1): high pairs all 2 (0b10), low nibbles 0 or 1
        blocks[..., 2:4] = 0xAA
        low = rng.choice(np.array([0, 1], dtype=np.uint8), (n, blocks.shape[1], 8))
        blocks[..., 4:8] = low[..., 0::2] | (low[..., 1::2] << 4)
    for start, stop, keep in _SMALL_GRID_SCALES.get(kind, ()):  # 4-bit scales 0 or 1, 3-bit ones 0 or 1
        blocks[..., start:stop] &= np.uint8(keep)
    if kind == "IQ1_M":
        words = blocks[..., 48:56].copy().view(np.uint16)
        words &= np.uint16(0xF249)  # each 3-bit scale 0 or 1, d kept
        blocks[..., 48:56] = words.view(np.uint8)
    return w


# The grid kinds' sub-block scale bytes (start, stop, mask): masks that leave each scale 0 or 1.
_SMALL_GRID_SCALES = {
    "IQ2_XXS": [(2 + 8 * ib + 7, 2 + 8 * ib + 8, 0x1F) for ib in range(8)],  # ls: the top nibble of a word
    "IQ2_XS": [(66, 74, 0x11)],
    "IQ2_S": [(74, 82, 0x11)],
    "IQ3_XXS": [(66 + 4 * ib + 3, 66 + 4 * ib + 4, 0x1F) for ib in range(8)],
    "IQ3_S": [(106, 110, 0x11)],
    "IQ1_S": [(35 + 2 * ib, 36 + 2 * ib, 0x9F) for ib in range(8)],  # bits 12..14 of each qh word
}


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2


def exact_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Integers in [-127, 127] times 2^-3 or 2^-4 per block of 32, each block reaching +-127: the
    block scales are those powers of two and the codes those integers, exactly."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (m, k // 32, 32), generator=g).float()
    q[..., 5] = torch.where(torch.rand(m, k // 32, generator=g) < 0.5, -127.0, 127.0)
    scale = 2.0 ** -torch.randint(3, 5, (m, k // 32, 1), generator=g).float()
    return (q * scale).reshape(m, k)


def k_values(kind: str) -> tuple[int, int, int]:
    return K_CHOICES[qd.KINDS[kind].block_values]


def run_qdot(x: torch.Tensor, w: Blocks, isa: str) -> torch.Tensor:
    return qd.qdot(qd.quantize_acts(x, isa=isa), w, isa=isa)


@pytest.fixture
def threads():
    """Set torch's thread count for one test; restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# ---- activation quantization ----------------------------------------------------------------


def _awkward_activations() -> torch.Tensor:
    """Blocks of 32: random, all zero, ties at .5 (scale 1), tiny (scale below 2^-126), huge, mixed signs."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 7 * 32, generator=g) * torch.logspace(-3, 3, 6)[:, None]  # [6, 224]
    blocks = rows.reshape(6, 7, 32)
    blocks[:, 1] = 0.0
    ties = torch.arange(32).float() - 15.5  # x.5 values: round half to even
    ties[0] = 127.0  # max|x| = 127 -> d = 1, x / d = x
    blocks[:, 2] = ties
    blocks[:, 3] = torch.randn(32, generator=g) * 1e-38
    blocks[:, 4] = torch.randn(32, generator=g) * 3e37
    blocks[:, 5] = -blocks[:, 5].abs()
    blocks[0, 6] = 0.0
    blocks[0, 6, 7] = -5.0  # a single value: q = -127 there
    return rows


@pytest.mark.parametrize("isa", VARIANTS)
def test_quantize_acts_kernel_is_the_reference_bit_for_bit(isa):
    x = _awkward_activations()
    ref = qd.quantize_acts_ref(x)
    got = qd.quantize_acts(x, isa=isa)
    assert torch.equal(got.q, ref.q) and torch.equal(got.d, ref.d) and torch.equal(got.sums, ref.sums)
    for m in (1, 5, 33):  # more rows than one task, odd counts
        x = activations(m, 96, seed=m)
        ref, got = qd.quantize_acts_ref(x), qd.quantize_acts(x, isa=isa)
        assert torch.equal(got.q, ref.q) and torch.equal(got.d, ref.d) and torch.equal(got.sums, ref.sums)


def test_quantize_acts_reference_follows_its_definition():
    x = _awkward_activations()
    acts = qd.quantize_acts_ref(x, levels=1)
    q = acts.q.reshape(6, 7, 32).long()
    assert acts.q.dtype == torch.int8 and acts.d.dtype == torch.float32 and acts.sums.dtype == torch.int32
    assert q[:, 2].tolist()[0][:4] == [127, -14, -14, -12]  # -14.5 -> -14, -13.5 -> -14, -12.5 -> -12
    assert (q[:, 1] == 0).all() and (acts.d[:, 1] == 0).all()  # zeros
    assert (q[:, 3] == 0).all() and (acts.d[:, 3] == 0).all()  # scale below 2^-126: stored as zeros
    assert q[0, 6, 7] == -127 and acts.d[0, 6] == torch.tensor(5.0) / 127
    assert torch.equal(acts.d[:, 2], torch.ones(6))
    assert (q.abs().amax(-1)[:, [0, 4, 5]] == 127).all()
    assert torch.equal(acts.sums, acts.q.reshape(6, -1, 16).sum(-1, dtype=torch.int32))
    err = (acts.q.float().reshape(6, 7, 32) * acts.d[..., None] - x.reshape(6, 7, 32)).abs()
    err[:, 3] = 0  # (the tiny block: zeros)
    assert (err <= acts.d[..., None] / 2 * (1 + 1e-6)).all()  # rounded to the nearest step


def test_the_second_level_quantizes_the_first_levels_residual():
    x = activations(5, 96, seed=3)
    one, two = qd.quantize_acts_ref(x, levels=1), qd.quantize_acts_ref(x, levels=2)
    assert two.levels == 2 and two.shape == (5, 96) and torch.equal(two.q[:5], one.q)
    residual = x - (one.q.float().reshape(5, 3, 32) * one.d[..., None]).reshape(5, 96)  # [M, K]
    rest = qd.quantize_acts_ref(residual, levels=1)
    assert torch.equal(two.q[5:], rest.q) and torch.equal(two.d[5:], rest.d) and torch.equal(two.sums[5:], rest.sums)
    held = lambda a: a.q.float().reshape(-1, 3, 32) * a.d[..., None]  # noqa: E731  [rows, blocks, 32]
    err_one = (held(one) - x.reshape(5, 3, 32)).abs().max()
    err_two = (held(two)[:5] + held(two)[5:] - x.reshape(5, 3, 32)).abs().max()
    assert err_two < err_one / 100  # about 7 more bits


@pytest.mark.parametrize("m", [1, 2, 5])  # decode-sized (codes from registers) and buffered calls
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K"])
def test_two_levels_are_two_one_level_products_summed(kind, m):
    k = k_values(kind)[0]
    w = random_blocks(kind, 17, k, seed=11)
    acts = qd.quantize_acts_ref(activations(m, k, seed=12), levels=2)
    halves = [qd.QuantActs(acts.q[m * i:m * i + m], acts.d[m * i:m * i + m], acts.sums[m * i:m * i + m])
              for i in range(2)]
    expected = qd.qdot_ref(halves[0], w) + qd.qdot_ref(halves[1], w)  # [M, N]
    for isa in ("none", *VARIANTS):
        assert torch.equal(qd.qdot(acts, w, isa=isa), expected), f"{kind} {isa}"


# ---- qdot ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_qdot_kernel_is_the_reference_bit_for_bit(kind):
    for m, n, ki in SHAPES:
        k = k_values(kind)[ki]
        w = random_blocks(kind, n, k, seed=m * 100 + n)
        acts = qd.quantize_acts_ref(activations(m, k, seed=n))
        ref = qd.qdot_ref(acts, w)
        for isa in VARIANTS:
            got = qd.qdot(acts, w, isa=isa)
            assert got.shape == (m, n) and got.dtype == torch.float32
            assert torch.equal(got, ref), f"{kind} {isa} M={m} N={n} K={k}: max diff {(got - ref).abs().max()}"


@pytest.mark.parametrize("kind", KINDS)
def test_the_largest_codes_times_the_largest_activations_do_not_overflow(kind):
    """Every code at its largest (|w| = 128 for Q8_0) against +-127 in every activation: the int16
    steps of the AVX2 variant and the int32 sums hold them exactly."""
    spec = qd.KINDS[kind]
    k = k_values(kind)[0]
    w = random_blocks(kind, 5, k, seed=7)
    blocks = w.data.numpy().reshape(5, -1, spec.block_bytes)
    fields = np.zeros(spec.block_bytes, dtype=bool)
    for at in half_fields(kind):
        fields[at:at + 2] = True
    blocks[..., ~fields] = 0x80 if kind == "Q8_0" else 0xFF  # Q6_K: int8 scales -1, codes 63
    if kind == "IQ1_M":  # every field at its largest, d (in the scale words' top nibbles) kept finite
        put_scale(blocks, kind, -1, np.full((5, blocks.shape[1], 1), 0.01))
    if kind == "Q6_K":
        blocks[..., 192:208] = 0x80  # int8 scales -128
    if kind in ("IQ4_NL", "IQ4_XS"):  # code 0: the value -127
        blocks[..., spec.block_bytes - spec.block_values // 2:] = 0
    if kind == "Q3_K":  # high bits clear: every value -4
        blocks[..., 0:32] = 0
    for sign in (1.0, -1.0):
        x = torch.full((3, k), sign)
        acts = qd.quantize_acts_ref(x, levels=1)
        assert (acts.q == 127 * int(sign)).all()
        ref = qd.qdot_ref(acts, w)
        for isa in VARIANTS:
            assert torch.equal(qd.qdot(acts, w, isa=isa), ref), f"{kind} {isa} sign {sign}"


@pytest.mark.parametrize("kind", KINDS)
def test_qdot_is_exact_where_fp32_is(kind):
    """Power-of-two scales: qdot equals gguf's dequantize @ the activations' own values, in float64."""
    k = k_values(kind)[0]
    w = exact_blocks(kind, 19, k, seed=5)
    x = exact_activations(9, k, seed=6)
    acts = qd.quantize_acts_ref(x, levels=1)
    assert torch.equal(acts.q.float() * acts.d.repeat_interleave(32, 1), x)  # the activations, exactly
    exact = x.double() @ w.dequantized().T  # [M, N]
    assert exact.abs().max() > 0
    for isa in ("none", *VARIANTS):
        got = run_qdot(x, w, isa)
        assert torch.equal(got.double(), exact), f"{kind} {isa}: max diff {(got.double() - exact).abs().max()}"


@pytest.mark.parametrize("kind", KINDS)
def test_qdot_is_a_float64_matmul_within_fp32_rounding(kind):
    """Against gguf's dequantize @ the dequantized activations in float64: only the fp32 steps differ,
    each within 2^-24 of what it adds (bounded by |scale * code| + |min| per weight times |x|)."""
    for m, n, ki in SHAPES[::2]:
        k = k_values(kind)[ki]
        w = quantized_blocks(kind, n, k, seed=m + n)
        acts = qd.quantize_acts(activations(m, k, seed=m), levels=1)
        x = acts.q.double() * acts.d.double().repeat_interleave(32, 1)  # [M, K]: what the activations hold
        values, a, b = qd.weight_codes_ref(w)
        unit = qd.KINDS[kind].unit
        size = (a.double().abs().repeat_interleave(unit, 1) * values.double().abs()
                + (0 if b is None else b.double().abs().repeat_interleave(unit, 1)))  # [N, K]
        exact, scale = x @ w.dequantized().T, x.abs() @ size.T  # [M, N]
        got = qd.qdot(acts, w).double()
        bound = 4 * (k // unit) * 2.0**-24 * scale
        assert ((got - exact).abs() <= bound).all(), f"{kind} M={m} N={n} K={k}"


@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_decodes_blocks_as_gguf_does(kind):
    w = random_blocks(kind, 5, k_values(kind)[1], seed=4)
    assert torch.equal(qd.dequantize_ref(w).double(), w.dequantized())


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_has_the_same_bits_alone_anywhere_in_a_batch_and_on_any_thread_count(kind, isa, threads):
    k = k_values(kind)[2]
    w = random_blocks(kind, 67, k, seed=11)
    x = activations(33, k, seed=12)
    threads(2)
    batch = run_qdot(x, w, isa)  # [33, 67]
    for row in (0, 7, 32):
        assert torch.equal(run_qdot(x[row:row + 1], w, isa)[0], batch[row])
    flipped = run_qdot(x.flip(0), w, isa)  # every row at another position, other tiles of rows
    assert torch.equal(flipped.flip(0), batch)
    assert torch.equal(run_qdot(x[3:11], w, isa), batch[3:11])  # a verification-sized batch
    assert torch.equal(run_qdot(x[20:23], w, isa), batch[20:23])  # few rows: the fused path
    assert torch.equal(qd.qlinear(x, w, isa=isa), batch)  # the one-call path
    threads(1)
    assert torch.equal(run_qdot(x, w, isa), batch)


def test_qlinear_keeps_leading_dims_and_matches_quantize_then_qdot():
    w = random_blocks("Q4_K", 17, 256, seed=1)
    x = activations(6, 256, seed=2).reshape(2, 3, 256)
    y = qd.qlinear(x, w)
    assert y.shape == (2, 3, 17)
    assert torch.equal(y.reshape(6, 17), qd.qdot_ref(qd.quantize_acts_ref(x.reshape(6, 256)), w))


def test_aliases_and_bad_weights():
    w = random_blocks("Q8_0", 3, 64, seed=0)
    alias = Blocks(w.data.numpy(), "int8", 64)
    x = activations(2, 64, seed=0)
    assert torch.equal(qd.qlinear(x, alias), qd.qlinear(x, w))
    with pytest.raises(ValueError, match="no integer kernel"):
        qd.qlinear(x, Blocks(w.data.numpy(), "F16", 64))
    with pytest.raises(ValueError, match="needs uint8 data"):
        qd.qlinear(x, Blocks(w.data.numpy()[:, :-1], "Q8_0", 64))
    with pytest.raises(ValueError, match="K=96"):
        qd.qdot(qd.quantize_acts(activations(2, 96, seed=0)), w)


# ---- the variant a process uses -----------------------------------------------------------


@pytest.fixture
def cpu_isa(monkeypatch):
    """Set DEEPINFER_CPU_ISA for one test; the process's choice is read again before and after."""
    def set_isa(value: str) -> None:
        monkeypatch.setenv("DEEPINFER_CPU_ISA", value)
        kernel_isa.cache_clear()
        qdot_level.cache_clear()

    yield set_isa
    monkeypatch.undo()
    kernel_isa.cache_clear()
    qdot_level.cache_clear()


def test_the_kernel_is_built_here():
    """CI machines have AVX2: qdot runs a kernel there, never silently the torch reference."""
    assert qdot_level(cap=False) >= 2 and qd.qdot_isa() != "none"


@pytest.mark.parametrize("cap,fused", [("avx512", 2), ("avx512_vnni", 2), ("avx_vnni", 1), ("avx2", 1),
                                       ("plain", 0), ("none", 0)])
def test_deepinfer_cpu_isa_caps_qdot_and_the_fused_kernels(cpu_isa, cap, fused):
    cpu_isa(cap)
    level = {"avx512": 4, "avx512_vnni": 4, "avx_vnni": 3, "avx2": 2, "plain": 1, "none": 0}[cap]
    assert qd.qdot_isa() == qd.ISA_NAMES[max((v for v in qdot_levels() if v <= level), default=0)]
    assert kernel_isa() == min(fused, cpu_kernels._load()[0])  # the fused kernels' own best here
    w = random_blocks("Q6_K", 5, 256, seed=2)
    x = activations(3, 256, seed=3)
    assert torch.equal(qd.qlinear(x, w), qd.qdot_ref(qd.quantize_acts_ref(x), w))


def test_an_unknown_cap_is_refused(cpu_isa):
    cpu_isa("avx1024")
    with pytest.raises(ValueError, match="DEEPINFER_CPU_ISA must be one of"):
        qd.qdot_isa()
