"""Dequantization through the loader's GGUF reader, per ggml type, and of the same tensors kept
in their blocks (`packed_gguf`, `dequantize_ref`).

Types with a Python quantizer in `gguf.quants` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are
quantized from a known array; Q4_K and Q6_K have no quantizer, so blocks are packed by hand from
their documented bit layout with known integer codes and scales.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from deepinfer.model_executor.layers.ops.qmatmul import dequantize_ref
from deepinfer.model_executor.loader.gguf import dequantize_tensor
from deepinfer.model_executor.loader.gguf_file import read_gguf_file
from deepinfer.model_executor.loader.gguf_repack import packed_gguf

Q = gguf.GGMLQuantizationType
QK_K = 256

# max |error| as a fraction of the 32-element block's absmax (F16/BF16: relative to each value)
_BLOCK_ERROR = {Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 15, Q.Q5_0: 1 / 16, Q.Q5_1: 1 / 31}
_RELATIVE_ERROR = {Q.F32: 0.0, Q.F16: 2**-11, Q.BF16: 2**-8}


def _write_raw(path, name: str, data: np.ndarray, raw_dtype) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _load_one(path: str):
    (tensor,) = read_gguf_file(path).tensors
    return tensor


def _reference_bytes(path: str) -> np.ndarray:
    """The same tensor's bytes through gguf's own reader (independent of ours)."""
    (tensor,) = gguf.GGUFReader(path).tensors
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type)


@pytest.mark.parametrize("qtype", list(_RELATIVE_ERROR) + list(_BLOCK_ERROR), ids=lambda t: t.name)
def test_python_quantizable_types(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    original = rng.standard_normal((6, 128)).astype(np.float32) * 3  # [rows, cols], torch order
    data = gguf.quants.quantize(original, qtype)
    path = _write_raw(tmp_path / "t.gguf", "w", data, None if qtype in (Q.F32, Q.F16) else qtype)
    tensor = _load_one(path)
    assert tensor.tensor_type == qtype and tensor.shape == (6, 128)

    ours = dequantize_tensor(tensor, torch.float32).numpy()
    np.testing.assert_array_equal(ours, _reference_bytes(path).reshape(6, 128))
    packed = packed_gguf(qtype.name, tensor.data, tensor.shape)  # kept in its blocks: the same values
    if packed is not None:
        np.testing.assert_array_equal(dequantize_ref(packed).numpy(), ours)
    error = np.abs(ours - original)
    if qtype in _RELATIVE_ERROR:
        assert (error <= _RELATIVE_ERROR[qtype] * np.abs(original) + 1e-30).all()
    else:
        absmax = np.abs(original).reshape(6, 4, 32).max(axis=-1, keepdims=True)
        assert (error.reshape(6, 4, 32) <= _BLOCK_ERROR[qtype] * absmax * 1.01 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_straight_to_dtype(tmp_path, dtype):
    original = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    path = _write_raw(tmp_path / "t.gguf", "w", gguf.quants.quantize(original, Q.Q8_0), Q.Q8_0)
    tensor = _load_one(path)
    ours = dequantize_tensor(tensor, dtype)
    assert ours.dtype == dtype
    assert torch.equal(ours, dequantize_tensor(tensor, torch.float32).to(dtype))


def test_float_tensors_are_copies(tmp_path):
    """F32 data is a view of a read-only map; the loader must hand out writable copies."""
    original = np.arange(64, dtype=np.float32).reshape(2, 32)
    tensor = _load_one(_write_raw(tmp_path / "t.gguf", "w", original, None))
    ours = dequantize_tensor(tensor, torch.float32)
    ours += 1  # would fail or corrupt the map if it aliased it
    assert torch.equal(dequantize_tensor(tensor, torch.float32), torch.from_numpy(original))


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _pack_q4_k(d, dmin, scales, mins, codes) -> np.ndarray:
    """block_q4_K: f16 d | f16 dmin | 12 bytes of 6-bit (scale, min) x 8 | 128 bytes of 4-bit codes.

    Sub-block s (32 values) decodes as d * scales[s] * code - dmin * mins[s]. Scales/mins 0..3 sit
    in the low 6 bits of bytes 0..3 / 4..7; those of 4..7 put their low 4 bits in bytes 8..11
    (scale low nibble, min high nibble) and their top 2 bits in the top bits of bytes 0..3 / 4..7.
    Codes: each 64-value chunk uses 32 bytes, values 0..31 in the low nibbles, 32..63 in the high.
    """
    packed = np.zeros(12, dtype=np.uint8)
    packed[0:4] = scales[:4] | ((scales[4:] >> 4) << 6)
    packed[4:8] = mins[:4] | ((mins[4:] >> 4) << 6)
    packed[8:12] = (scales[4:] & 0xF) | ((mins[4:] & 0xF) << 4)
    chunks = codes.reshape(4, 2, 32)
    qs = (chunks[:, 0] | (chunks[:, 1] << 4)).astype(np.uint8).reshape(128)
    head = np.concatenate([_f16(np.array([d])), _f16(np.array([dmin]))]).view(np.uint8)
    return np.concatenate([head, packed, qs])


def _pack_q6_k(d, scales, codes) -> np.ndarray:
    """block_q6_K: 128 bytes ql (low 4 bits) | 64 bytes qh (high 2 bits) | 16 int8 scales | f16 d.

    Value i decodes as d * scales[i // 16] * (code[i] - 32) with 6-bit codes. Each 128-value half
    uses 64 ql bytes and 32 qh bytes: for l < 32, values l, l+32, l+64, l+96 take the low/high
    nibbles of ql[l] and ql[l+32] and bit pairs 0-1, 2-3, 4-5, 6-7 of qh[l].
    """
    ql = np.zeros(128, dtype=np.uint8)
    qh = np.zeros(64, dtype=np.uint8)
    for half in range(2):
        c = codes[half * 128 : (half + 1) * 128].reshape(4, 32)  # the four 32-value quarters
        ql[half * 64 : half * 64 + 32] = (c[0] & 0xF) | ((c[2] & 0xF) << 4)
        ql[half * 64 + 32 : half * 64 + 64] = (c[1] & 0xF) | ((c[3] & 0xF) << 4)
        qh[half * 32 : half * 32 + 32] = (
            (c[0] >> 4) | ((c[1] >> 4) << 2) | ((c[2] >> 4) << 4) | ((c[3] >> 4) << 6)
        )
    tail = np.concatenate([scales.astype(np.int8).view(np.uint8), _f16(np.array([d])).view(np.uint8)])
    return np.concatenate([ql, qh, tail])


def _q4_k_case(rng, num_blocks: int):
    blocks, values = [], []
    for _ in range(num_blocks):
        d, dmin = _f16(rng.uniform(0.01, 0.1, 2)).astype(np.float32)
        scales, mins = rng.integers(0, 64, 8, dtype=np.uint8), rng.integers(0, 64, 8, dtype=np.uint8)
        codes = rng.integers(0, 16, QK_K, dtype=np.uint8)
        blocks.append(_pack_q4_k(d, dmin, scales, mins, codes))
        sub = codes.reshape(8, 32).astype(np.float32)
        d_sc = (d * scales.astype(np.float32))[:, None]
        dm = (dmin * mins.astype(np.float32))[:, None]
        values.append((d_sc * sub - dm).reshape(QK_K))
    return np.stack(blocks), np.stack(values)


def _q6_k_case(rng, num_blocks: int):
    blocks, values = [], []
    for _ in range(num_blocks):
        d = _f16(rng.uniform(0.001, 0.01, 1)).astype(np.float32)[0]
        scales = rng.integers(-128, 128, 16).astype(np.int8)
        codes = rng.integers(0, 64, QK_K, dtype=np.uint8)
        blocks.append(_pack_q6_k(d, scales, codes))
        sub = codes.reshape(16, 16).astype(np.float32) - 32
        values.append(((d * scales.astype(np.float32))[:, None] * sub).reshape(QK_K))
    return np.stack(blocks), np.stack(values)


@pytest.mark.parametrize(
    "qtype, make_case", [(Q.Q4_K, _q4_k_case), (Q.Q6_K, _q6_k_case)], ids=["Q4_K", "Q6_K"]
)
def test_k_quants_from_documented_layout(tmp_path, qtype, make_case):
    rows, blocks_per_row = 3, 2
    blocks, expected = make_case(np.random.default_rng(7), rows * blocks_per_row)
    data = blocks.reshape(rows, -1)  # [rows, bytes per row]
    path = _write_raw(tmp_path / "k.gguf", "w", data, qtype)
    tensor = _load_one(path)
    assert tensor.shape == (rows, blocks_per_row * QK_K)

    ours = dequantize_tensor(tensor, torch.float32).numpy()
    np.testing.assert_allclose(ours, expected.reshape(rows, -1), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(ours, _reference_bytes(path).reshape(ours.shape))
    packed = dequantize_ref(packed_gguf(qtype.name, tensor.data, tensor.shape)).numpy()  # kept in its blocks
    np.testing.assert_allclose(packed, expected.reshape(rows, -1), rtol=1e-6, atol=1e-7)
