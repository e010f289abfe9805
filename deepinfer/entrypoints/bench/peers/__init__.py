"""Peers for `deepinfer bench --peer`: HF transformers and llama.cpp on the same requests.

One module per peer, each imported only when its peer runs (so neither `import deepinfer` nor a
bench without --peer loads them): `hf` (transformers, a dependency), `node_llama_cpp` (llama.cpp
through the npm package node-llama-cpp's prebuilt binaries and `llama_cpp_peer.mjs`; `make
peers`) and `llama_cpp_python` (the `peers` extra, a fallback where node is absent).

With `--load-format dummy` only DeepSeek-V4 has a peer: transformers' model on our engine's own
weights (`check_dummy_peers`, `run_dummy_v4_peer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.entrypoints.bench.report import print_result

if TYPE_CHECKING:
    from deepinfer.entrypoints.bench.common import BenchResult, Workload


def run_peer(name: str, source, workload: Workload, model=None) -> list[BenchResult]:
    """The peer's results on `workload` (llama.cpp: one per mode, see run_llama_cpp). `model`: an
    HF model already built (a dummy V4 peer holding our weights); else loaded from source."""
    if name == "hf":
        from deepinfer.entrypoints.bench.peers.hf import run_hf, run_hf_batch1

        return [run_hf_batch1(model, workload) if model is not None else run_hf(source, workload)]
    if name == "llama.cpp":
        return run_llama_cpp(source, workload)
    raise ValueError(f"unknown peer {name!r}")


def run_llama_cpp(source, workload: Workload) -> list[BenchResult]:
    """llama.cpp on the same GGUF, 2 threads, greedy, EOS ignored, through node-llama-cpp's prebuilt
    binaries (`node_llama_cpp`): one request at a time (`llama.cpp`) and, for a workload of several
    requests, also 16 parallel sequences (`llama.cpp-np16`). Prints a line on what ran before each
    result. Without node, llama-cpp-python is used when importable (one request at a time)."""
    import importlib.util

    from deepinfer.entrypoints.bench.peers import node_llama_cpp

    if source.format != "gguf":
        raise ValueError(f"the llama.cpp peer needs a .gguf model, got {source.path!r}")
    if not node_llama_cpp.node_available() and importlib.util.find_spec("llama_cpp") is not None:
        from deepinfer.entrypoints.bench.peers.llama_cpp_python import run_llama_cpp_python

        return [run_llama_cpp_python(source, workload)]
    results = []
    for parallel in (1, node_llama_cpp.PARALLEL) if len(workload.prompts) > 1 else (1,):
        result, info = node_llama_cpp.run_node_llama_cpp(source.path, workload, parallel)
        print(node_llama_cpp.describe(info), flush=True)
        results.append(result)
    return results


def check_dummy_peers(args) -> None:
    """Dummy weights have a peer only for DeepSeek-V4 in transformers (`--peer hf`), which then
    runs our engine's own weights; any other model or peer needs the checkpoint's weights."""
    from deepinfer.entrypoints.bench.peers.hf import V4_MODEL_TYPE
    from deepinfer.model_executor.loader import load_model_source

    model_type = load_model_source(args.model, load_format="dummy").hf_config.model_type
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

    from deepinfer.entrypoints.bench.peers.hf import hf_v4_model, hf_v4_state_dict

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
            print_result(result)
    return results
