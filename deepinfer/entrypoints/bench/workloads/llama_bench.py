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
import re
import statistics
from dataclasses import dataclass, field

from deepinfer.entrypoints.bench.common import BenchResult, Workload, engine_label, run_alone
from deepinfer.entrypoints.bench.report import WorkloadProgress, engine_line
from deepinfer.entrypoints.engine_args import make_llm
from deepinfer.sampling_params import SamplingParams

LLAMA_BENCH_WORKLOADS = ("pp512", "tg128")  # and any ppN / tgN, at a depth with @dD: tg128@d4096
DEFAULT_THREADS = 2
DEFAULT_REPETITIONS = 5
SEED = 0
_NAME = re.compile(r"^(pp|tg)([1-9][0-9]*)(?:@d([0-9]+))?$")


@dataclass(frozen=True)
class Shape:
    """One llama-bench test: prompt length, output tokens per request, what is timed, and the depth
    (tokens of context already in the cache when the timed part starts: llama-bench's -d)."""

    prompt_len: int
    output_len: int  # tokens each request generates (greedy, EOS ignored)
    timed: str  # "prompt": submit to first token; "decode": first token to last
    measured_tokens: int  # the tokens the timed span covers
    depth: int = 0


def is_llama_bench(name: str) -> bool:
    return _NAME.match(name) is not None


def shape_of(name: str) -> Shape:
    """ppN: N prompt tokens timed to the first token; tgN: N decode steps after a 16-token prompt;
    either after @dD tokens of context (ValueError naming the workload otherwise)."""
    match = _NAME.match(name)
    if match is None:
        raise ValueError(f"unknown llama-bench workload {name!r}: ppN or tgN, optionally at a depth, e.g. "
                         f"pp512, tg128, tg128@d4096")
    kind, n, depth = match.group(1), int(match.group(2)), int(match.group(3) or 0)
    if kind == "pp":
        return Shape(prompt_len=n, output_len=1, timed="prompt", measured_tokens=n, depth=depth)
    return Shape(prompt_len=16, output_len=n + 1, timed="decode", measured_tokens=n, depth=depth)


def add_llama_bench_args(p) -> None:
    """pp512 / tg128's own flag (the thread count is the engine's --threads, default 2 here)."""
    p.add_argument("--repetitions", type=int, default=DEFAULT_REPETITIONS,
                   help=f"pp512 / tg128: timed runs per engine after one warm-up (default {DEFAULT_REPETITIONS})")


def llama_bench_workload(name: str, vocab_size: int, repetitions: int, seed: int = SEED) -> Workload:
    """`repetitions` + 1 requests of the shape `name` (the first is the warm-up), each of its own
    random token ids in [100, vocab_size) (its depth's context first); greedy, EOS ignored."""
    shape = shape_of(name)
    if repetitions < 1:
        raise ValueError(f"repetitions must be a positive integer, got {repetitions!r}")
    rng = random.Random(f"{name}-{seed}")
    length = shape.depth + shape.prompt_len
    prompts = [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(repetitions + 1)]
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
    shape = shape_of(name)
    runs = [prompt_s if shape.timed == "prompt" else decode_s for prompt_s, decode_s in timings]
    if not runs or min(runs) <= 0:
        raise RuntimeError(f"{engine} {name}: every repetition must take a positive time, got {runs}")
    return LlamaBenchResult(engine, name, sum(runs), shape.measured_tokens * len(runs), batch=1, threads=threads,
                            measured_tokens=shape.measured_tokens, runs_s=runs)


def time_request(engine, prompt: list[int], params: SamplingParams, cached: int = 0) -> tuple[float, float]:
    """Run one request alone on an idle engine: (seconds from submission to its first token,
    seconds from its first token to its last). Raises if it fails, falls short of max_tokens, or
    found fewer than `cached` of its prompt tokens in the prefix cache."""
    ttft, decode, out = run_alone(engine, prompt, params)
    produced = len(out.outputs[0].token_ids)
    if produced != params.max_tokens:
        raise RuntimeError(f"deepinfer produced {produced} tokens, expected {params.max_tokens}")
    if out.num_cached_tokens < cached:
        raise RuntimeError(f"deepinfer found {out.num_cached_tokens} of the {cached} context tokens in its prefix "
                           "cache")
    return ttft, decode


