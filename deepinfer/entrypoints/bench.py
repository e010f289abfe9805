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
          tokens/s of each, the ratio, the acceptance and whether the outputs agree (bench_copy).
  prefix  --num-requests (16) requests behind one shared ~--prefix-len (1500) token system prompt,
          --max-tokens (16) outputs, run cold (no prefix cache), with the prefix cached in memory
          and after a restart on a --kv-cache-dir (a fresh process); reports TTFT p50/p90 one
          request at a time, mean cached tokens, batch tokens/s and the TTFT ratios (bench_prefix).

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
the ratios are printed. llama.cpp (node-llama-cpp's prebuilt binaries, see bench_llama_cpp) runs
one request at a time (`llama.cpp`) and, for cpu32, also 16 parallel sequences (`llama.cpp-np16`).
With `--load-format dummy` only DeepSeek-V4 has a peer: `--peer hf` runs
transformers' DeepseekV4ForCausalLM on our engine's own dummy weights, after our workloads and
with our engine dropped, one request at a time (`hf-batch1`; see bench_peers).

A model with compressed cache groups (DeepSeek-V4) also gets `kv` lines (see bench_kv).
"""

from __future__ import annotations

import json
import sys

from tqdm.auto import tqdm

from deepinfer.entrypoints.bench_common import (
    WORKLOADS,
    BenchResult,
    Workload,
    engine_label,
    format_result,
    format_spec,
    make_workload,
    run_deepinfer,
)
from deepinfer.entrypoints.bench_kv import has_compressed_groups, kv_lines, workload_kv_line
from deepinfer.entrypoints.bench_long import run_long
from deepinfer.entrypoints.bench_prefix import add_prefix_args
from deepinfer.entrypoints.engine_args import make_llm

BENCH_WORKLOADS = (*WORKLOADS, "prefix")


def add_bench_args(p) -> None:
    p.add_argument("--workload", action="append", choices=BENCH_WORKLOADS, default=None,
                   help="workload to run (repeatable; default: cpu32)")
    p.add_argument("--num-requests", type=int, default=None, help="requests in cpu32 (32) and prefix (16)")
    p.add_argument("--peer", action="append", choices=["hf", "llama.cpp"], default=[],
                   help="also run a peer on the same requests (repeatable)")
    p.add_argument("--window", type=int, default=128, help="sliding window W of the long workload")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    add_prefix_args(p)


def selected_workloads(args) -> list[str]:
    """The workloads to run, in the order given; cpu32 alone without --workload."""
    return list(dict.fromkeys(args.workload or ["cpu32"]))


def run_bench(args) -> int:
    names = selected_workloads(args)
    progress = WorkloadProgress(names)
    max_tokens = getattr(args, "max_tokens", None)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    dummy_peer = bool(args.peer) and getattr(args, "load_format", "auto") == "dummy"
    if dummy_peer:
        check_dummy_peers(args)
    results = []
    if "long" in names:
        progress.start("long")
        results += run_long(args)
        _print_spec(results)
        names = [n for n in names if n != "long"]
    if "copy" in names:
        from deepinfer.entrypoints.bench_copy import run_copy

        progress.start("copy")
        results += run_copy(args)
        names = [n for n in names if n != "copy"]
    if "prefix" in names:
        from deepinfer.entrypoints.bench_prefix import run_prefix

        progress.start("prefix")
        results += run_prefix(args)
        names = [n for n in names if n != "prefix"]
    if names:
        results += run_engine_workloads(args, names, progress, dummy_peer)
    progress.close()
    _print_ratios(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_json() for r in results], f, indent=2)
    return 0


def run_engine_workloads(args, names: list[str], progress: WorkloadProgress, dummy_peer: bool) -> list[BenchResult]:
    """cpu32 / decode1 on one engine, each followed by the peers on the same requests. The engine
    is closed at the end (its tensor-parallel ranks stopped), so another may start in this process."""
    results, workloads = [], []
    with make_llm(args) as llm:
        print(engine_line(llm), flush=True)
        for line in kv_lines(llm):
            print(line, flush=True)
        for name in names:
            workload = make_workload(name, llm.engine.source.hf_config.vocab_size, args.num_requests or 32,
                                     max_output_len=getattr(args, "max_tokens", None))
            progress.start(name, f"{len(workload.prompts)} requests")
            results.append(run_deepinfer(llm, workload, engine_label(getattr(args, "speculative_method", None))))
            _print(results[-1])
            _print_spec(results[-1:])
            if name == "cpu32" and has_compressed_groups(llm.engine.runner):
                print(workload_kv_line(llm.engine.runner, workload), flush=True)
            workloads.append(workload)
            for peer in [] if dummy_peer else args.peer:
                from deepinfer.entrypoints.bench_peers import run_peer

                for result in run_peer(peer, llm.engine.source, workload):
                    results.append(result)
                    _print(result)
        if dummy_peer and workloads:
            results += run_dummy_v4_peer(llm, workloads)  # closes the engine first
    return results


def engine_line(llm) -> str:
    """What the measured engine is, so runs can be compared: e.g. `engine   llama, float32 on cpu,
    tensor-parallel-size 2, max-model-len 64`."""
    engine = llm.engine
    model_type = getattr(engine.source.hf_config, "model_type", "?")
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


def check_dummy_peers(args) -> None:
    """Dummy weights have a peer only for DeepSeek-V4 in transformers (`--peer hf`), which then
    runs our engine's own weights; any other model or peer needs the checkpoint's weights."""
    from deepinfer.entrypoints.bench_peers import V4_MODEL_TYPE
    from deepinfer.model_executor.loader import load_model_source

    model_type = getattr(load_model_source(args.model, load_format="dummy").hf_config, "model_type", None)
    if model_type != V4_MODEL_TYPE or set(args.peer) != {"hf"}:
        raise ValueError(f"--peer {' '.join(args.peer)} runs the checkpoint's weights, which load_format='dummy' "
                         f"does not read (with dummy weights only a {V4_MODEL_TYPE} model has a peer: --peer hf, "
                         f"which reuses the engine's weights); model_type is {model_type!r}")


def run_dummy_v4_peer(llm, workloads: list[Workload]) -> list[BenchResult]:
    """transformers' DeepseekV4ForCausalLM on our engine's dummy weights, after our runs: the
    weights are taken over (no copy: the state dict shares their storage), the engine is dropped
    (its KV cache freed) and the HF model is assembled on the meta device around them, so that a
    full-width model is never held twice. Measured one request at a time (batch 1): transformers'
    left-padded batches are not a valid V4 reference (compressor windows align to tensor index 0).
    `llm` is left without its engine."""
    import gc

    from deepinfer.entrypoints.bench_peers import hf_v4_model, hf_v4_state_dict, run_peer

    hf_config = llm.engine.source.hf_config
    state = hf_v4_state_dict(llm.engine.runner.model)
    llm.close()
    llm.engine = None  # the caller's reference keeps only an empty shell
    gc.collect()
    model = hf_v4_model(hf_config, state)
    del state
    print("peer     hf-batch1: transformers DeepseekV4ForCausalLM on the engine's dummy weights (fp32, eager), "
          "one request at a time: its left-padded batches are not a valid V4 reference", flush=True)
    results = []
    for workload in workloads:
        for result in run_peer("hf", None, workload, model=model):
            results.append(result)
            _print(result)
    return results


def _print(r: BenchResult) -> None:
    print(format_result(r), flush=True)


def _print_spec(results: list[BenchResult]) -> None:
    for r in results:
        if r.spec is not None:
            print(format_spec(r), flush=True)


def _print_ratios(results: list[BenchResult]) -> None:
    ours = {r.workload: r for r in results if r.engine.startswith("deepinfer")}
    for r in results:
        if not r.engine.startswith("deepinfer"):
            ratio = ours[r.workload].tokens_per_s / r.tokens_per_s
            print(f"{r.workload:8s} deepinfer / {r.engine}: {ratio:.2f}x")
