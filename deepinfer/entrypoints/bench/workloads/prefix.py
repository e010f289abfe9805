"""The prefix workload: many requests behind one long shared system prompt, with and without the cache.

Every request is the same system prompt (about --prefix-len tokens, default 1500: the support
policies of a made-up outdoor shop) followed by a short distinct question (20-40 tokens, opened by
a customer's name so that no two share a first token, hence no cache block past the prefix),
wrapped in the model's chat template when it has one. The text is drawn from fixed sentence templates
with a seeded generator (--prefix-seed), so every run and every configuration sees the same token
ids; a model without a tokenizer (`--load-format dummy`) gets random token ids instead. Greedy,
ignore_eos, --max-tokens output tokens per request (default 16).

One invocation runs the same requests under three configurations of the same model:

    cold           enable_prefix_caching=False
    memory hit     caching on; one warm-up request carrying the shared prefix first (its TTFT is
                   the cold TTFT with caching on), then the workload: each request finds the
                   prefix in memory
    after restart  a first engine (this process) runs that warm-up with kv_cache_dir set and
                   closes (flushing the directory); then a fresh process (`python -m
                   deepinfer.entrypoints.bench.workloads.prefix --child SPEC`) builds a new
                   engine on the same directory and runs the workload: its first request reads
                   the prefix from disk, the later ones find it in memory

Each engine first runs a short unrelated request (kernels and allocations warm, nothing of the
shared prefix cached). Then, per configuration:

  * one at a time: --num-requests requests (default 16), each submitted alone and stepped until
    its first output token (TTFT: submit to first token, no queueing) and then to its end;
    TTFT p50 / p90 and the mean `num_cached_tokens`;
  * all at once: --num-requests *other* questions behind the same prefix (so a configuration
    with caching hits the shared prefix only, not the prompts it has just run), in one
    `generate`: output tokens / s and all (prompt + output) tokens / s.

Reported: a table of those figures, the first request of each configuration (for "after
restart", the disk hit), the TTFT p50 ratios cold / memory hit and cold / after restart, and
whether the three configurations produced the same tokens (greedy: they should). The header
names the CPU (/proc/cpuinfo), the model, the device and the load average (another job on the
machine makes timings noisy). The cache directory is a temporary one unless --kv-cache-dir is
given (a directory that already holds this model's cache from other prompts may give the restart
run more hits than the shared prefix). The default KV cache (1GiB) is raised to 2GiB so that the
cold batch of 16 full prompts fits.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from deepinfer.entrypoints.bench.common import BenchResult, engine_label, run_alone
from deepinfer.entrypoints.bench.report import format_prefix_table
from deepinfer.entrypoints.bench.workloads.prefix_prompts import PrefixPrompts, prefix_prompts
from deepinfer.entrypoints.engine_args import engine_kwargs
from deepinfer.sampling_params import SamplingParams

DEFAULT_PREFIX_LEN = 1500
DEFAULT_NUM_REQUESTS = 16
DEFAULT_MAX_TOKENS = 16
CONFIGS = ("cold", "memory hit", "after restart")


def add_prefix_args(p) -> None:
    """The prefix workload's own flags (`--num-requests` and `--max-tokens` are shared)."""
    p.add_argument("--prefix-len", type=int, default=DEFAULT_PREFIX_LEN,
                   help=f"prefix workload: tokens of the shared system prompt (default {DEFAULT_PREFIX_LEN})")
    p.add_argument("--prefix-seed", type=int, default=0, help="prefix workload: seed of its text")
    # the restart run's cache directory is the engine's --kv-cache-dir (default: a temporary one)


# -- running one configuration ------------------------------------------------------------------

def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _checked(out):
    if out.error is not None:
        raise RuntimeError(f"deepinfer failed request {out.request_id}: {out.error}")
    return out


_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_disk_hits", "kv_cache_dir_files_read",
             "kv_cache_dir_bytes_read", "num_preemptions")


def _deltas(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in _COUNTERS if k in before and k in after}