def run_deepinfer_shape(llm, workload: Workload, engine: str, threads: int) -> LlamaBenchResult:
    """Every request of `workload` alone, the first untimed (warm-up). A ppN at a depth first runs its
    context alone (untimed), so the timed request finds it in the prefix cache and computes N tokens."""
    shape, timings = shape_of(workload.name), []
    for prompt, params in zip(workload.prompts, workload.sampling_params(), strict=True):
        cached = 0
        if shape.depth and shape.timed == "prompt":
            time_request(llm.engine, prompt[:shape.depth], SamplingParams(max_tokens=1, ignore_eos=True))
            cached = shape.depth // llm.engine.config.cache.block_size * llm.engine.config.cache.block_size
        timings.append(time_request(llm.engine, prompt, params, cached))
    return make_result(engine, workload.name, threads, timings[1:])


def run_peer_shape(source, workload: Workload, threads: int, flash_attention: bool | None = None) -> LlamaBenchResult:
    """The llama.cpp peer (node-llama-cpp, one sequence) on the same requests and threads; its
    driver times each request the way `time_request` does, a ppN at a depth after its context."""
    from deepinfer.entrypoints.bench.peers import node_llama_cpp

    if source.format != "gguf":
        raise ValueError(f"the llama.cpp peer needs a .gguf model, got {source.path!r}")
    shape = shape_of(workload.name)
    extra = {"depths": [shape.depth] * len(workload.prompts)} if shape.depth and shape.timed == "prompt" else {}
    if flash_attention is not None:
        extra["flash_attention"] = flash_attention
    result, info = node_llama_cpp.run_node_llama_cpp(source.path, workload, parallel=1, threads=threads, **extra)
    if flash_attention is not None:
        result.engine += "-fa" if flash_attention else "-nofa"
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
    shape = shape_of(r.workload)
    what = (f"{shape.measured_tokens} prompt tokens" if shape.timed == "prompt"
            else f"{shape.measured_tokens} generated tokens after a {shape.prompt_len}-token prompt")
    what += f" at depth {shape.depth}" if shape.depth else ""
    runs = f"{_plural(len(r.runs_s), 'run')}, {statistics.fmean(r.runs_s):.3f} s each"
    return (f"{r.workload:12s} {r.engine:15s} {_plural(r.threads, 'thread')}, {what}: {r.tokens_per_s:9.2f} ± "
            f"{r.std_tokens_per_s:.2f} tok/s ({runs})")


def bandwidth_lines(probe, results: list[LlamaBenchResult], read=None) -> list[str]:
    """The copy probe's line (and the read probe's, given one) and, per tg128 result with weight bytes,
    its share of each (also stored on it)."""
    from deepinfer.entrypoints.bench.bandwidth import bandwidth_share, weight_read_bytes_per_s

    threads = _plural(probe.threads, "thread")
    lines = [f"tg128    bandwidth       copy {probe.bytes_per_s / 1e9:.2f} GB/s (STREAM-like copy of "
             f"{probe.nbytes / 2**20:.0f} MiB fp32, read + write bytes, best of {probe.repeats}, {threads})"]
    if read is not None:
        lines.append(f"tg128    bandwidth       read {read.bytes_per_s / 1e9:.2f} GB/s (a sum over "
                     f"{read.nbytes / 2**20:.0f} MiB fp32, bytes read, best of {read.repeats}, {threads})")
    for r in results:
        if r.workload != "tg128" or r.weight_bytes is None:
            continue
        achieved = weight_read_bytes_per_s(r.weight_bytes, r.tokens_per_s)
        share = bandwidth_share(r.weight_bytes, r.tokens_per_s, probe.bytes_per_s)
        r.bandwidth = probe.as_json() | {"weight_read_bytes_per_s": achieved, "share": share}
        line = (f"tg128    {r.engine:15s} weights {r.weight_bytes / 1e6:.1f} MB read per token x "
                f"{r.tokens_per_s:.2f} tok/s = {achieved / 1e9:.2f} GB/s = {share:.1%} of the copy bandwidth")
        if read is not None:
            read_share = bandwidth_share(r.weight_bytes, r.tokens_per_s, read.bytes_per_s)
            r.bandwidth |= {"read_bytes_per_s": read.bytes_per_s, "read_share": read_share}
            line += f", {read_share:.1%} of the read"
        lines.append(line)
    return lines


