"""What `deepinfer bench` prints: result and speculative-decoding lines, the peer ratios, the
engine line, the workload progress, and the tables of the prefix workload and of `bench serve`.

Every line of the offline benchmark starts with its workload's name padded to 8 characters, so
the output lines up whatever ran.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

if TYPE_CHECKING:
    from deepinfer.entrypoints.bench.common import BenchResult

PERCENTILES = (50, 90, 99)  # the latency percentiles of `bench serve`


def format_result(r: BenchResult) -> str:
    batch = "" if r.batch is None else f"batch {r.batch:2d} "
    return (f"{r.workload:8s} {r.engine:15s} {batch}{r.output_tokens:6d} tokens in {r.seconds:8.2f} s "
            f"= {r.tokens_per_s:8.2f} tok/s")


def format_spec(r: BenchResult) -> str:
    """Acceptance rate and mean accepted length of a speculative run."""
    s, batch = r.spec, "" if r.batch is None else f" batch {r.batch}"
    return (f"{r.workload:8s} {r.engine}{batch}: acceptance rate {s.acceptance_rate:.3f} "
            f"({s.num_accepted_tokens} of {s.num_draft_tokens} draft tokens), mean accepted length "
            f"{s.mean_accepted_length:.2f} over {s.num_drafts} verification steps")


def print_result(r: BenchResult) -> None:
    """The result line of one run (see format_result)."""
    print(format_result(r), flush=True)


def print_spec(results: list[BenchResult]) -> None:
    """The speculative-decoding line of each run that has one."""
    for r in results:
        if r.spec is not None:
            print(format_spec(r), flush=True)


def print_ratios(results: list[BenchResult]) -> None:
    """deepinfer / peer tokens-per-second ratio per workload, for each peer result."""
    ours = {r.workload: r for r in results if r.engine.startswith("deepinfer")}
    for r in results:
        if not r.engine.startswith("deepinfer"):
            ratio = ours[r.workload].tokens_per_s / r.tokens_per_s
            print(f"{r.workload:8s} deepinfer / {r.engine}: {ratio:.2f}x")


def engine_line(llm) -> str:
    """What the measured engine is, so runs can be compared: e.g. `engine   llama, float32 on cpu,
    tensor-parallel-size 2, max-model-len 64`."""
    engine = llm.engine
    model_type = engine.source.hf_config.model_type
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    return (f"engine   {model_type}, {dtype} on {engine.runner.device}, tensor-parallel-size "
            f"{engine.config.tensor_parallel_size}, max-model-len {engine.max_model_len}")


class WorkloadProgress:
    """A bar over the workloads (stderr, only on a terminal) and a line as each one starts."""

    def __init__(self, names: list[str]):
        self.bar = tqdm(total=len(names), desc="bench", unit="workload", disable=None)
        self.num_started = 0

    def start(self, name: str, what: str = "") -> None:
        if self.num_started:
            self.bar.update(1)
        self.num_started += 1
        self.bar.set_description(f"bench {name}")
        tqdm.write(f"workload {name}: running{' ' + what if what else ''}...", file=sys.stderr)

    def close(self) -> None:
        if self.num_started:
            self.bar.update(1)
        self.bar.close()


def format_prefix_table(results: list[BenchResult]) -> list[str]:
    """The prefix workload's lines from its three `PrefixResult`s (cold, memory hit, after restart):
    the setup, the table, the first requests, the TTFT ratios and whether the outputs agree."""
    s = results[0].setup
    cold, hit, restart = results
    n, q = s["num_requests"], s["question_tokens"]
    lines = [
        f"prefix   cpu: {s['cpu']} ({s['num_cpus']} cpus, load average {s['load_average'][0]:.2f} at start, "
        f"{s['load_average'][1]:.2f} at end)",
        f"prefix   model: {s['model']} ({s['model_type']}), {s['device']} {s['dtype']}, "
        f"{s['num_kv_blocks']} KV blocks of {s['block_size']} tokens",
        f"prefix   {n} requests one at a time, then {n} other questions at once: shared prefix "
        f"{s['shared_prefix_tokens']} tokens (--prefix-len {s['prefix_len']}) + {q[0]}-{q[1]} tokens each, "
        f"{s['max_tokens']} output tokens (greedy, ignore_eos)",
        f"prefix   {'':15s} {'one at a time':^33s} | {'all at once':^38s}",
        f"prefix   {'configuration':15s} {'TTFT p50':>10s} {'TTFT p90':>10s} {'cached/req':>11s} | "
        f"{'seconds':>8s} {'out tok/s':>9s} {'all tok/s':>9s} {'cached/req':>10s}",
    ]
    for r in results:
        lines.append(f"prefix   {r.config:15s} {r.ttft_p50_s * 1e3:8.1f}ms {r.ttft_p90_s * 1e3:8.1f}ms "
                     f"{r.mean_num_cached_tokens:11.1f} | {r.seconds:8.2f} {r.tokens_per_s:9.2f} "
                     f"{r.batch_total_tokens_per_s:9.1f} {r.batch_mean_num_cached_tokens:10.1f}")
    w = hit.prefix_warmup
    lines.append(f"prefix   memory hit: its prefix warm-up (cold, caching on): TTFT {w['ttft_s'] * 1e3:.1f}ms, "
                 f"{w['num_cached_tokens']} cached tokens")
    f = restart.first_request
    disk = f.get("prefix_cache_disk_hits", 0)
    lines.append(f"prefix   after restart: first request TTFT {f['ttft_s'] * 1e3:.1f}ms, {f['num_cached_tokens']} "
                 f"cached tokens, {disk} of them read from the cache directory "
                 f"({f.get('kv_cache_dir_files_read', 0)} files)"
                 + ("" if disk > 0 else "  WARNING: no disk hit"))
    lines.append(f"prefix   TTFT p50 cold / memory hit: {hit.vs_cold['ttft_p50_ratio']:.2f}x; "
                 f"cold / after restart: {restart.vs_cold['ttft_p50_ratio']:.2f}x")
    for r in (hit, restart):
        mism = r.vs_cold["mismatched_requests"]
        total = 2 * n
        lines.append(f"prefix   outputs {r.config} vs cold: " + (
            f"identical ({total} of {total} requests)" if not mism
            else f"MISMATCH in {len(mism)} of {total} requests ({', '.join(map(str, mism))})"))
    return lines


def print_serve_summary(s: dict) -> None:
    """The table of `deepinfer bench serve` (the summary of `workloads.serve.summarize`)."""
    rows = [("Successful requests", s["successful_requests"]), ("Failed requests", s["failed_requests"]),
            ("Benchmark duration (s)", s["duration_s"]), ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", s["request_throughput"]),
            ("Output token throughput (tok/s)", s["output_throughput"]),
            ("Total token throughput (tok/s)", s["total_token_throughput"])]
    print(f"{' Serving Benchmark Result ':=^56}")
    mode = (f"concurrency {s['concurrency']}" if s["concurrency"] else "") + \
        (f" rate {s['request_rate']}/s" if s["request_rate"] else "")
    print(f"{'Server':<36}{s['url']} ({s['model']}, {mode.strip()})")
    for label, value in rows:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label + ':':<36}{shown:>20}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{' ' + title + ' ':-^56}")
        for key in [f"mean_{name}_ms"] + [f"p{p}_{name}_ms" for p in PERCENTILES]:
            label = key.replace(f"_{name}_ms", "").replace("mean", "Mean").replace("p", "P")
            value = s[key]
            print(f"{label + ' ' + name.upper() + ' (ms):':<36}"
                  f"{'n/a' if value is None else f'{value:.2f}':>20}")
    if s["total_output_tokens"] != s["expected_output_tokens"] and not s["failed_requests"]:
        print(f"note: {s['total_output_tokens']} tokens generated, the workload asks for "
              f"{s['expected_output_tokens']}")
    for error in s["errors"]:
        print(f"error: {error}")
    print("=" * 56)
