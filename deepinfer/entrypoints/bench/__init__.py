"""`deepinfer bench`: throughput on fixed workloads, optionally beside peers in the same run.

Workloads (same requests for every engine):
  cpu32   32 requests, prompt lengths U[32, 256] of random token ids, output lengths U[32, 256],
          seed 0, greedy, ignore_eos; reports useful output tokens per second.
  decode1 one request, a short prompt, 128 output tokens; reports tokens per second.
  long    16 requests of 2,048-token prompts and 256 outputs, run twice on the same model: with a
          sliding window of W = --window (128) on every layer, and with the full cache. Reports
          tokens/s of each and the KV bytes allocated per request against the formula S / L.
  copy    8 requests whose answers repeat or edit text of the prompt, run with plain and with
          speculative decoding (--speculative-method, default ngram) at batch 1 and 8; reports
          tokens/s of each, the ratio, the acceptance and whether the outputs agree (workloads.copy).
  prefix  --num-requests (16) requests behind one shared ~--prefix-len (1500) token system prompt,
          --max-tokens (16) outputs, run cold (no prefix cache), with the prefix cached in memory
          and after a restart on a --kv-cache-dir (a fresh process); reports TTFT p50/p90 one
          request at a time, mean cached tokens, batch tokens/s and the TTFT ratios (workloads.prefix).
  pp512   llama-bench's prompt figure: a fresh 512-token prompt (prefix caching off) alone, 512 / TTFT,
          mean ± stddev over --repetitions (5) runs after a warm-up, on --threads (default 2) threads.
  tg128   llama-bench's generation figure: 128 decode steps after a 16-token prompt (the prompt's time
          left out), tokens/s as pp512; then a STREAM-like copy probe and, per engine, its weight bytes
          per token x tokens/s as a share of the copy bandwidth (workloads.llama_bench, bench.bandwidth).
          Any ppN / tgN runs the same way, and @dD puts D tokens of context before it (llama-bench's -d:
          tg128@d4096 decodes at depth 4096; pp512@d4096 times 512 prompt tokens after a cached 4096),
          the llama.cpp peer with flash attention off and on.
  spec    four code-completion prompts one at a time, plain and with --speculative-model (or a
          --speculative-method): tok/s, acceptance, ratio, identical outputs; with --peer llama.cpp
          also llama.cpp plain and with the same draft model (workloads.spec).
  entrypoints  one 129-token request through an LLM in this process (what generate and chat run)
          and through a `deepinfer serve` child process, decode tokens/s of each and their ratio;
          with --busy N again beside N busy-loop processes (workloads.entrypoints).

Without --workload only cpu32 runs. Each workload prints a line as it starts, and a progress bar
over the workloads goes to stderr when it is a terminal. cpu32 and decode1 share one engine, whose
`engine` line comes first (model type, dtype, device, tensor-parallel size, max-model-len); every
engine bench builds is closed once its workload is done, its tensor-parallel ranks stopped.

Prompts are token ids, so a model without tokenizer files runs too (`--load-format dummy` on a
bare config.json). `--max-tokens N` caps each request's output length (default: as drawn) and
`--num-requests` sets cpu32's request count (default 32; prefix: 16); the prompts stay the same.

With `--speculative-method`, every workload runs with it (engine `deepinfer+ngram` or
`deepinfer+mtp`) and prints its acceptance rate and mean accepted length over the measured run.

`--peer hf` / `--peer llama.cpp` run the same requests (cpu32, decode1) in a peer after ours, and
the ratios are printed. llama.cpp (node-llama-cpp's prebuilt binaries, see peers.node_llama_cpp) runs
one request at a time (`llama.cpp`) and, for cpu32, also 16 parallel sequences (`llama.cpp-np16`);
pp512 and tg128 have the llama.cpp peer only, on the same thread count.
With `--load-format dummy` only DeepSeek-V4 has a peer: `--peer hf` runs
transformers' DeepseekV4ForCausalLM on our engine's own dummy weights, after our workloads and
with our engine dropped, one request at a time (`hf-batch1`; see peers.hf).

A model with compressed cache groups (DeepSeek-V4) also gets `kv` lines (see workloads.kv).

Layout: `common` (Workload, BenchResult, running one on our engine), `workloads/` (one module per
workload, `serve` for `deepinfer bench serve`), `peers/` (hf; llama.cpp through node-llama-cpp and
its .mjs driver, or llama-cpp-python), imported only when a peer is asked for, and `report` (the
printed lines and tables).
"""

