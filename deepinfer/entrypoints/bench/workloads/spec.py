"""spec: code completion with and without speculative decoding, on our engine and on llama.cpp.

Four code-completion prompts (`CODE_PROMPTS`, raw text: no chat template; token ids drawn at random
for a model without a tokenizer), one request at a time, greedy, 128 output tokens (--max-tokens),
EOS ignored so that every engine produces the same number of tokens. Run on two engines built one
after the other: plain decoding (`deepinfer`) and speculative decoding (`deepinfer+draft_model` with
--speculative-model, or the --speculative-method given), after one warm-up request each. Printed:
tokens/s of each, the acceptance over the measured run, the ratio, and whether the greedy outputs
agree token for token (they must).

With `--peer llama.cpp` the same token ids run in llama.cpp (node-llama-cpp, one sequence) plain and
with the same draft model (its DraftSequenceTokenPredictor, up to --num-speculative-tokens drafts):
its own speed-up, and ours against it.
"""

from __future__ import annotations

import argparse
import gc

from deepinfer.entrypoints.bench.common import BenchResult, Workload, engine_label, measure
from deepinfer.entrypoints.bench.report import format_result, format_spec
from deepinfer.entrypoints.bench.workloads.copy import _compare, repeated_span_prompts
from deepinfer.entrypoints.engine_args import make_llm
from deepinfer.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 128
CODE_PROMPTS = (
    "def quicksort(items):\n    \"\"\"Sort a list of numbers in ascending order.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and fill in defaults.\"\"\"\n"
    "    with open(path) as f:\n",
    "class LRUCache:\n    \"\"\"A least-recently-used cache with a fixed capacity.\"\"\"\n\n"
    "    def __init__(self, capacity):\n",
    "def parse_csv_line(line, sep=','):\n    \"\"\"Split one CSV line into fields, honouring quotes.\"\"\"\n"
    "    fields = []\n",
)


def spec_workload(llm, max_tokens: int | None) -> Workload:
    """The code prompts in `llm`'s tokenizer (random ids without one); fixed output lengths."""
    n = max_tokens or DEFAULT_MAX_TOKENS
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        prompts = repeated_span_prompts(llm.engine.source.hf_config.vocab_size, len(CODE_PROMPTS))
    else:
        prompts = [list(tokenizer(text, add_special_tokens=True)["input_ids"]) for text in CODE_PROMPTS]
    return Workload("spec", prompts, [n] * len(prompts))


def method_of(args) -> str:
    """The speculative method to measure: the one given, else draft_model with --speculative-model."""
    method = args.speculative_method or ("draft_model" if args.speculative_model else None)
    if method is None:
        raise ValueError("--workload spec needs --speculative-model PATH (or a --speculative-method)")
    return method


def _engine_args(args, method: str | None) -> argparse.Namespace:
    ns = argparse.Namespace(**vars(args))
    ns.speculative_method = method
    if method is None:
        ns.speculative_model = None
    return ns


def run_spec(args) -> list[BenchResult]:
    """Plain, then speculative decoding of the code prompts one at a time; then the llama.cpp peer."""
    method = method_of(args)
    workload, runs = None, {}
    for m in (None, method):
        with make_llm(_engine_args(args, m)) as llm:
            workload = workload or spec_workload(llm, args.max_tokens)
            llm.generate(workload.prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
            result, ids = measure(llm, workload, engine_label(m), batch=1)
            print(format_result(result), flush=True)
            if result.spec is not None:
                print(format_spec(result), flush=True)
            runs[m], source = [(result, ids)], llm.engine.source
        del llm
        gc.collect()
    results = _compare(runs[None], runs[method])
    if "llama.cpp" in (args.peer or []):
        results += run_peer(source, workload, args)
    return results


def run_peer(source, workload: Workload, args) -> list[BenchResult]:
    """llama.cpp plain and with the draft model, on the same token ids and threads."""
    from deepinfer.entrypoints.bench.peers import node_llama_cpp
    from deepinfer.entrypoints.bench.workloads.llama_bench import bench_threads

    if source.format != "gguf" or not args.speculative_model:
        print("spec     the llama.cpp peer needs a .gguf model and --speculative-model: skipped", flush=True)
        return []
    threads, k = bench_threads(args), args.num_speculative_tokens or 5
    plain, info = node_llama_cpp.run_node_llama_cpp(source.path, workload, threads=threads)
    print(node_llama_cpp.describe(info), flush=True)
    draft, info = node_llama_cpp.run_node_llama_cpp(source.path, workload, threads=threads,
                                                    draft_model_path=args.speculative_model, draft_tokens=k)
    print(node_llama_cpp.describe(info), flush=True)
    draft.engine = "llama.cpp+draft"
    for r in (plain, draft):
        r.batch = 1
        print(format_result(r), flush=True)
    print(f"spec     llama.cpp+draft / llama.cpp: {draft.tokens_per_s / plain.tokens_per_s:.2f}x", flush=True)
    return [plain, draft]
