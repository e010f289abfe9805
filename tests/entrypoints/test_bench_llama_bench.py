"""`deepinfer bench --workload pp512 --workload tg128` (workloads.llama_bench) and the memory-bandwidth
probe beside tg128 (bench.bandwidth): the requests each engine is given and how they are timed, the
printed lines and the JSON on a tiny model, the peer's per-request timings, and the bandwidth arithmetic."""

from __future__ import annotations

import json
import re
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deepinfer.entrypoints import cli
from deepinfer.entrypoints.bench import bandwidth
from deepinfer.entrypoints.bench.peers import node_llama_cpp as nlc
from deepinfer.entrypoints.bench.report import print_ratios
from deepinfer.entrypoints.bench.workloads import llama_bench as lb

VOCAB = 49152


@pytest.mark.bench
def test_pp512_and_tg128_run_end_to_end_on_a_tiny_model(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """Every request runs alone on an engine without prefix caching, on --threads threads (1 here: two
    threads on a busy 2-core machine stall each other); pp512 times 512 prompt tokens, tg128 the 128
    decode steps after the first token; tg128 is followed by the bandwidth lines."""
    monkeypatch.setattr(bandwidth, "DEFAULT_PROBE_BYTES", 8 << 20)  # a small copy: this test checks the wiring
    seen = []
    time_request = lb.time_request

    def spy(engine, prompt, params, cached=0):
        seen.append((len(prompt), params.max_tokens, engine.get_metrics()["prefix_caching"],
                     torch.get_num_threads()))
        return time_request(engine, prompt, params, cached)

    monkeypatch.setattr(lb, "time_request", spy)
    model = tiny_checkpoint("llama")
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--model", model, "--workload", "pp512", "--workload", "tg128",
                     "--repetitions", "2", "--threads", "1", "--num-blocks", "256", "--json", str(out)]) == 0
    # one warm-up + 2 timed requests per workload, with the shapes of llama-bench's tests
    assert [s[:2] for s in seen] == [(512, 1)] * 3 + [(16, 129)] * 3
    assert all(not caching and threads == 1 for _, _, caching, threads in seen), seen

    results = json.loads(out.read_text())
    assert [(r["engine"], r["workload"]) for r in results] == [("deepinfer", "pp512"), ("deepinfer", "tg128")]
    for r, measured in zip(results, (512, 128), strict=True):
        assert r["threads"] == 1 and r["batch"] == 1 and r["measured_tokens"] == measured
        assert len(r["runs_s"]) == 2 and all(s > 0 for s in r["runs_s"])
        assert r["output_tokens"] == 2 * measured and r["seconds"] == pytest.approx(sum(r["runs_s"]))
        rates = [measured / s for s in r["runs_s"]]
        assert r["run_tokens_per_s"] == pytest.approx(rates)
        assert r["tokens_per_s"] == pytest.approx(statistics.fmean(rates))
        assert r["std_tokens_per_s"] == pytest.approx(statistics.stdev(rates))
    pp, tg = results
    assert "weight_bytes" not in pp and "bandwidth" not in pp
    # the tiny checkpoint is fp32 and untied: the engine holds exactly its parameters' bytes
    assert tg["weight_bytes"] == _checkpoint_bytes(model)
    bw = tg["bandwidth"]
    assert bw["threads"] == 1 and bw["nbytes"] == 8 << 20 and bw["repeats"] == bandwidth.DEFAULT_PROBE_REPEATS
    assert bw["bytes_per_s"] == pytest.approx(2 * bw["nbytes"] / bw["best_s"])
    assert bw["weight_read_bytes_per_s"] == pytest.approx(tg["weight_bytes"] * tg["tokens_per_s"])
    assert bw["share"] == pytest.approx(bw["weight_read_bytes_per_s"] / bw["bytes_per_s"])

    text = capsys.readouterr().out
    assert re.search(r"^engine   llama, .*, 1 thread, prefix caching off$", text, re.M), text
    assert re.search(r"^pp512 +deepinfer +1 thread, 512 prompt tokens: +\d+\.\d\d ± \d+\.\d\d tok/s "
                     r"\(2 runs, \d+\.\d{3} s each\)$", text, re.M), text
    assert re.search(r"^tg128 +deepinfer +1 thread, 128 generated tokens after a 16-token prompt: +\d+\.\d\d ± "
                     r"\d+\.\d\d tok/s \(2 runs, \d+\.\d{3} s each\)$", text, re.M), text
    assert re.search(r"^tg128 +bandwidth +copy \d+\.\d\d GB/s \(STREAM-like copy of 8 MiB fp32, read \+ write "
                     r"bytes, best of 5, 1 thread\)$", text, re.M), text
    assert re.search(r"^tg128 +bandwidth +read \d+\.\d\d GB/s \(a sum over 8 MiB fp32, bytes read, best of 5, "
                     r"1 thread\)$", text, re.M), text
    assert re.search(rf"^tg128 +deepinfer +weights {tg['weight_bytes'] / 1e6:.1f} MB read per token x "
                     r"\d+\.\d\d tok/s = \d+\.\d\d GB/s = \d+\.\d% of the copy bandwidth, \d+\.\d% of the read$",
                     text, re.M), text
    assert bw["read_share"] == pytest.approx(bw["weight_read_bytes_per_s"] / bw["read_bytes_per_s"])


