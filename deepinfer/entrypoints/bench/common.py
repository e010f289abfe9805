"""What every `deepinfer bench` mode shares: a workload, a result, and running one on our engine.

The workloads themselves (cpu32, decode1, long, copy, prefix, serve) are under `bench.workloads`;
the peers (`bench.peers`) and the printed lines (`bench.report`) build on the same `Workload`
and `BenchResult`.

With a speculative method, a measured run also carries what speculative decoding did in it:
the deltas of the engine's counters (`LLM.get_metrics()`) from just before the run to just after,
so a warm-up or an earlier run never counts.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.sampling_params import SamplingParams


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    ignore_eos: bool = True  # False: a request may stop at EOS, and output_lens are caps

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def sampling_params(self) -> list[SamplingParams]:
        """Greedy, one per request."""
        return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=self.ignore_eos) for n in self.output_lens]


@dataclass
class BenchResult:
    engine: str
    workload: str
    seconds: float
    output_tokens: int
    batch: int | None = None  # requests in flight at once; None: the whole workload at once
    spec: SpecDecodeStats | None = None  # speculative decoding in this run (None: no method)
    vs_plain: dict | None = None  # a speculative run against plain decoding of the same requests
    extra: dict | None = None  # a workload's own figures (entrypoints: decode and request tokens/s)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_json(self) -> dict:
        """The fields that are set, tokens_per_s, and the spec counters with their rates."""
        d = {k: v for k, v in asdict(self).items() if v is not None}
        if self.spec is not None:
            d["spec"] = self.spec.as_dict()
        return d | {"tokens_per_s": self.tokens_per_s}


def engine_label(speculative_method: str | None) -> str:
    """`deepinfer`, or `deepinfer+ngram` / `deepinfer+mtp` with a speculative method."""
    return "deepinfer" if speculative_method is None else f"deepinfer+{speculative_method}"


def run_deepinfer(llm, workload: Workload, engine: str = "deepinfer") -> BenchResult:
    """A warm-up request, then the workload all at once."""
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    result, _ = measure(llm, workload, engine)
    return result


def measure(llm, workload: Workload, engine: str, batch: int | None = None
            ) -> tuple[BenchResult, list[list[int]]]:
    """Run the workload `batch` requests at a time (one `generate` call per group; None: all at
    once) and time it. Returns the result and every request's output token ids."""
    before = llm.get_metrics()
    params, size = workload.sampling_params(), batch or len(workload.prompts)
    start = time.perf_counter()
    bar = sys.stderr.isatty()  # a requests bar on a terminal; updated per finished request, not per token
    outs = [out for i in range(0, len(params), size)
            for out in llm.generate(workload.prompts[i:i + size], params[i:i + size], use_tqdm=bar)]
    seconds = time.perf_counter() - start
    token_ids = _checked_output_ids(outs, workload)
    spec = spec_between(before, llm.get_metrics()) if before.get("speculative_method") else None
    return BenchResult(engine, workload.name, seconds, sum(map(len, token_ids)), batch, spec), token_ids


def _checked_output_ids(outs, workload: Workload) -> list[list[int]]:
    """Output token ids per request; raises if a request failed or (ignore_eos) fell short."""
    for out in outs:
        if out.error is not None:
            raise RuntimeError(f"deepinfer failed request {out.request_id}: {out.error}")
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    produced = sum(map(len, token_ids))
    if workload.ignore_eos and produced != workload.num_output_tokens:
        raise RuntimeError(f"deepinfer produced {produced} tokens, expected {workload.num_output_tokens}")
    return token_ids


def spec_between(before: dict, after: dict) -> SpecDecodeStats:
    """What speculative decoding did between two `get_metrics()` snapshots."""
    def delta(key: str) -> int:
        return after[key] - before[key]

    per_pos_before = before["spec_decode_num_accepted_tokens_per_pos"]
    per_pos = [n - (per_pos_before[i] if i < len(per_pos_before) else 0)
               for i, n in enumerate(after["spec_decode_num_accepted_tokens_per_pos"])]
    return SpecDecodeStats(delta("spec_decode_num_drafts"), delta("spec_decode_num_draft_tokens"),
                           delta("spec_decode_num_accepted_tokens"), per_pos)


def run_alone(engine, prompt: list[int], params: SamplingParams) -> tuple[float, float, object]:
    """Submit one request to an idle engine and step it to its end: (seconds from submission to its
    first token, seconds from its first token to its last, its last output). Raises if it fails."""
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
                first = now if first is None else first
                return first - start, now - first, out
