"""The kernels' tile layout (qdot_cpu.cpp's pack_tiles) of Q4_K, Q5_K and Q6_K weights: the layout
is what its definition says (checked against a numpy construction of it), a tiled weight gives the
file layout's bits and the torch reference's for every variant, row count, level and partial last
tile, and the layers keep it (a QuantLinear, a tied head) unless DEEPINFER_QDOT_TILES=0."""

import numpy as np
import pytest
import torch
from test_qdot import random_blocks

from deepinfer.model_executor.layers.ops import kernel_weights as kw
from deepinfer.model_executor.layers.ops import qdot as qd
from deepinfer.model_executor.layers.ops.cpu_kernels import qdot_levels
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, qmatmul
from deepinfer.model_executor.layers.quant_linear import QuantEmbedding, QuantLinear, head_logits

SIMD = [level for level in qdot_levels() if level >= 2]  # the variants with tiles (lanes 8 or 16)
LANES = {2: 8, 3: 8, 4: 16}
TILED_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 224}

pytestmark = pytest.mark.skipif(not SIMD, reason="needs a SIMD variant of the CPU kernels (AVX2 or better); the "
                                                 "portable one reads the file layout only")


def pack(w, level: int) -> torch.Tensor:
    return torch.ops.deepinfer_cpu.pack_tiles.default(w.data, qd.KINDS[w.kind].ggml_id, level)


def layout_by_definition(data: np.ndarray, kind: str, lanes: int) -> np.ndarray:
    """The tile layout built from its definition: per tile of `lanes` rows, per block b, per 16-byte
    column c of the block (Q6_K's last: bytes 194..209), per dword j, the rows' dwords in row order."""
    n, row_bytes = data.shape
    bb, tb = qd.KINDS[kind].block_bytes, TILED_BYTES[kind]
    tiles = -(-n // lanes)
    rows = np.zeros((tiles * lanes, row_bytes), np.uint8)
    rows[:n] = data
    blocks = rows.reshape(tiles, lanes, row_bytes // bb, bb)  # [T, R, B, bytes]
    starts = [194 if kind == "Q6_K" and c == 13 else 16 * c for c in range(tb // 16)]
    columns = np.stack([blocks[..., s:s + 16] for s in starts], axis=3)  # [T, R, B, C, 16]
    dwords = columns.reshape(tiles, lanes, row_bytes // bb, tb // 16, 4, 4)  # [T, R, B, C, j, 4]
    return dwords.transpose(0, 2, 3, 4, 1, 5).reshape(tiles * lanes, -1)  # [T, B, C, j, R, 4] -> rows


@pytest.mark.parametrize("level", SIMD)
@pytest.mark.parametrize("kind", sorted(TILED_BYTES))
def test_the_layout_is_its_definition(kind, level):
    w = random_blocks(kind, 21, 512, seed=5)  # a partial last tile on every lane count
    tiles = pack(w, level)
    expected = layout_by_definition(w.data.numpy(), kind, LANES[level])
    assert tiles.shape == expected.shape and np.array_equal(tiles.numpy(), expected)


@pytest.mark.parametrize("level", SIMD)
@pytest.mark.parametrize("kind", sorted(TILED_BYTES))
def test_a_tiled_weight_gives_the_file_layouts_bits_and_the_references(kind, level):
    run = torch.ops.deepinfer_cpu.qlinear.default
    for n, k, seed in ((1, 256, 0), (17, 768, 1), (40, 512, 2)):
        w = random_blocks(kind, n, k, seed)
        tiles, kid = pack(w, level), qd.KINDS[kind].ggml_id
        for m in (1, 2, 5, 8, 9, 33):  # fused one and few rows, then the buffered panels
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + seed))
            for levels in (1, 2):
                tiled = run(x, tiles, kid, k, level, levels, n)  # [M, N]
                assert torch.equal(tiled, run(x, w.data, kid, k, level, levels)), (n, k, m, levels)
                assert torch.equal(tiled, qd.qdot_ref(qd.quantize_acts_ref(x, levels), w)), (n, k, m, levels)


def test_bad_tiled_calls_are_refused_with_the_shape_they_need():
    level = SIMD[-1]
    w = random_blocks("Q4_K", 20, 256, seed=3)
    tiles = pack(w, level)
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match=r"tiled w must be uint8 \["):
        torch.ops.deepinfer_cpu.qlinear.default(x, tiles, 12, 256, level, 1, 20 + 2 * LANES[level])  # wrong rows
    with pytest.raises(RuntimeError, match="no tile layout for type 8"):
        torch.ops.deepinfer_cpu.pack_tiles.default(random_blocks("Q8_0", 4, 64, seed=0).data, 8, level)
    with pytest.raises(RuntimeError, match="no tile layout"):
        torch.ops.deepinfer_cpu.pack_tiles.default(w.data, 12, 1)  # the portable variant has no lanes


def _quant_weight(kind: str, n: int, k: int, seed: int) -> QuantWeight:
    return QuantWeight(random_blocks(kind, n, k, seed).data, kind)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_layers_keep_the_tile_layout_with_qmatmuls_bits(kind, monkeypatch):
    monkeypatch.delenv("DEEPINFER_QDOT_TILES", raising=False)
    w = _quant_weight(kind, 40, 512, seed=7)
    layer = QuantLinear(w, None, act_levels=2)
    head = QuantEmbedding(_quant_weight(kind, 50, 512, seed=8))  # a tied LM head
    for rows in (1, 4, 9):
        x = torch.randn(rows, 512)
        assert torch.equal(layer(x), qmatmul(x, (w,), 2))
        assert torch.equal(head_logits(head, x), qmatmul(x, head.qweights, head.act_levels))
    expect_tiles = kw.tile_level() > 0
    for module in (layer, head):
        (checked,) = module._checked[1]
        assert (checked.rows >= 0) == expect_tiles and (checked.data is not module.qweights[0].data) == expect_tiles


def test_tiles_off_keeps_the_file_layout_alone(monkeypatch):
    monkeypatch.setenv("DEEPINFER_QDOT_TILES", "0")
    w = _quant_weight("Q4_K", 16, 256, seed=9)
    layer = QuantLinear(w, None, act_levels=1)
    x = torch.randn(1, 256)
    assert torch.equal(layer(x), qmatmul(x, (w,), 1))
    (checked,) = layer._checked[1]
    assert checked.rows == -1 and checked.data is w.data


def test_released_pages_keep_their_bytes(tmp_path):
    """release_pages is a residency hint: a mapped file's bytes and an anonymous tensor's read back
    unchanged afterwards (a file page is read again from the file, an anonymous one stays)."""
    payload = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 123, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    payload.tofile(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c")[100:])  # private, not page-aligned
    anonymous = torch.from_numpy(payload.copy())
    for t, expected in ((mapped, payload[100:]), (anonymous, payload)):
        kw.release_pages(t)
        assert np.array_equal(t.numpy(), expected)


def test_a_layer_releases_the_file_layout_and_a_tied_head_keeps_it(monkeypatch):
    monkeypatch.delenv("DEEPINFER_QDOT_TILES", raising=False)
    released = []
    monkeypatch.setattr(kw, "release_pages", released.append)
    w, e = _quant_weight("Q4_K", 16, 256, seed=10), _quant_weight("Q4_K", 16, 256, seed=11)
    x = torch.randn(1, 256)
    QuantLinear(w, None, act_levels=1)(x)
    head_logits(QuantEmbedding(e), x)  # its rows are still looked up: no release
    assert released == ([w.data] if kw.tile_level() else [])
