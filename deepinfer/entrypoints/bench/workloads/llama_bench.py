"""pp512 and tg128: llama-bench's two standard figures, on our engine and on the llama.cpp peer.

    pp512  a fresh 512-token prompt (prefix caching off), one output token: 512 / TTFT, reported as
           prompt tokens per second (llama-bench's pp512: one 512-token batch, n_ubatch 512; our
           default --max-num-batched-tokens is 512 as well)
    tg128  a 16-token prompt and 129 output tokens: 128 / (time from the first token to the last),
           reported as generated tokens per second; the prompt's evaluation and its first token are
           left out, so the figure times 128 decode steps, as llama-bench's tg128 does

Each request runs alone on an idle engine (batch 1), `--repetitions` times (default 5) after one
untimed warm-up request of the same shape; every request has its own random token ids (seed 0), and
the llama.cpp peer (`--peer llama.cpp`, node-llama-cpp on the same GGUF) gets exactly the same
requests, warm-up included, and times them the same way inside its driver. Both engines run on the
same thread count: --threads, default 2. Reported per engine: the mean tokens/s over the
repetitions with its sample standard deviation (llama-bench's `avg ± stddev`), and the ratio
DeepInfer / llama.cpp of the means (`print_ratios`).

tg128 also prints the memory-bandwidth lines (`bench.bandwidth`): a STREAM-like copy probe on the
same thread count, and per engine the weight bytes it reads per token times its tokens/s as a share
of that copy bandwidth. With --tensor-parallel-size > 1 our weight bytes are rank 0's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field

from deepinfer.entrypoints.bench.common import BenchResult, Workload, engine_label
from deepinfer.entrypoints.bench.report import WorkloadProgress, engine_line
from deepinfer.entrypoints.engine_args import make_llm
from deepinfer.sampling_params import SamplingParams

LLAMA_BENCH_WORKLOADS = ("pp512", "tg128")
DEFAULT_THREADS = 2
DEFAULT_REPETITIONS = 5
SEED = 0


@dataclass(frozen=True)
class Shape:
    """One llama-bench test: prompt length, output tokens per request, and what is timed."""

    prompt_len: int
    output_len: int  # tokens each request generates (greedy, EOS ignored)
    timed: str  # "prompt": submit to first token; "decode": first token to last
    measured_tokens: int  # the tokens the timed span covers


SHAPES = {
    "pp512": Shape(prompt_len=512, output_len=1, timed="prompt", measured_tokens=512),
    "tg128": Shape(prompt_len=16, output_len=129, timed="decode", measured_tokens=128),
}


def add_llama_bench_args(p) -> None:
    """pp512 / tg128's own flag (the thread count is the engine's --threads, default 2 here)."""
    p.add_argument("--repetitions", type=int, default=DEFAULT_REPETITIONS,
                   help=f"pp512 / tg128: timed runs per engine after one warm-up (default {DEFAULT_REPETITIONS})")


def llama_bench_workload(name: str, vocab_size: int, repetitions: int, seed: int = SEED) -> Workload:
    """`repetitions` + 1 requests of the shape `name` (the first is the warm-up), each of its own
    random token ids in [100, vocab_size); greedy, EOS ignored."""
    if name not in SHAPES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(SHAPES)}")
    if repetitions < 1:
        raise ValueError(f"repetitions must be a positive integer, got {repetitions!r}")
    shape, rng = SHAPES[name], random.Random(f"{name}-{seed}")
    prompts = [[rng.randrange(100, vocab_size) for _ in range(shape.prompt_len)] for _ in range(repetitions + 1)]
    return Workload(name, prompts, [shape.output_len] * (repetitions + 1))


@dataclass
class LlamaBenchResult(BenchResult):
    """One engine on pp512 or tg128: the timed seconds of each repetition (the warm-up left out).
    `output_tokens` counts the measured tokens of all repetitions (prompt tokens for pp512) and
    `tokens_per_s` is the mean of the repetitions' rates, as llama-bench reports it."""

    threads: int = 0
    measured_tokens: int = 0  # per repetition: 512 prompt tokens, or 128 generated tokens
    runs_s: list[float] = field(default_factory=list)
    weight_bytes: int | None = None  # tg128: the weight bytes this engine reads per token
    bandwidth: dict | None = None  # tg128: the copy probe and this engine's share of it

    @property
    def run_tokens_per_s(self) -> list[float]:
        return [self.measured_tokens / s for s in self.runs_s]

    @property
    def tokens_per_s(self) -> float:
        return statistics.fmean(self.run_tokens_per_s)

    @property
    def std_tokens_per_s(self) -> float:
        """The sample standard deviation over the repetitions (0 for a single one)."""
        rates = self.run_tokens_per_s
        return statistics.stdev(rates) if len(rates) > 1 else 0.0

    def as_json(self) -> dict:
        return super().as_json() | {"std_tokens_per_s": self.std_tokens_per_s,
                                    "run_tokens_per_s": self.run_tokens_per_s}