from __future__ import annotations

import argparse
import importlib
import json

from deepinfer.entrypoints.bench.report import WorkloadProgress, print_ratios, print_spec
from deepinfer.entrypoints.bench.workloads import WORKLOADS
from deepinfer.entrypoints.bench.workloads.entrypoints import add_entrypoints_args
from deepinfer.entrypoints.bench.workloads.llama_bench import (
    LLAMA_BENCH_WORKLOADS,
    add_llama_bench_args,
    is_llama_bench,
    run_llama_bench,
)
from deepinfer.entrypoints.bench.workloads.long import run_long
from deepinfer.entrypoints.bench.workloads.serve import add_bench_serve_parser
from deepinfer.entrypoints.bench.workloads.throughput import run_engine_workloads

__all__ = ["BENCH_WORKLOADS", "add_bench_args", "add_bench_serve_parser", "run_bench", "selected_workloads"]

BENCH_WORKLOADS = (*WORKLOADS, "prefix", "entrypoints", "spec", *LLAMA_BENCH_WORKLOADS)


# workloads that build their own engines: (name, module, its run function), imported when asked for
_ONE_ENGINE_WORKLOADS = (
    ("copy", "deepinfer.entrypoints.bench.workloads.copy", "run_copy"),
    ("prefix", "deepinfer.entrypoints.bench.workloads.prefix", "run_prefix"),
    ("spec", "deepinfer.entrypoints.bench.workloads.spec", "run_spec"),
    ("entrypoints", "deepinfer.entrypoints.bench.workloads.entrypoints", "run_entrypoints"),
)


def add_bench_args(p) -> None:
    """The flags of the offline `deepinfer bench` (the engine's own flags come from engine_args)."""
    # imported here: the prefix workload's restart run starts `python -m` on that module, which
    # must not be imported already by this package's __init__
    from deepinfer.entrypoints.bench.workloads.prefix import add_prefix_args

    p.add_argument("--workload", action="append", type=workload_name, default=None, metavar="NAME",
                   help=f"workload to run (repeatable; default: cpu32): {', '.join(BENCH_WORKLOADS)}, "
                        "or ppN / tgN at a depth, e.g. tg128@d4096")
    p.add_argument("--num-requests", type=int, default=None, help="requests in cpu32 (32) and prefix (16)")
    p.add_argument("--peer", action="append", choices=["hf", "llama.cpp"], default=[],
                   help="also run a peer on the same requests (repeatable)")
    p.add_argument("--window", type=int, default=128, help="sliding window W of the long workload")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    add_prefix_args(p)
    add_llama_bench_args(p)
    add_entrypoints_args(p)


def workload_name(text: str) -> str:
    """argparse type of --workload: a named workload, or a llama-bench shape (ppN / tgN[@dD])."""
    if text in BENCH_WORKLOADS or is_llama_bench(text):
        return text
    raise argparse.ArgumentTypeError(f"unknown workload {text!r}: choose from {', '.join(BENCH_WORKLOADS)}, "
                                     f"or ppN / tgN at a depth (tg128@d4096)")


def selected_workloads(args) -> list[str]:
    """The workloads to run, in the order given; cpu32 alone without --workload."""
    return list(dict.fromkeys(args.workload or ["cpu32"]))


def run_bench(args) -> int:
    names = selected_workloads(args)
    progress = WorkloadProgress(names)
    max_tokens = args.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    dummy_peer = bool(args.peer) and args.load_format == "dummy"
    if dummy_peer:
        from deepinfer.entrypoints.bench.peers import check_dummy_peers

        check_dummy_peers(args)
    results = []
    if "long" in names:
        progress.start("long")
        results += run_long(args)
        print_spec(results)
        names = [n for n in names if n != "long"]
    for name, module, run in _ONE_ENGINE_WORKLOADS:
        if name in names:
            progress.start(name)
            results += getattr(importlib.import_module(module), run)(args)
            names = [n for n in names if n != name]
    llama_bench = [n for n in names if is_llama_bench(n)]
    if llama_bench:
        results += run_llama_bench(args, llama_bench, progress)
        names = [n for n in names if not is_llama_bench(n)]
    if names:
        results += run_engine_workloads(args, names, progress, dummy_peer)
    progress.close()
    print_ratios(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_json() for r in results], f, indent=2)
    return 0
