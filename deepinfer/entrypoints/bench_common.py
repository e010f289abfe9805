"""What every `deepinfer bench` mode shares: the fixed workloads and running one on our engine.

The workloads (cpu32, decode1, long) are described in `bench`; `bench_long`, `bench_kv`,
`bench_peers` and `bench serve` build on the same `Workload` and `BenchResult`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

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


def _capped(n: int, max_output_len: int | None) -> int:
    return n if max_output_len is None else min(n, max_output_len)


def make_workload(name: str, vocab_size: int, num_requests: int = 32, seed: int = 0,
                  max_output_len: int | None = None) -> Workload:
    """The workload's token-id prompts and output lengths; `max_output_len` caps the outputs of
    cpu32 and decode1 (the prompts and the other draws stay the same)."""
    rng = random.Random(seed)
    if name == "cpu32":
        lens = [(rng.randint(32, 256), rng.randint(32, 256)) for _ in range(num_requests)]
        prompts = [[rng.randrange(100, vocab_size) for _ in range(p)] for p, _ in lens]
        return Workload(name, prompts, [_capped(o, max_output_len) for _, o in lens])
    if name == "decode1":
        return Workload(name, [[rng.randrange(100, vocab_size) for _ in range(8)]], [_capped(128, max_output_len)])
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