def peer_flash_attention(name: str) -> tuple[bool | None, ...]:
    """The peer's flash-attention settings to run: at a depth both (its best is the one to beat), else
    its default."""
    return (False, True) if shape_of(name).depth else (None,)


def bench_threads(args) -> int:
    """The thread count of both engines and the probe: --threads, else DEFAULT_THREADS (2)."""
    return args.threads or DEFAULT_THREADS


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _engine_args(args, threads: int, names: list[str]) -> argparse.Namespace:
    """The bench flags with the thread count set, room for the longest shape, and prefix caching off
    unless a ppN at a depth needs it (its context is cached by an untimed request first)."""
    ns = argparse.Namespace(**vars(args))
    shapes = [shape_of(n) for n in names]
    ns.enable_prefix_caching = any(s.depth and s.timed == "prompt" for s in shapes)
    ns.threads = threads  # the dest of --threads (EngineArgs.num_threads)
    need = max(s.depth + s.prompt_len + s.output_len for s in shapes)
    if ns.max_model_len is not None:
        ns.max_model_len = max(ns.max_model_len, need)
    return ns


def run_llama_bench(args, names: list[str], progress: WorkloadProgress) -> list[BenchResult]:
    """pp512 / tg128 (those of `names`) on one engine, each followed by the llama.cpp peer when
    asked for; after tg128, the copy probe and the bandwidth lines. The engine is closed at the end."""
    from deepinfer.entrypoints.bench.bandwidth import (
        engine_weight_bytes,
        gguf_tensor_bytes,
        measure_copy_bandwidth,
        measure_read_bandwidth,
    )

    threads = bench_threads(args)
    repetitions = args.repetitions
    peer = "llama.cpp" in (args.peer or [])
    if set(args.peer or []) - {"llama.cpp"}:
        print(f"{'/'.join(names):8s} only the llama.cpp peer runs pp512 / tg128; other peers are skipped", flush=True)
    results: list[LlamaBenchResult] = []
    engine_args = _engine_args(args, threads, names)
    with make_llm(engine_args) as llm:
        caching = "on (for the depth's context)" if engine_args.enable_prefix_caching else "off"
        print(engine_line(llm) + f", {_plural(threads, 'thread')}, prefix caching {caching}", flush=True)
        source, label = llm.engine.source, engine_label(args.speculative_method)
        for name in names:
            workload = llama_bench_workload(name, source.hf_config.vocab_size, repetitions)
            progress.start(name, f"{_plural(repetitions, 'run')} + 1 warm-up")
            ours = run_deepinfer_shape(llm, workload, label, threads)
            if name == "tg128":
                ours.weight_bytes = engine_weight_bytes(llm)
            print(format_llama_bench(ours), flush=True)
            results.append(ours)
            for flash_attention in (peer_flash_attention(name) if peer else ()):
                theirs = run_peer_shape(source, workload, threads, flash_attention)
                if name == "tg128":
                    theirs.weight_bytes = gguf_tensor_bytes(source.path)
                print(format_llama_bench(theirs), flush=True)
                results.append(theirs)
    if "tg128" in names:
        copy, read = measure_copy_bandwidth(threads), measure_read_bandwidth(threads)
        for line in bandwidth_lines(copy, results, read):
            print(line, flush=True)
    return results
