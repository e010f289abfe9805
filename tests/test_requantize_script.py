"""scripts/requantize_gguf.py: which type each mix gives a matrix (after llama.cpp's choices), the
fallback for rows that are not whole blocks, and a tiny GGUF written again in the grid types."""

from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("requantize_gguf", os.path.join(ROOT, "scripts", "requantize_gguf.py"))
rq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rq)

GRID_AND_TERNARY = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"}


def test_rotate2_puts_every_grid_and_ternary_type_in_a_30_layer_models_ffn_down_once_and_keeps_the_rest():
    kinds = [rq.mix_type("rotate2", f"blk.{i}.ffn_down.weight", 30) for i in range(30)]
    assert set(kinds[:9]) == GRID_AND_TERNARY and kinds[9:18] == kinds[:9]
    assert rq.mix_type("rotate2", "blk.3.attn_q.weight", 30) is None
    assert rq.target_type("rotate2", "blk.3.ffn_up.weight", 576, 30) is None


@pytest.mark.parametrize(("mix", "part", "layer", "kind"), [
    ("iq2_m", "ffn_down", 2, "IQ3_S"), ("iq2_m", "ffn_down", 3, "IQ2_S"), ("iq2_m", "attn_v", 9, "IQ3_S"),
    ("iq2_m", "attn_output", 9, "IQ3_S"), ("iq2_m", "ffn_gate", 9, "IQ2_S"),
    ("iq2_xxs", "attn_v", 9, "Q2_K"), ("iq2_xxs", "ffn_down", 0, "Q2_K"), ("iq2_xxs", "ffn_up", 0, "IQ2_XXS"),
    ("iq3_xxs", "attn_q", 9, "IQ2_S"), ("iq3_xxs", "attn_v", 9, "IQ3_S"), ("iq3_xxs", "ffn_down", 0, "IQ3_XXS"),
    ("iq1_s", "attn_output", 9, "IQ2_XXS"), ("iq1_m", "ffn_down", 9, "IQ1_M"), ("iq1_m", "ffn_down", 1, "Q2_K"),
    ("tq1_0", "attn_k", 0, "TQ1_0"), ("tq2_0", "ffn_down", 0, "TQ2_0"), ("IQ3_S", "attn_k", 0, "IQ3_S"),
])
def test_the_i_quant_mixes_give_each_matrix_llama_cpps_type(mix, part, layer, kind):
    assert rq.mix_type(mix, f"blk.{layer}.{part}.weight", 30) == kind  # 30 layers: the first eighth is 0..2


def test_rows_that_are_not_whole_blocks_take_llama_cpps_fallback():
    assert rq.target_type("iq2_m", "blk.5.ffn_gate.weight", 576, 30) == "IQ4_NL"
    assert rq.target_type("iq1_s", "blk.5.ffn_down.weight", 1536, 30) == "IQ1_S"
    assert rq.target_type("tq1_0", "blk.5.attn_q.weight", 576, 30) == "Q4_0"
    with pytest.raises(ValueError, match="blk.5.attn_q.weight: rows of 100 values are not whole Q8_0 blocks"):
        rq.target_type("Q8_0", "blk.5.attn_q.weight", 100, 30)


def test_a_mix_that_is_neither_a_mix_nor_a_type_is_named():
    with pytest.raises(ValueError, match="--mix 'iq9_q': not a mix"):
        rq.check_mix("iq9_q")
    with pytest.raises(ValueError, match="--mix 'F32': not a mix"):
        rq.check_mix("F32")


def _tiny_gguf(path: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tensors = {f"blk.{i}.ffn_down.weight": rng.standard_normal((4, 512)).astype(np.float32) for i in range(9)}
    tensors["blk.0.attn_q.weight"] = rng.standard_normal((4, 64)).astype(np.float32)
    tensors["blk.0.attn_norm.weight"] = np.ones(64, np.float32)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(9)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_a_gguf_written_again_in_rotate2_decodes_near_its_values(tmp_path):
    src, dst = str(tmp_path / "src.gguf"), str(tmp_path / "dst.gguf")
    values = _tiny_gguf(src)
    counts = rq.requantize(src, dst, "rotate2")
    assert counts == dict.fromkeys(GRID_AND_TERNARY, 1)
    out = {t.name: t for t in gguf.GGUFReader(dst).tensors}
    for name, value in values.items():
        t = out[name]
        decoded = gguf.quants.dequantize(t.data, t.tensor_type).reshape(value.shape)
        if "ffn_down" in name:
            assert t.tensor_type.name == rq.mix_type("rotate2", name)
            assert np.sqrt(((decoded - value) ** 2).mean() / (value**2).mean()) < 0.6
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and np.array_equal(decoded, value)


def test_rotate_all_puts_each_of_thirteen_types_in_one_ffn_down_and_keeps_the_rest():
    kinds = [rq.mix_type("rotate_all", f"blk.{i}.ffn_down.weight", 30) for i in range(30)]
    assert kinds[:13] == list(rq.ROTATE_ALL) and len(set(rq.ROTATE_ALL)) == 13 and set(kinds[13:]) == {None}
    assert rq.mix_type("rotate_all", "blk.3.attn_q.weight", 30) is None