def run_config(llm, prompts: PrefixPrompts, max_tokens: int, prefix_warmup: bool) -> dict:
    """The engine warm-up, the prefix warm-up (if asked), the requests one at a time, then the
    batch; figures and token ids as a JSON-able dict."""
    params = _params(max_tokens)
    engine = llm.engine
    run_alone(engine, prompts.engine_warmup, _params(2))
    result: dict = {}
    if prefix_warmup:
        ttft, _, out = run_alone(engine, prompts.prefix_warmup, params)
        result["prefix_warmup"] = {"ttft_s": ttft, "num_cached_tokens": out.num_cached_tokens}
    before = llm.get_metrics()
    ttfts, cached, tokens = [], [], []
    for i, prompt in enumerate(prompts.serial):
        ttft, _, out = run_alone(engine, prompt, params)
        ttfts.append(ttft)
        cached.append(out.num_cached_tokens)
        tokens.append(list(out.outputs[0].token_ids))
        if i == 0:
            result["first_request"] = {"ttft_s": ttft, "num_cached_tokens": out.num_cached_tokens,
                                       **_deltas(before, llm.get_metrics())}
    middle = llm.get_metrics()
    start = time.perf_counter()
    outs = [_checked(o) for o in llm.generate(prompts.batch, params, use_tqdm=False)]
    seconds = time.perf_counter() - start
    return result | {
        "ttfts_s": ttfts, "num_cached_tokens": cached, "serial_counters": _deltas(before, middle),
        "batch_seconds": seconds, "batch_num_cached_tokens": [o.num_cached_tokens for o in outs],
        "batch_prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "batch_counters": _deltas(middle, llm.get_metrics()),
        "serial_token_ids": tokens, "batch_token_ids": [list(o.outputs[0].token_ids) for o in outs]}


# -- the three configurations -------------------------------------------------------------------

@dataclass
class PrefixResult(BenchResult):
    """One configuration: the batch run's throughput (BenchResult's fields) and the TTFT figures
    of the requests run one at a time."""

    config: str = ""
    ttft_p50_s: float = 0.0
    ttft_p90_s: float = 0.0
    ttfts_s: list[float] = field(default_factory=list)
    mean_num_cached_tokens: float = 0.0  # the requests run one at a time
    batch_mean_num_cached_tokens: float = 0.0
    batch_prompt_tokens: int = 0
    batch_total_tokens_per_s: float = 0.0  # prompt + output tokens of the batch per second
    first_request: dict | None = None  # the first of the requests run one at a time
    prefix_warmup: dict | None = None  # memory hit: the warm-up (cold with caching on)
    writer: dict | None = None  # after restart: the first engine that filled the cache directory
    counters: dict | None = None  # engine counter deltas over the one-at-a-time and the batch runs
    vs_cold: dict | None = None  # TTFT p50 ratio and output agreement against the cold run
    setup: dict | None = None


def run_prefix(args) -> list[BenchResult]:
    """Cold, memory hit and after restart on the same requests; prints the table and returns one
    result per configuration."""
    num_requests = args.num_requests or DEFAULT_NUM_REQUESTS
    max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS
    prefix_len = args.prefix_len
    kwargs = _engine_kwargs(args, num_requests)
    cache_dir = args.kv_cache_dir
    own_dir = cache_dir is None
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="deepinfer-bench-prefix-")
    load_before = _load_average()
    try:
        runs, prompts, info = {}, None, {}
        for name, caching in (("cold", False), ("memory hit", True)):
            start = time.perf_counter()
            llm = _build(args.model, kwargs, enable_prefix_caching=caching, kv_cache_dir=None)
            if prompts is None:
                prompts = prefix_prompts(llm, prefix_len, num_requests, args.prefix_seed)
                info = _describe(llm)
            runs[name] = run_config(llm, prompts, max_tokens, prefix_warmup=caching)
            llm.close()
            del llm  # before the next engine is built
            gc.collect()
            _progress(name, start)
        start = time.perf_counter()
        writer = _fill_cache_dir(args.model, kwargs, cache_dir, prompts, max_tokens)
        gc.collect()  # its engine is gone before the fresh process builds one
        runs["after restart"] = run_child(args.model, kwargs, cache_dir, prompts, max_tokens)
        runs["after restart"]["writer"] = writer
        _progress("after restart", start)
    finally:
        if own_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    setup = info | {"cpu": cpu_model_name(), "num_cpus": os.cpu_count(), "load_average": [load_before,
                    _load_average()], "num_requests": num_requests, "max_tokens": max_tokens,
                    "prefix_len": prefix_len, "shared_prefix_tokens": prompts.shared,
                    "question_tokens": [min(prompts.question_lens), max(prompts.question_lens)],
                    "kv_cache_dir": None if own_dir else cache_dir,
                    "kv_cache_memory": kwargs["kv_cache_memory"]}
    results = _results(runs, setup, engine_label(kwargs.get("speculative_method")))
    for line in format_prefix_table(results):
        print(line, flush=True)
    return results


def _progress(config: str, start: float) -> None:
    print(f"prefix   {config}: ran in {time.perf_counter() - start:.1f} s (engine start included)", flush=True)


def _engine_kwargs(args, num_requests: int) -> dict:
    kwargs = engine_kwargs(args)
    kwargs["max_num_seqs"] = max(kwargs["max_num_seqs"], num_requests)
    if kwargs["kv_cache_memory"] == "1GiB" and kwargs["num_blocks"] is None:
        kwargs["kv_cache_memory"] = "2GiB"  # the cold batch holds every full prompt at once
    return kwargs


