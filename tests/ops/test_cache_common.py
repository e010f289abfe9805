"""Row formats, payload formulas and ring sizes on the book's numbers (chapter 3, seed 004)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.environ import read_environ
from deepinfer.model_executor.layers.ops.cache_common import (
    V41_FORMAT,
    KVCacheFormat,
    bf16_format,
    get_inference_swa_block_size,
    get_kvstore_swa_block_size,
    kv_payload_bytes,
    mxfp8_format,
    row_payload_bytes,
    separate_kv_row_elements,
    visible_rows,
    window_kv_payload_bytes,
)

GENERIC = dict(num_layers=32, num_kv_heads=8, head_dim=128, num_tokens=4096, bytes_per_element=2)


@pytest.mark.subprocess
def test_layout_modules_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import deepinfer.environ\n"
            "import deepinfer.model_executor.layers.ops.cache_common\n"
            "import deepinfer.model_executor.layers.ops.swa_addressing\n")
    root = Path(__file__).resolve().parents[2]  # `python -c` puts the working directory on sys.path
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_v41_format_is_528_bytes():
    assert (V41_FORMAT.data_bytes, V41_FORMAT.scale_bytes, V41_FORMAT.bytes_per_row) == (512, 16, 528)
    assert V41_FORMAT.num_elements == 512 and V41_FORMAT.num_scale_factors == 16
    assert V41_FORMAT.quantized_dtype == "e4m3" and V41_FORMAT.sf_format == "ue8m0"
    assert V41_FORMAT.token_interleaved and V41_FORMAT.do_cast and V41_FORMAT.bf16_elements == 0


def test_mxfp8_format_of_a_llama_row():
    fmt = mxfp8_format(separate_kv_row_elements(num_kv_heads=8, head_dim=128))  # 2048 values
    assert (fmt.num_elements, fmt.data_bytes, fmt.scale_bytes, fmt.bytes_per_row) == (2048, 2048, 64, 2112)
    assert mxfp8_format(512) == KVCacheFormat(**{**V41_FORMAT.__dict__, "note": "MXFP8 row"})


@pytest.mark.parametrize("width", [100, 31, 0, -32])
def test_mxfp8_format_rejects_widths_off_the_scale_grid(width):
    with pytest.raises(ValueError, match=rf"row_elements.*{width}"):
        mxfp8_format(width)


def test_bf16_row_matches_the_book_separate_layout():
    # 2 x 8 x 128 x 2 = 4,096 B per layer per token; about 7.76 times the SWA row.
    fmt = bf16_format(separate_kv_row_elements(8, 128))
    assert (fmt.bytes_per_row, fmt.scale_bytes) == (4096, 0)
    assert round(fmt.bytes_per_row / V41_FORMAT.bytes_per_row, 2) == 7.76


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(quantized_dtype="int4", quantized_elements=32, elements_per_sf=32, sf_format="ue8m0"), "int4"),
    (dict(quantized_dtype="e4m3", quantized_elements=48, elements_per_sf=32, sf_format="ue8m0"), "48"),
    (dict(quantized_dtype="e4m3", quantized_elements=32, elements_per_sf=32, sf_format="fp16"), "fp16"),
    (dict(quantized_dtype="e2m1", quantized_elements=1, elements_per_sf=1, sf_format="ue8m0"), "whole bytes"),
    (dict(), "at least one element"),
    (dict(bf16_elements=-1), "bf16_elements.*-1"),
])
def test_bad_formats_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVCacheFormat(**kwargs)


def test_fp4_format_counts_half_bytes():
    fmt = KVCacheFormat(quantized_dtype="e2m1", quantized_elements=64, elements_per_sf=32, sf_format="ue8m0")
    assert (fmt.data_bytes, fmt.scale_bytes, fmt.bytes_per_row) == (32, 2, 34)


def test_generic_payloads_of_the_book():
    assert kv_payload_bytes(**GENERIC) == 536_870_912 == 512 * 2**20
    assert window_kv_payload_bytes(**GENERIC, window_size=128) == 16_777_216 == 16 * 2**20


def test_exercise_fewer_kv_heads_and_smaller_elements():
    full = kv_payload_bytes(**GENERIC)
    assert kv_payload_bytes(**{**GENERIC, "num_kv_heads": 1}) == full // 8
    assert kv_payload_bytes(**{**GENERIC, "bytes_per_element": 1}) == full // 2


def test_seed_worked_example_is_96_bytes():
    assert kv_payload_bytes(num_layers=2, num_kv_heads=1, head_dim=4, num_tokens=3, bytes_per_element=2) == 96


def test_swa_rows_visible_and_allocated():
    rows = visible_rows(4096, 128)
    assert rows == 128
    assert row_payload_bytes(rows, V41_FORMAT) == 67_584
    assert row_payload_bytes(get_inference_swa_block_size(128, read_environ({})), V41_FORMAT) == 70_752
    assert row_payload_bytes(134, V41_FORMAT, num_layers=3) == 3 * 70_752


def test_visible_rows():
    assert visible_rows(50) == 50
    assert visible_rows(50, 128) == 50
    assert visible_rows(500, 128) == 128


@given(layers=st.integers(1, 64), heads=st.integers(1, 16), dim=st.integers(1, 256),
       tokens=st.integers(0, 10_000), window=st.integers(1, 20_000), nbytes=st.integers(1, 4))
def test_payload_formulas_agree(layers, heads, dim, tokens, window, nbytes):
    full = kv_payload_bytes(layers, heads, dim, tokens, nbytes)
    assert full == 2 * layers * heads * dim * tokens * nbytes
    windowed = window_kv_payload_bytes(layers, heads, dim, tokens, window, nbytes)
    assert windowed == kv_payload_bytes(layers, heads, dim, min(tokens, window), nbytes)
    assert windowed <= full and (window < tokens or windowed == full)
    if nbytes == 2:  # a bf16 row per layer holds K and V of every KV head
        assert row_payload_bytes(tokens, bf16_format(separate_kv_row_elements(heads, dim)), layers) == full


@pytest.mark.parametrize(("call", "match"), [
    (lambda: kv_payload_bytes(0, 8, 128, 10, 2), "num_layers.*0"),
    (lambda: kv_payload_bytes(32, 0, 128, 10, 2), "num_kv_heads.*0"),
    (lambda: kv_payload_bytes(32, 8, 128, -1, 2), "num_tokens.*-1"),
    (lambda: kv_payload_bytes(32, 8, 128, 10, 2.5), "bytes_per_element.*2.5"),
    (lambda: window_kv_payload_bytes(32, 8, 128, 10, 0, 2), "window_size.*0"),
    (lambda: row_payload_bytes(-4, V41_FORMAT), "num_rows.*-4"),
    (lambda: get_inference_swa_block_size(0), "window_size.*0"),
])
def test_bad_inputs_name_field_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(("variables", "inference", "kvstore"), [
    ({}, 134, 134),
    ({"DEEPINFER_MAX_BACKTRACKING_TOKENS": "3"}, 134, 134),
    ({"DEEPINFER_MAX_BACKTRACKING_TOKENS": "10"}, 138, 138),
    ({"DEEPINFER_USE_NEXTN_DECODE": "0"}, 129, 129),
    ({"DEEPINFER_USE_NEXTN_DECODE": "7"}, 136, 136),
    ({"DEEPINFER_PREFILL_STORE_EXTRA_STATE": "1"}, 134, 262),
    ({"DEEPINFER_PREFILL_STORE_EXTRA_STATE": "1", "DEEPINFER_PREFILL_STORE_EXTRA_SIZE": "16"}, 134, 150),
    # YOCO keep tokens count only inside the enabled extra-state branch (book §3.4.3).
    ({"DEEPINFER_YOCO_PREFILL_TRUNCATION": "1", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "40"}, 134, 134),
    ({"DEEPINFER_PREFILL_STORE_EXTRA_STATE": "1", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "40"}, 134, 262),
    ({"DEEPINFER_PREFILL_STORE_EXTRA_STATE": "1", "DEEPINFER_YOCO_PREFILL_TRUNCATION": "1",
      "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "40"}, 134, 302),
])
def test_ring_sizes(variables, inference, kvstore):
    env = read_environ(variables)
    assert get_inference_swa_block_size(128, env) == inference
    assert get_kvstore_swa_block_size(128, env) == kvstore


def test_ring_size_defaults_to_the_process_environment(monkeypatch):
    from deepinfer.environ import get_environ

    for variable in [v for v in os.environ if v.startswith("DEEPINFER_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    get_environ.cache_clear()
    try:
        assert get_inference_swa_block_size(128) == 131
    finally:
        get_environ.cache_clear()