def make_result(engine: str, name: str, threads: int, timings: list[tuple[float, float]]) -> LlamaBenchResult:
    """The result from (prompt seconds, decode seconds) per timed repetition (the warm-up excluded)."""
    shape = SHAPES[name]
    runs = [prompt_s if shape.timed == "prompt" else decode_s for prompt_s, decode_s in timings]
    if not runs or min(runs) <= 0:
        raise RuntimeError(f"{engine} {name}: every repetition must take a positive time, got {runs}")
    return LlamaBenchResult(engine, name, sum(runs), shape.measured_tokens * len(runs), batch=1, threads=threads,
                            measured_tokens=shape.measured_tokens, runs_s=runs)


def time_request(engine, prompt: list[int], params: SamplingParams) -> tuple[float, float]:
    """Run one request alone on an idle engine: (seconds from submission to its first token,
    seconds from its first token to its last). Raises if it fails or falls short of max_tokens."""
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine must be idle to time one request alone")
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    first = None
    while True:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if out.error is not None:
                raise RuntimeError(f"deepinfer failed request {request_id}: {out.error}")
            now = time.perf_counter()
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = now
            if out.finished:
                produced = len(out.outputs[0].token_ids)
                if produced != params.max_tokens:
                    raise RuntimeError(f"deepinfer produced {produced} tokens, expected {params.max_tokens}")
                return first - start, now - first


def run_deepinfer_shape(llm, workload: Workload, engine: str, threads: int) -> LlamaBenchResult:
    """Every request of `workload` alone, the first untimed (warm-up)."""
    params = workload.sampling_params()
    timings = [time_request(llm.engine, p, sp) for p, sp in zip(workload.prompts, params, strict=True)]
    return make_result(engine, workload.name, threads, timings[1:])


def run_peer_shape(source, workload: Workload, threads: int) -> LlamaBenchResult:
    """The llama.cpp peer (node-llama-cpp, one sequence) on the same requests and threads; its
    driver times each request the way `time_request` does."""
    from deepinfer.entrypoints.bench.peers import node_llama_cpp

    if source.format != "gguf":
        raise ValueError(f"the llama.cpp peer needs a .gguf model, got {source.path!r}")
    result, info = node_llama_cpp.run_node_llama_cpp(source.path, workload, parallel=1, threads=threads)
    print(node_llama_cpp.describe(info), flush=True)
    requests = info.get("requests")
    if not isinstance(requests, list) or len(requests) != len(workload.prompts):
        raise RuntimeError(f"the llama.cpp peer returned no per-request timings for {workload.name} "
                           f"(requests: {requests!r})")
    timings = [(float(r["prompt_s"]), float(r["decode_s"])) for r in requests]
    return make_result(result.engine, workload.name, threads, timings[1:])


def format_llama_bench(r: LlamaBenchResult) -> str:
    """e.g. `tg128    deepinfer       2 threads, 128 generated tokens after a 16-token prompt:
    45.67 ± 0.12 tok/s (5 runs, 2.803 s each)`."""
    shape = SHAPES[r.workload]
    what = (f"{shape.measured_tokens} prompt tokens" if shape.timed == "prompt"
            else f"{shape.measured_tokens} generated tokens after a {shape.prompt_len}-token prompt")
    runs = f"{_plural(len(r.runs_s), 'run')}, {statistics.fmean(r.runs_s):.3f} s each"
    return (f"{r.workload:8s} {r.engine:15s} {_plural(r.threads, 'thread')}, {what}: {r.tokens_per_s:9.2f} ± "
            f"{r.std_tokens_per_s:.2f} tok/s ({runs})")


