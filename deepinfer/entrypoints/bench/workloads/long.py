"""The long-context workload: a sliding-window cache against the full cache, same model.

The windowed run overrides the model's config with `sliding_window = W` on every layer, so its
cache is one ring of S = W + backtracking rows per request per layer; the full run keeps every
row in paged blocks. Allocated KV bytes per request at full length L = prompt + output:

    ring:  S * row_bytes * layers          paged: ceil(L / bs) * bs * row_bytes * layers

so the memory ratio is S / L (exactly, when bs divides L).
"""

from __future__ import annotations

import argparse

from deepinfer.entrypoints.bench.common import BenchResult, run_deepinfer
from deepinfer.entrypoints.bench.workloads import make_workload
from deepinfer.entrypoints.engine_args import make_llm


def allocated_bytes_per_request(runner, num_tokens: int) -> int:
    """KV bytes one request holds at num_tokens tokens: its ring slots and state, and its pages
    (the engine's sizing, worker/cache_sizing.py)."""
    return runner.caches.sizing.request_bytes(num_tokens)


def _engine_args(args, window: int | None):
    overrides = dict(args.hf_overrides or {})
    if window is not None:
        overrides["sliding_window"] = window
    ns = argparse.Namespace(**vars(args))
    ns.hf_overrides = overrides or None
    ns.max_model_len = max(args.max_model_len or 0, 2048 + 256 + 16)
    ns.max_num_seqs = max(args.max_num_seqs, 16)
    ns.kv_cache_memory = "2GiB" if args.kv_cache_memory == "1GiB" else args.kv_cache_memory
    return ns


def run_long(args) -> list[BenchResult]:
    results, bytes_per_request, swa_ring = [], {}, None
    for label, window in (("deepinfer-swa", args.window), ("deepinfer-full", None)):
        with make_llm(_engine_args(args, window)) as llm:  # closed (its ranks stopped) before the next
            workload = make_workload("long", llm.engine.source.hf_config.vocab_size)
            length = len(workload.prompts[0]) + workload.output_lens[0]
            result = run_deepinfer(llm, workload, engine=label)
            results.append(result)
            bytes_per_request[label] = allocated_bytes_per_request(llm.engine.runner, length)
            ring = next((g.rows_per_unit for g in llm.engine.runner.groups if g.kind == "ring"), None)
            swa_ring = swa_ring or ring
            print(f"long     {label:15s} {result.tokens_per_s:8.2f} tok/s, KV allocated per request "
                  f"{bytes_per_request[label]:,} B" + (f" (ring S = {ring})" if ring else ""), flush=True)
        del llm
    ratio = bytes_per_request["deepinfer-swa"] / bytes_per_request["deepinfer-full"]
    print(f"long     memory ratio swa / full = {ratio:.5f}; formula S / L = {swa_ring}/{length} = "
          f"{swa_ring / length:.5f}; speed ratio swa / full = "
          f"{results[0].tokens_per_s / results[1].tokens_per_s:.2f}x", flush=True)
    return results
