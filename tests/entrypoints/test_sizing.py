"""KV-cache sizing and what a user sees of it: refusals with their numbers, auto sizing and its cap,
vLLM's LLM keywords, the start-up summary, the server's throughput line, bench's default workload."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import time

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import CacheConfig, EngineConfig
from deepinfer.entrypoints import cli
from deepinfer.entrypoints.bench import selected_workloads
from deepinfer.environ import read_environ
from deepinfer.serving.engine_loop import EngineLoop
from deepinfer.serving.metrics import EngineStats
from deepinfer.serving.stats_log import StatsLogger
from deepinfer.worker import cache_sizing
from deepinfer.worker.cache_engine import zeroed_bytes

# tiny llama: 2 layers, rows of 2 kv heads x 16 dims x K|V in fp32 = 256 B; context 1,024
PAGE = 16 * 2 * 256  # one block of 16 tokens, both layers


def _quiet(path: str, capsys) -> str:
    """`path`, with what building it wrote to the captured streams dropped."""
    capsys.readouterr()
    return path


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("deepinfer: error: ")
    return err[0]


# -- refusals --------------------------------------------------------------------------------------------


def test_max_model_len_beyond_the_context_is_refused_naming_both(tiny_checkpoint, capsys):
    assert cli.main(["info", "--model", _quiet(tiny_checkpoint("llama"), capsys), "--max-model-len", "100000"]) == 2
    line = _one_error_line(capsys)
    assert "max_model_len 100,000 exceeds the model's context of 1,024 tokens" in line
    assert "--allow-long-max-model-len" in line


def test_the_flag_or_the_env_knob_accepts_a_long_max_model_len(tiny_checkpoint, capsys):
    assert cli.main(["info", "--model", _quiet(tiny_checkpoint("llama"), capsys), "--max-model-len", "2048",
                     "--allow-long-max-model-len", "--max-num-seqs", "1"]) == 0
    assert "max_model_len: 2048" in capsys.readouterr().out
    env = read_environ({"DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert EngineConfig(max_model_len=4096, env=env).given_max_model_len(1024) == 4096
    with pytest.raises(ValueError, match="max_model_len 4,096 exceeds the model's context of 1,024"):
        EngineConfig(max_model_len=4096, env=read_environ({})).given_max_model_len(1024)


def test_num_blocks_too_few_for_one_request_is_refused_with_numbers(tiny_checkpoint, capsys):
    model = _quiet(tiny_checkpoint("llama"), capsys)
    assert cli.main(["info", "--model", model, "--num-blocks", "10", "--max-model-len", "1024"]) == 2
    line = _one_error_line(capsys)
    needed = 1024 // 16
    assert f"cannot hold one request at max_model_len 1,024: it needs {needed} blocks of {PAGE:,} B " \
           f"({needed * PAGE / 2**20:.1f} MiB)" in line
    assert "--num-blocks gives 10 blocks (0.1 MiB)" in line
    assert "raise --kv-cache-memory / --num-blocks or lower --max-model-len" in line
    # not given, max_model_len is what the 10 blocks hold
    assert cli.main(["info", "--model", model, "--num-blocks", "10"]) == 0
    assert "max_model_len: 160," in capsys.readouterr().out


def test_a_tiny_memory_on_a_model_without_rings_speaks_of_blocks(tiny_checkpoint, capsys):
    assert cli.main(["info", "--model", _quiet(tiny_checkpoint("llama"), capsys), "--kv-cache-memory", "1KiB"]) == 2
    line = _one_error_line(capsys)
    assert "kv_cache_memory 1,024 B (0.0 MiB) holds 0 blocks;" in line and "needs 64 blocks" in line
    assert "sliding-window" not in line and "ring" not in line


def test_a_tiny_memory_on_a_ring_model_speaks_of_its_rings(tiny_checkpoint, capsys):
    assert cli.main(["info", "--model", _quiet(tiny_checkpoint("gemma3"), capsys), "--kv-cache-memory", "1KiB"]) == 2
    line = _one_error_line(capsys)
    assert "cannot hold one request's sliding-window rings" in line and "kv_cache_memory=1,024 B" in line


# -- auto sizing -------------------------------------------------------------------------------------------


def test_auto_is_the_default_and_sizes_for_max_num_seqs_requests(tiny_checkpoint):
    assert CacheConfig().auto_sized
    llm = LLM(tiny_checkpoint("llama"), max_num_seqs=3, max_model_len=128)
    runner = llm.engine.runner
    assert runner.num_blocks == 3 * 128 // 16
    assert runner.caches.cache.num_bytes == 3 * 128 // 16 * PAGE
    ring = LLM(tiny_checkpoint("gemma3"), max_num_seqs=3, max_model_len=128).engine.runner
    assert ring.num_state_slots == 3 and ring.num_blocks == 3 * 128 // 16


def test_auto_is_capped_by_the_fraction_of_free_memory(tiny_checkpoint, monkeypatch, caplog):
    free = 40 * PAGE
    monkeypatch.setattr(cache_sizing, "available_memory", lambda device: free)
    with caplog.at_level(logging.WARNING, logger="deepinfer.worker"):
        llm = LLM(tiny_checkpoint("llama"), max_num_seqs=8, max_model_len=128, gpu_memory_utilization=0.5)
    assert llm.engine.runner.num_blocks == 20  # 0.5 x 40 pages, not the 8 x 8 the requests would take
    assert any("capped at" in r.getMessage() and "gpu_memory_utilization 0.50" in r.getMessage()
               for r in caplog.records)
    monkeypatch.setattr(cache_sizing, "available_memory", lambda device: 4 * PAGE)
    with pytest.raises(ValueError, match=r"needs 8 blocks .* holds 3 blocks"):
        LLM(tiny_checkpoint("llama"), max_num_seqs=8, max_model_len=128, gpu_memory_utilization=0.9)


def test_explicit_sizes_keep_working(tiny_checkpoint):
    assert LLM(tiny_checkpoint("llama"), max_model_len=128, kv_cache_memory="1MiB").engine.runner.num_blocks \
        == (1 << 20) // PAGE
    assert LLM(tiny_checkpoint("llama"), max_model_len=128, num_blocks=9).engine.runner.num_blocks == 9


def test_gpu_memory_utilization_is_a_fraction():
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ValueError, match=f"gpu_memory_utilization must be a fraction in \\(0, 1\\], got {bad!r}"):
            CacheConfig(gpu_memory_utilization=bad)


def test_the_cpu_cache_is_committed_only_where_written():
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    cache = zeroed_bytes(1024, 1 << 20, torch.device("cpu"))  # 1 GiB reserved
    assert cache.shape == (1024, 1 << 20) and int(cache[7].sum()) == 0
    cache[:4] = 1
    assert int(cache[:4].sum()) == 4 << 20 and rss() - before < 256 << 20


def test_available_memory_on_the_cpu_is_meminfo():
    free = cache_sizing.cpu_available_memory()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < free <= total


# -- vLLM keywords -----------------------------------------------------------------------------------------


def test_unknown_keywords_raise_a_type_error_listing_the_accepted_ones():
    with pytest.raises(TypeError, match="unexpected keyword argument 'gpu_mem_util'") as exc:
        LLM(gpu_mem_util=0.5)
    for name in ("gpu_memory_utilization", "max_num_seqs", "tensor_parallel_size", "trust_remote_code", "revision"):
        assert name in str(exc.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2: only 1 is supported"),
    (dict(tokenizer="some/other-tokenizer"), "tokenizer='some/other-tokenizer': only the model's own"),
    (dict(tokenizer_mode="slow"), "tokenizer_mode='slow'"),
])
def test_vllm_keywords_we_cannot_honour_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs)


def test_vllm_keywords_that_mean_something_here_are_taken(tiny_checkpoint, monkeypatch):
    import deepinfer.worker.multiproc as llm_module  # where build_engine's load_source loads from

    seen = {}
    original = llm_module.load_model_source

    def recording(model, load_format="auto", **kw):
        seen.update(kw)
        return original(model, load_format=load_format)

    monkeypatch.setattr(llm_module, "load_model_source", recording)
    path = tiny_checkpoint("llama")
    llm = LLM(path, tensor_parallel_size=1, trust_remote_code=True, enforce_eager=True, swap_space=4,
              disable_log_stats=True, tokenizer=path, max_num_seqs=2, max_model_len=64, revision="v1.0",
              gpu_memory_utilization=0.5)
    assert seen == {"revision": "v1.0"}
    assert llm.engine.config.scheduler.max_num_seqs == 2 and llm.engine.config.cache.gpu_memory_utilization == 0.5
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    seen.clear()
    LLM(path, max_model_len=64)
    assert seen == {}  # no revision: the loader is called as before


# -- what the user sees ------------------------------------------------------------------------------------


def test_the_start_up_summary_is_one_line_with_every_figure(tiny_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm = LLM(tiny_checkpoint("llama"), max_num_seqs=3, max_model_len=128, dtype="float32")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready in")]
    assert len(lines) == 1
    runner = llm.engine.runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters()) / 2**20
    assert re.fullmatch(rf"engine ready in \d+\.\d s: weights {weights:,.1f} MiB, KV cache "
                        rf"{24 * PAGE / 2**20:,.1f} MiB \(24 blocks; reserved, resident only as rows are written\), "
                        r"max concurrency 3 requests at max_model_len "
                        r"128, dtype float32, quantization none, attention torch, device cpu", lines[0]), lines[0]


def test_the_server_logs_throughput_while_busy_and_nothing_when_idle(tiny_checkpoint, caplog):
    engine = LLM(tiny_checkpoint("llama"), max_num_seqs=2, max_model_len=128).engine

    async def serve() -> int:
        loop = EngineLoop(engine)
        loop.stats_logger.interval_s = 0.01
        loop.start()
        handle = await loop.add("r1", [5, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True))
        async for _ in handle:
            await asyncio.sleep(0.002)  # the engine thread steps on; the windows pass
        await asyncio.sleep(0.05)  # the thread logs the last, partial window as it goes idle
        busy = len(_throughput_lines(caplog))
        await asyncio.sleep(0.1)  # idle: the thread sleeps, nothing more is logged
        loop.stop()
        return busy

    with caplog.at_level(logging.INFO, logger="deepinfer.server"):
        busy = asyncio.run(serve())
    lines = _throughput_lines(caplog)
    assert busy >= 1 and len(lines) == busy
    assert re.fullmatch(r"Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: \d+\.\d tokens/s, "
                        r"Running: [01] reqs, Waiting: 0 reqs, KV cache usage: \d+\.\d%", lines[0])
    assert any(not line.startswith("Avg prompt throughput: 0.0") for line in lines)


def _throughput_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Avg prompt throughput")]


def test_stats_logger_rates_and_silence():
    stats = StatsLogger(interval_s=2.0, now=0.0)
    stats.record_prompt(300, now=100.0)  # the window opens with the first request, not at start-up
    stats.record_generation(50)
    assert stats.maybe_log(EngineStats(num_running=2), now=101.0) is None  # inside the window
    line = stats.maybe_log(EngineStats(num_running=2, num_waiting=1, kv_usage=0.25), now=102.0)
    assert line == ("Avg prompt throughput: 150.0 tokens/s, Avg generation throughput: 25.0 tokens/s, "
                    "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%")
    stats.record_generation(10)
    line = stats.maybe_log(EngineStats(), now=102.5)  # gone idle: the partial window at once
    assert line.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 20.0 tokens/s, ")
    assert stats.maybe_log(EngineStats(), now=110.0) is None  # idle: silent
    stats.record_prompt(8, now=200.0)
    assert stats.maybe_log(EngineStats(num_running=1), now=202.0).startswith("Avg prompt throughput: 4.0 tokens/s")
    assert StatsLogger(interval_s=None).maybe_log(EngineStats(num_running=1), now=time.monotonic() + 99) is None


def test_serve_flags_set_the_interval():
    args = cli.build_parser().parse_args(["serve", "--log-stats-interval", "0.5"])
    assert args.log_stats_interval == 0.5 and not args.disable_log_stats
    assert cli.build_parser().parse_args(["serve", "--disable-log-stats"]).disable_log_stats


def test_bare_bench_runs_cpu32_only():
    assert selected_workloads(argparse.Namespace(workload=None)) == ["cpu32"]
    assert selected_workloads(argparse.Namespace(workload=["decode1", "cpu32", "decode1"])) == ["decode1", "cpu32"]
    assert cli.build_parser().parse_args(["bench"]).workload is None


def test_info_with_dummy_weights_builds_shapes_only(tiny_checkpoint, capsys):
    assert cli.main(["info", "--model", _quiet(tiny_checkpoint("llama"), capsys), "--load-format", "dummy",
                     "--max-model-len", "128", "--max-num-seqs", "2"]) == 0
    out = capsys.readouterr().out
    assert "(dummy weights: shapes only, no values)" in out
    assert "16 blocks x 16 = 256 tokens = 2 requests at max_model_len 128" in out


def test_weight_loading_progress_is_off_when_stderr_is_not_a_terminal():
    from deepinfer.model_executor.model_loader import weight_progress

    weights = iter([("w", torch.zeros(1))])
    assert weight_progress(weights) is weights  # no bar (and no tqdm import) off a terminal