def _build(model, kwargs: dict, **cache):
    from deepinfer.llm import LLM

    return LLM(model, **(kwargs | cache))


def _fill_cache_dir(model, kwargs: dict, cache_dir: str, prompts: PrefixPrompts, max_tokens: int) -> dict:
    """The first process of the restart run: an engine on `cache_dir` runs the prefix warm-up only
    and closes, which leaves the shared prefix's blocks in the directory."""
    llm = _build(model, kwargs, enable_prefix_caching=True, kv_cache_dir=cache_dir)
    ttft, _, out = run_alone(llm.engine, prompts.prefix_warmup, _params(max_tokens))
    llm.close()
    from deepinfer.worker.kv_disk import scan_kv_dir

    held = scan_kv_dir(cache_dir)  # what the directory holds once the writer has finished
    return {"ttft_s": ttft, "num_cached_tokens": out.num_cached_tokens, "kv_cache_dir_files": held["entries"],
            "kv_cache_dir_bytes": held["bytes"]}


def run_child(model, kwargs: dict, cache_dir: str, prompts: PrefixPrompts, max_tokens: int) -> dict:
    """The workload in a fresh process on `cache_dir` (see `child_main`)."""
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-prefix-child-") as tmp:
        spec = {"model": model, "engine_kwargs": kwargs, "kv_cache_dir": cache_dir, "max_tokens": max_tokens,
                "prompts": vars(prompts), "out": os.path.join(tmp, "result.json")}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        proc = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.bench.workloads.prefix", "--child",
                               spec_path], check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"the restart run's process exited with status {proc.returncode}")
        with open(spec["out"]) as f:
            return json.load(f)


def child_main(argv: list[str] | None = None) -> int:
    """`python -m deepinfer.entrypoints.bench.workloads.prefix --child SPEC`: build an engine on the
    spec's cache directory and run the workload; the figures go to the spec's `out` file."""
    p = argparse.ArgumentParser(prog="python -m deepinfer.entrypoints.bench.workloads.prefix")
    p.add_argument("--child", required=True, help="JSON spec written by the parent benchmark")
    with open(p.parse_args(argv).child) as f:
        spec = json.load(f)
    llm = _build(spec["model"], spec["engine_kwargs"], enable_prefix_caching=True,
                 kv_cache_dir=spec["kv_cache_dir"])
    result = run_config(llm, PrefixPrompts(**spec["prompts"]), spec["max_tokens"], prefix_warmup=False)
    llm.close()
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    return 0


# -- figures ------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _results(runs: dict, setup: dict, engine: str) -> list[PrefixResult]:
    cold = runs["cold"]
    results = []
    for name in CONFIGS:
        run = runs[name]
        out_tokens = sum(map(len, run["batch_token_ids"]))
        r = PrefixResult(engine, "prefix", run["batch_seconds"], out_tokens, config=name,
                         ttft_p50_s=percentile(run["ttfts_s"], 50), ttft_p90_s=percentile(run["ttfts_s"], 90),
                         ttfts_s=run["ttfts_s"], mean_num_cached_tokens=_mean(run["num_cached_tokens"]),
                         batch_mean_num_cached_tokens=_mean(run["batch_num_cached_tokens"]),
                         batch_prompt_tokens=run["batch_prompt_tokens"],
                         batch_total_tokens_per_s=(run["batch_prompt_tokens"] + out_tokens) / run["batch_seconds"],
                         first_request=run["first_request"], prefix_warmup=run.get("prefix_warmup"),
                         writer=run.get("writer"),
                         counters={"serial": run["serial_counters"], "batch": run["batch_counters"]}, setup=setup)
        if name != "cold":
            mismatched = [i for i, (a, b) in enumerate(zip(cold["serial_token_ids"] + cold["batch_token_ids"],
                                                           run["serial_token_ids"] + run["batch_token_ids"],
                                                           strict=True)) if a != b]
            r.vs_cold = {"ttft_p50_ratio": percentile(cold["ttfts_s"], 50) / r.ttft_p50_s,
                         "identical_outputs": not mismatched, "mismatched_requests": mismatched}
        results.append(r)
    return results


def _describe(llm) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    path = engine.source.path
    return {"model": os.path.basename(str(path).rstrip("/")) if path else "default",
            "model_path": str(path) if path else None,
            "model_type": engine.source.hf_config.model_type,
            "device": str(runner.device), "dtype": str(runner.dtype).replace("torch.", ""),
            "num_kv_blocks": llm.get_metrics().get("num_total_blocks"),
            "block_size": engine.config.cache.block_size}


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return float("nan")


if __name__ == "__main__":
    sys.exit(child_main())
