"""cpu32 and decode1: token-id throughput on one engine, each followed by the peers asked for.

The engine's `engine` line (and, for a model with compressed cache groups, its `kv` lines) comes
first; each workload prints its result, then each peer's on the same requests. With
`--load-format dummy` the peer is transformers' DeepSeek-V4 on our own weights, after our runs
(`peers.run_dummy_v4_peer`). Peers are imported only when one is asked for.
"""

from __future__ import annotations

from deepinfer.entrypoints.bench.common import BenchResult, engine_label, run_deepinfer
from deepinfer.entrypoints.bench.report import WorkloadProgress, engine_line, print_result, print_spec
from deepinfer.entrypoints.bench.workloads import make_workload
from deepinfer.entrypoints.bench.workloads.kv import has_compressed_groups, kv_lines, workload_kv_line
from deepinfer.entrypoints.engine_args import make_llm


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
                                     max_output_len=args.max_tokens)
            progress.start(name, f"{len(workload.prompts)} requests")
            results.append(run_deepinfer(llm, workload, engine_label(args.speculative_method)))
            print_result(results[-1])
            print_spec(results[-1:])
            if name == "cpu32" and has_compressed_groups(llm.engine.runner):
                print(workload_kv_line(llm.engine.runner, workload), flush=True)
            workloads.append(workload)
            for peer in [] if dummy_peer else args.peer:
                from deepinfer.entrypoints.bench.peers import run_peer

                for result in run_peer(peer, llm.engine.source, workload):
                    results.append(result)
                    print_result(result)
        if dummy_peer and workloads:
            from deepinfer.entrypoints.bench.peers import run_dummy_v4_peer

            results += run_dummy_v4_peer(llm, workloads)  # closes the engine first
    return results
