"""`deepinfer bench`: throughput on fixed workloads, optionally beside peers in the same run.

Workloads (same requests for every engine):
  cpu32   32 requests, prompt lengths U[32, 256] of random token ids, output lengths U[32, 256],
          seed 0, greedy, ignore_eos; reports useful output tokens per second.
  decode1 one request, a short prompt, 128 output tokens; reports tokens per second.
  long    16 requests of 2,048-token prompts and 256 outputs, run twice on the same model: with a
          sliding window of W = --window (128) on every layer, and with the full cache. Reports
          tokens/s of each and the KV bytes allocated per request against the formula S / L.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

from deepinfer.sampling_params import SamplingParams

WORKLOADS = ("cpu32", "decode1", "long")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class BenchResult:
    engine: str
    workload: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def make_workload(name: str, vocab_size: int, num_requests: int = 32, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    if name == "cpu32":
        lens = [(rng.randint(32, 256), rng.randint(32, 256)) for _ in range(num_requests)]
        prompts = [[rng.randrange(100, vocab_size) for _ in range(p)] for p, _ in lens]
        return Workload(name, prompts, [o for _, o in lens])
    if name == "decode1":
        return Workload(name, [[rng.randrange(100, vocab_size) for _ in range(8)]], [128])
    if name == "long":
        return Workload(name, [[rng.randrange(100, vocab_size) for _ in range(2048)] for _ in range(16)],
                        [256] * 16)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def run_deepinfer(llm, workload: Workload, engine: str = "deepinfer") -> BenchResult:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"deepinfer produced {produced} tokens, expected {workload.num_output_tokens}")
    return BenchResult(engine, workload.name, seconds, produced)


def add_bench_args(p) -> None:
    p.add_argument("--workload", action="append", choices=WORKLOADS, default=None,
                   help="workload to run (repeatable; default: all)")
    p.add_argument("--num-requests", type=int, default=32, help="requests in cpu32")
    p.add_argument("--peer", action="append", choices=["hf", "llama.cpp"], default=[],
                   help="also run a peer on the same requests (repeatable)")
    p.add_argument("--window", type=int, default=128, help="sliding window W of the long workload")
    p.add_argument("--json", default=None, help="write the results to this JSON file")


def run_bench(args) -> int:
    from deepinfer.entrypoints.cli import make_llm

    names = args.workload or ["cpu32", "decode1"]
    results = []
    if "long" in names:
        from deepinfer.entrypoints.bench_long import run_long

        results += run_long(args, make_workload)
        names = [n for n in names if n != "long"]
    llm = make_llm(args) if names else None
    for name in names:
        workload = make_workload(name, llm.engine.source.hf_config.vocab_size, args.num_requests)
        results.append(run_deepinfer(llm, workload))
        _print(results[-1])
        for peer in args.peer:
            from deepinfer.entrypoints.bench_peers import run_peer

            results.append(run_peer(peer, llm.engine.source, workload))
            _print(results[-1])
    _print_ratios(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results], f, indent=2)
    return 0


def _print(r: BenchResult) -> None:
    print(f"{r.workload:8s} {r.engine:10s} {r.output_tokens:6d} tokens in {r.seconds:8.2f} s "
          f"= {r.tokens_per_s:8.2f} tok/s", flush=True)


def _print_ratios(results: list[BenchResult]) -> None:
    ours = {r.workload: r for r in results if r.engine.startswith("deepinfer")}
    for r in results:
        if not r.engine.startswith("deepinfer"):
            ratio = ours[r.workload].tokens_per_s / r.tokens_per_s
            print(f"{r.workload:8s} deepinfer / {r.engine}: {ratio:.2f}x")
