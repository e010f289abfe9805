"""The llama.cpp peer through llama-cpp-python (the `peers` extra): the fallback where node is absent.

Imported only when the llama.cpp peer runs without node and `llama_cpp` is importable.
"""

from __future__ import annotations

import time

from deepinfer.entrypoints.bench.common import BenchResult, Workload


def run_llama_cpp_python(source, workload: Workload) -> BenchResult:
    """The fallback without node: llama-cpp-python on the same GGUF, 2 threads, one request at a time, EOS ignored."""
    from llama_cpp import Llama

    llm = Llama(model_path=source.path, n_threads=2, n_ctx=1024, verbose=False)
    start = time.perf_counter()
    for prompt, n in zip(workload.prompts, workload.output_lens, strict=True):
        llm.reset()
        for count, _ in enumerate(llm.generate(prompt, temp=0.0), start=1):
            if count == n:
                break
    seconds = time.perf_counter() - start
    return BenchResult("llama.cpp", workload.name, seconds, workload.num_output_tokens)