def _checkpoint_bytes(path: str) -> int:
    """The bytes of every tensor the checkpoint's safetensors files store."""
    from pathlib import Path

    from safetensors import safe_open

    total = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118 (safe_open is no dict)
    return total


@pytest.mark.bench
def test_a_prompt_at_a_depth_computes_only_its_own_tokens(tiny_checkpoint, capsys):
    """ppN@dD runs each request's context alone first; the timed request finds all of it cached
    (`time_request` checks the cached count and raises otherwise)."""
    model = tiny_checkpoint("llama")
    assert cli.main(["bench", "--model", model, "--workload", "pp32@d64", "--workload", "tg8@d64",
                     "--repetitions", "1", "--threads", "1", "--num-blocks", "64"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^pp32@d64 +deepinfer +1 thread, 32 prompt tokens at depth 64: ", text, re.M), text
    assert re.search(r"^tg8@d64 +deepinfer +1 thread, 8 generated tokens after a 16-token prompt at depth 64: ",
                     text, re.M), text
    assert "prefix caching on (for the depth's context)" in text


def test_both_engines_default_to_2_threads_and_the_engine_to_no_prefix_caching():
    from deepinfer.engine_args import EngineArgs

    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--workload", "pp512"])
    assert lb.bench_threads(args) == 2 and args.repetitions == lb.DEFAULT_REPETITIONS == 5
    engine = EngineArgs.from_cli_args(lb._engine_args(args, lb.bench_threads(args), ["pp512"]))
    assert engine.num_threads == 2 and engine.enable_prefix_caching is False
    args = parser.parse_args(["bench", "--workload", "tg128", "--threads", "3", "--max-model-len", "64"])
    engine = EngineArgs.from_cli_args(lb._engine_args(args, lb.bench_threads(args), ["tg128", "pp512"]))
    assert engine.num_threads == 3 and engine.max_model_len == 512 + 1  # room for pp512's request
    # at a depth: room for the context too, and prefix caching on where a ppN's context is cached first
    args = parser.parse_args(["bench", "--workload", "pp512@d4096", "--workload", "tg128@d4096"])
    engine = EngineArgs.from_cli_args(lb._engine_args(args, 2, ["pp512@d4096", "tg128@d4096"]))
    assert engine.enable_prefix_caching is True and engine.max_model_len is None  # unset: the model's context
    engine = EngineArgs.from_cli_args(lb._engine_args(args, 2, ["tg128@d4096"]))
    assert engine.enable_prefix_caching is False


def test_depth_shapes_and_names():
    assert lb.shape_of("tg128@d4096") == lb.Shape(16, 129, "decode", 128, depth=4096)
    assert lb.shape_of("pp512@d4096") == lb.Shape(512, 1, "prompt", 512, depth=4096)
    assert lb.shape_of("pp64") == lb.Shape(64, 1, "prompt", 64)
    tg = lb.llama_bench_workload("tg128@d4096", VOCAB, repetitions=1)
    assert [len(p) for p in tg.prompts] == [4096 + 16] * 2
    for bad in ("pp0", "tg128@4096", "pp512@d", "qq1"):
        with pytest.raises(ValueError, match=f"unknown llama-bench workload {bad!r}"):
            lb.shape_of(bad)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--workload", "tg128@x"])
    assert lb.peer_flash_attention("tg128@d4096") == (False, True) and lb.peer_flash_attention("tg128") == (None,)


def test_workloads_are_fixed_random_ids_one_request_per_run_plus_a_warm_up():
    pp = lb.llama_bench_workload("pp512", VOCAB, repetitions=3)
    tg = lb.llama_bench_workload("tg128", VOCAB, repetitions=3)
    assert [len(p) for p in pp.prompts] == [512] * 4 and pp.output_lens == [1] * 4 and pp.ignore_eos
    assert [len(p) for p in tg.prompts] == [16] * 4 and tg.output_lens == [129] * 4
    assert len({tuple(p) for p in pp.prompts}) == 4  # a fresh prompt every run
    assert all(100 <= t < VOCAB for p in pp.prompts + tg.prompts for t in p)
    assert lb.llama_bench_workload("pp512", VOCAB, repetitions=3).prompts == pp.prompts  # same ids every run
    with pytest.raises(ValueError, match="repetitions must be a positive integer, got 0"):
        lb.llama_bench_workload("tg128", VOCAB, repetitions=0)
    with pytest.raises(ValueError, match="unknown llama-bench workload 'pq1'"):
        lb.llama_bench_workload("pq1", VOCAB, repetitions=1)


def test_the_peer_times_the_same_requests_and_the_ratio_is_of_the_means(monkeypatch, capsys):
    """The llama.cpp peer gets the workload as is (warm-up first) on the bench's threads; its driver's
    per-request timings become the runs, the warm-up dropped; the ratio is DeepInfer's mean / the peer's."""
    workload = lb.llama_bench_workload("tg128", VOCAB, repetitions=2)
    jobs = []

    def fake_run(model_path, w, parallel=1, threads=2, **extra):
        jobs.append(nlc.build_job(model_path, w, parallel, threads, **extra))
        requests = [{"tokens": 129, "prompt_s": 0.01, "decode_s": s} for s in (9.0, 1.0, 2.0)]
        info = {"seconds": 12.0, "output_tokens": 3 * 129, "requests": requests, "threads": threads, "parallel": 1}
        return nlc.parse_result(json.dumps(info), w, parallel)

    monkeypatch.setattr(nlc, "run_node_llama_cpp", fake_run)
    theirs = lb.run_peer_shape(SimpleNamespace(format="gguf", path="/m.gguf"), workload, threads=3)
    assert jobs[0]["prompts"] == workload.prompts and jobs[0]["output_lens"] == [129] * 3
    assert jobs[0]["threads"] == 3 and jobs[0]["parallel"] == 1
    assert theirs.engine == "llama.cpp" and theirs.runs_s == [1.0, 2.0] and theirs.threads == 3
    assert theirs.tokens_per_s == pytest.approx((128 + 64) / 2)
    ours = lb.make_result("deepinfer", "tg128", 3, [(0.01, 0.5), (0.01, 1.0)])  # 256 and 128 tok/s
    print_ratios([ours, theirs])
    assert "tg128    deepinfer / llama.cpp: 2.00x" in capsys.readouterr().out
    # pp512 times the prompt, not the decode
    pp = lb.make_result("llama.cpp", "pp512", 2, [(0.25, 0.0), (0.5, 0.0)])
    assert pp.runs_s == [0.25, 0.5] and pp.tokens_per_s == pytest.approx((2048 + 1024) / 2)
    # a ppN at a depth: the driver evaluates each request's context untimed first
    deep = lb.llama_bench_workload("pp512@d64", VOCAB, repetitions=2)
    monkeypatch.setattr(nlc, "run_node_llama_cpp", lambda path, w, parallel=1, threads=2, **extra: (
        jobs.append(nlc.build_job(path, w, parallel, threads, **extra)) or nlc.parse_result(json.dumps(
            {"seconds": 1.0, "output_tokens": 3, "requests": [{"tokens": 1, "prompt_s": 0.1, "decode_s": 0}] * 3}),
            w, parallel)))
    theirs = lb.run_peer_shape(SimpleNamespace(format="gguf", path="/m.gguf"), deep, threads=2, flash_attention=True)
    assert jobs[-1]["depths"] == [64] * 3 and jobs[-1]["flash_attention"] is True and theirs.engine == "llama.cpp-fa"
    with pytest.raises(RuntimeError, match="no per-request timings"):
        monkeypatch.setattr(nlc, "run_node_llama_cpp", lambda *a, **k: (theirs, {"requests": None}))
        lb.run_peer_shape(SimpleNamespace(format="gguf", path="/m.gguf"), workload, threads=3)


def test_bandwidth_arithmetic():
    assert bandwidth.copy_bytes_per_s(1000, 0.5) == 4000  # read + write
    assert bandwidth.weight_read_bytes_per_s(100_000_000, 50) == 5e9
    assert bandwidth.bandwidth_share(100_000_000, 50, 20e9) == pytest.approx(0.25)
    probe = bandwidth.CopyProbe(nbytes=256 << 20, best_s=0.025, threads=2, repeats=5)
    assert probe.bytes_per_s == pytest.approx(2 * 268435456 / 0.025)
    assert probe.as_json()["bytes_per_s"] == probe.bytes_per_s
    with pytest.raises(ValueError, match="positive bytes and seconds"):
        bandwidth.copy_bytes_per_s(1000, 0)
    with pytest.raises(ValueError, match="copy bandwidth must be positive"):
        bandwidth.bandwidth_share(1, 1, 0)


def test_the_copy_probe_measures_on_the_given_threads_and_restores_torch_s():
    before = torch.get_num_threads()
    probe = bandwidth.measure_copy_bandwidth(threads=1, nbytes=4 << 20, repeats=2)
    assert torch.get_num_threads() == before
    assert probe.nbytes == 4 << 20 and probe.threads == 1 and probe.repeats == 2 and probe.best_s > 0
    assert probe.bytes_per_s == 2 * probe.nbytes / probe.best_s
    read = bandwidth.measure_read_bandwidth(threads=1, nbytes=4 << 20, repeats=2)
    assert torch.get_num_threads() == before
    assert read.nbytes == 4 << 20 and read.threads == 1 and read.repeats == 2 and read.best_s > 0
    assert read.bytes_per_s == read.nbytes / read.best_s  # each byte once


def test_gguf_tensor_bytes_sums_every_stored_tensor(tmp_path):
    """An independent count: a GGUF written by the gguf package, with f32, f16 and Q8_0 tensors (Q8_0:
    34 bytes per block of 32 values)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("a", np.ones((4, 8), dtype=np.float32))
    writer.add_tensor("b", np.ones((3, 64), dtype=np.float16))
    q8 = quantize(np.linspace(-1, 1, 5 * 128, dtype=np.float32).reshape(5, 128), GGMLQuantizationType.Q8_0)
    writer.add_tensor("c", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert bandwidth.gguf_tensor_bytes(str(path)) == 4 * 8 * 4 + 3 * 64 * 2 + 5 * (128 // 32) * 34


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_node_llama_cpp_times_each_request_to_its_first_token_and_to_its_last(default_gguf_path):
    """The .mjs driver's per-request timings on the embedded model (1 thread): a 1-token request has
    no decode time, a longer one has; skipped without `make peers` (an optional 730 MB npm install)."""
    from deepinfer.entrypoints.bench.common import Workload

    directory = nlc.install_dir()
    if nlc.installed_version(directory) is None:
        pytest.skip(f"node-llama-cpp is not installed in {directory}: run `make peers`")
    workload = Workload("w", [[1, 2, 3, 4], [5, 6, 7]], [1, 6])
    result, info = nlc.run_node_llama_cpp(default_gguf_path, workload, parallel=1, threads=1, directory=directory)
    first, second = info["requests"]
    assert (first["tokens"], second["tokens"]) == (1, 6) and result.output_tokens == 7
    assert first["prompt_s"] > 0 and first["decode_s"] == 0
    assert second["prompt_s"] > 0 and second["decode_s"] > 0
    assert first["prompt_s"] + second["prompt_s"] + second["decode_s"] <= result.seconds
