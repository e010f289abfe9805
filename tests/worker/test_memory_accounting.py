"""KV memory of a sliding-window cache against the full cache: the ratio is S / L."""

from __future__ import annotations

import pytest

from deepinfer import LLM
from deepinfer.entrypoints.bench.workloads.long import allocated_bytes_per_request
from deepinfer.entrypoints.info import info_lines
from deepinfer.model_executor.layers.ops.cache_common import get_inference_swa_block_size

pytestmark = [pytest.mark.slow]


def test_window_memory_ratio_equals_s_over_l(tiny_checkpoint):
    path, window, length = tiny_checkpoint("llama"), 16, 2304
    long = dict(max_model_len=4096, allow_long_max_model_len=True)  # beyond the tiny model's 1,024
    swa = LLM(path, hf_overrides={"sliding_window": window}, num_blocks=8, **long)
    full = LLM(path, num_blocks=256, **long)  # 256 blocks of 16 hold one request at 4,096
    ring = get_inference_swa_block_size(window)
    assert [g.kind for g in swa.engine.runner.groups] == ["ring"] and ring == window + 6
    ratio = allocated_bytes_per_request(swa.engine.runner, length) / \
        allocated_bytes_per_request(full.engine.runner, length)
    assert ratio == pytest.approx(ring / length, rel=0.01)
    lines = "\n".join(info_lines(swa))
    assert f"window W={window}: {window} visible rows, {ring} allocated rows (S)" in lines


def test_fp8_rows_shrink_the_cache(tiny_checkpoint):
    path = tiny_checkpoint("llama")  # rows of 2 kv heads x 16 dims x 2 = 64 elements
    auto = LLM(path, kv_cache_memory="1MiB")
    fp8 = LLM(path, kv_cache_memory="1MiB", kv_cache_dtype="fp8")
    assert auto.engine.runner.caches.codec.row_bytes == 256 and fp8.engine.runner.caches.codec.row_bytes == 66
    assert fp8.engine.runner.num_blocks == (1 << 20) // (16 * 2 * 66)


def test_the_draft_allowance_has_one_source(tiny_checkpoint, monkeypatch):
    """The ring keeps room for the config's k drafts (S = W + k + 1), so S >= W + k + 1 holds by
    construction; DEEPINFER_USE_NEXTN_DECODE, read once into the config, is only k's default."""
    from deepinfer.environ import get_environ

    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "1")
    get_environ.cache_clear()
    try:
        path, window = tiny_checkpoint("llama"), 16
        default = LLM(path, hf_overrides={"sliding_window": window})
        explicit = LLM(path, hf_overrides={"sliding_window": window}, num_speculative_tokens=3)
    finally:
        monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE")
        get_environ.cache_clear()
    assert default.engine.config.speculative.num_speculative_tokens == 1
    assert default.engine.runner.groups[0].rows_per_unit == window + 2
    assert explicit.engine.config.speculative.num_speculative_tokens == 3
    assert explicit.engine.runner.groups[0].rows_per_unit == window + 4
    LLM(path, hf_overrides={"sliding_window": window})  # the environment was read at start-up only
