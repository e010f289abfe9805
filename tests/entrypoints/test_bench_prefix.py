"""`deepinfer bench --workload prefix`: cold, memory hit and after restart (a fresh process on the
cache directory) on the same requests; the structure of the table and the JSON, never timings."""

from __future__ import annotations

import json
import re

import pytest

from deepinfer.entrypoints import cli
from deepinfer.entrypoints.bench.workloads.prefix import percentile
from deepinfer.entrypoints.bench.workloads.prefix_prompts import random_prompts, shared_len, text_prompts

MS = r"\d+\.\dms"


@pytest.mark.bench
def test_prefix_bench_runs_cold_memory_hit_and_restart(tiny_checkpoint, tmp_path, capsys):
    out, cache_dir = tmp_path / "prefix.json", tmp_path / "kv"
    assert cli.main(["bench", "--model", tiny_checkpoint("llama"), "--workload", "prefix", "--prefix-len", "96",
                     "--num-requests", "3", "--max-tokens", "2", "--num-blocks", "128",
                     "--kv-cache-dir", str(cache_dir), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^prefix   cpu: .+ \(\d+ cpus, load average", text, re.M), text
    assert re.search(r"^prefix   model: .+ \(llama\), cpu float32, 128 KV blocks of 16 tokens$", text, re.M), text
    assert "shared prefix 96 tokens (--prefix-len 96)" in text
    for config in ("cold", "memory hit", "after restart"):
        assert re.search(rf"^prefix   {config} +{MS} +{MS} +\d+\.\d \| +\d+\.\d\d +\d+\.\d\d +\d+\.\d +\d+\.\d$",
                         text, re.M), text
    assert re.search(rf"^prefix   after restart: first request TTFT {MS}, 96 cached tokens, 96 of them read from "
                     r"the cache directory \(6 files\)$", text, re.M), text
    assert re.search(r"^prefix   TTFT p50 cold / memory hit: \d+\.\d\dx; cold / after restart: \d+\.\d\dx$",
                     text, re.M), text
    for config in ("memory hit", "after restart"):
        assert f"prefix   outputs {config} vs cold: identical (6 of 6 requests)" in text

    cold, hit, restart = json.loads(out.read_text())
    assert [r["config"] for r in (cold, hit, restart)] == ["cold", "memory hit", "after restart"]
    for r in (cold, hit, restart):
        assert r["workload"] == "prefix" and r["engine"] == "deepinfer" and len(r["ttfts_s"]) == 3
        assert r["output_tokens"] == 3 * 2 and r["batch_prompt_tokens"] > 3 * 96
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= max(r["ttfts_s"])
        assert r["setup"]["shared_prefix_tokens"] == 96 and r["setup"]["kv_cache_dir"] == str(cache_dir)
    assert cold["mean_num_cached_tokens"] == cold["batch_mean_num_cached_tokens"] == 0
    assert "vs_cold" not in cold
    for r in (hit, restart):  # the shared prefix (96 tokens, 6 whole blocks) and nothing more
        assert r["mean_num_cached_tokens"] == r["batch_mean_num_cached_tokens"] == 96
        assert r["vs_cold"]["identical_outputs"] and r["vs_cold"]["mismatched_requests"] == []
        assert r["vs_cold"]["ttft_p50_ratio"] == cold["ttft_p50_s"] / r["ttft_p50_s"]
    assert hit["prefix_warmup"]["num_cached_tokens"] == 0  # the cold request with caching on
    assert hit["first_request"]["prefix_cache_disk_hits"] == 0
    first = restart["first_request"]  # a fresh process: the prefix comes from the directory
    assert first["num_cached_tokens"] == first["prefix_cache_disk_hits"] == 96
    assert first["kv_cache_dir_files_read"] == 6
    assert restart["writer"]["num_cached_tokens"] == 0 and restart["writer"]["kv_cache_dir_files"] >= 6
    assert restart["counters"]["serial"]["prefix_cache_disk_hits"] == 96  # later requests: from memory


def test_text_prompts_share_exactly_the_prefix(tiny_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    p = text_prompts(tokenizer, 200, 4, seed=3)
    assert p.shared == 200 == shared_len(p.serial + p.batch + [p.prefix_warmup])
    assert len(p.serial) == len(p.batch) == 4 and len({tuple(x) for x in p.serial + p.batch}) == 8
    assert all(20 <= n <= 45 for n in p.question_lens), p.question_lens  # the question and the template's tail
    assert p.serial[0][:200] != p.engine_warmup[:200] and p.engine_warmup[:16] != p.serial[0][:16]
    assert text_prompts(tokenizer, 200, 4, seed=3) == p != text_prompts(tokenizer, 200, 4, seed=4)
    head = tokenizer.decode(p.serial[0])
    assert head.startswith("<|im_start|>system\nYou are the customer support assistant") and \
        head.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_random_prompts_without_a_tokenizer():
    p = random_prompts(500, 64, 5, seed=1)
    assert p.shared == shared_len(p.serial + p.batch + [p.prefix_warmup]) == 64
    assert len(p.serial) == len(p.batch) == 5 and all(20 <= n <= 40 for n in p.question_lens)
    assert all(100 <= t < 500 for x in p.serial + p.batch + [p.engine_warmup] for t in x)
    assert len(p.engine_warmup) == 64 and p.engine_warmup[:16] != p.serial[0][:16]


def test_percentile_interpolates_between_ranks():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert abs(percentile([1.0, 2.0, 3.0], 90) - 2.8) < 1e-12
    assert percentile([5.0], 90) == 5.0