def bandwidth_lines(probe, results: list[LlamaBenchResult]) -> list[str]:
    """The copy probe's line and, per tg128 result with weight bytes, its share (also stored on it)."""
    from deepinfer.entrypoints.bench.bandwidth import bandwidth_share, weight_read_bytes_per_s

    lines = [f"tg128    bandwidth       copy {probe.bytes_per_s / 1e9:.2f} GB/s (STREAM-like copy of "
             f"{probe.nbytes / 2**20:.0f} MiB fp32, read + write bytes, best of {probe.repeats}, "
             f"{_plural(probe.threads, 'thread')})"]
    for r in results:
        if r.workload != "tg128" or r.weight_bytes is None:
            continue
        achieved = weight_read_bytes_per_s(r.weight_bytes, r.tokens_per_s)
        share = bandwidth_share(r.weight_bytes, r.tokens_per_s, probe.bytes_per_s)
        r.bandwidth = probe.as_json() | {"weight_read_bytes_per_s": achieved, "share": share}
        lines.append(f"tg128    {r.engine:15s} weights {r.weight_bytes / 1e6:.1f} MB read per token x "
                     f"{r.tokens_per_s:.2f} tok/s = {achieved / 1e9:.2f} GB/s = {share:.1%} of the copy bandwidth")
    return lines


def bench_threads(args) -> int:
    """The thread count of both engines and the probe: --threads, else DEFAULT_THREADS (2)."""
    return args.threads or DEFAULT_THREADS


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _engine_args(args, threads: int) -> argparse.Namespace:
    """The bench flags with prefix caching off, the thread count set and room for the longest shape."""
    ns = argparse.Namespace(**vars(args))
    ns.enable_prefix_caching = False
    ns.threads = threads  # the dest of --threads (EngineArgs.num_threads)
    need = max(s.prompt_len + s.output_len for s in SHAPES.values())
    if ns.max_model_len is not None:
        ns.max_model_len = max(ns.max_model_len, need)
    return ns


def run_llama_bench(args, names: list[str], progress: WorkloadProgress) -> list[BenchResult]:
    """pp512 / tg128 (those of `names`) on one engine, each followed by the llama.cpp peer when
    asked for; after tg128, the copy probe and the bandwidth lines. The engine is closed at the end."""
    from deepinfer.entrypoints.bench.bandwidth import engine_weight_bytes, gguf_tensor_bytes, measure_copy_bandwidth

    threads = bench_threads(args)
    repetitions = args.repetitions
    peer = "llama.cpp" in (args.peer or [])
    if set(args.peer or []) - {"llama.cpp"}:
        print(f"{'/'.join(names):8s} only the llama.cpp peer runs pp512 / tg128; other peers are skipped", flush=True)
    results: list[LlamaBenchResult] = []
    with make_llm(_engine_args(args, threads)) as llm:
        print(engine_line(llm) + f", {_plural(threads, 'thread')}, prefix caching off", flush=True)
        source, label = llm.engine.source, engine_label(args.speculative_method)
        for name in names:
            workload = llama_bench_workload(name, source.hf_config.vocab_size, repetitions)
            progress.start(name, f"{_plural(repetitions, 'run')} + 1 warm-up")
            ours = run_deepinfer_shape(llm, workload, label, threads)
            if name == "tg128":
                ours.weight_bytes = engine_weight_bytes(llm)
            print(format_llama_bench(ours), flush=True)
            results.append(ours)
            if peer:
                theirs = run_peer_shape(source, workload, threads)
                if name == "tg128":
                    theirs.weight_bytes = gguf_tensor_bytes(source.path)
                print(format_llama_bench(theirs), flush=True)
                results.append(theirs)
    if "tg128" in names:
        for line in bandwidth_lines(measure_copy_bandwidth(threads), results):
            print(line, flush=True)
    return results
