"""The benchmarks of `scripts/gpu_check.sh`: DeepInfer beside HF transformers, dummy bf16 weights.

    python scripts/gpu_bench.py SECTION [--cpu] [--device DEVICE]

Sections (each prints `result ...` lines, one per figure, and `note ...` lines saying what ran):
  nano    the nano-vllm workload on configs/qwen3_0_6b: 256 requests, prompt and output lengths
          uniform in [100, 1024] (token ids, seed 0), greedy, EOS ignored; output tok/s of DeepInfer
          (all requests at once) and of transformers' continuous batching (the manager behind
          `generate_batch`, each request's own max_new_tokens, timed after its warm-up); where that
          fails, transformers' left-padded `generate` of all requests at once (useful tokens counted).
  decode  batch-1 decode ms/token of configs/llama3_1_8b and configs/qwen3_0_6b, DeepInfer and
          transformers: (time of N outputs - time of 1 output) / (N - 1) on the same prompt, so
          the prefill and the first token do not count.
  v4      configs/deepseek_v4_flash_3l (DeepSeek-V4-Flash widths, 3 layers: sliding, CSA, HCA;
          256 experts, top-6): decode ms/step at batch 1 and 16 (as above, per step), and prefill
          tok/s (16 prompts, one output token each); then transformers' DeepseekV4ForCausalLM on
          the same prompts, loaded after the engine is gone (where its transformers has the model).

`--cpu`: the same steps at toy sizes (tiny widths through hf_overrides, 4 requests of 8-16
tokens), so the whole check runs on a CPU in minutes. The HF peer holds its own random weights
of the same shapes (throughput with EOS ignored does not depend on the values).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the checkout, when PYTHONPATH does not name it

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.entrypoints.bench.common import Workload, measure  # noqa: E402
from deepinfer.entrypoints.bench.report import format_result  # noqa: E402

QWEN3, LLAMA8B, V4_3L = (os.path.join(ROOT, "configs", name)
                         for name in ("qwen3_0_6b", "llama3_1_8b", "deepseek_v4_flash_3l"))
TOY_DENSE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024)
TOY_V4 = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=64, qk_rope_head_dim=8,
              q_lora_rank=32, o_lora_rank=16, o_groups=2, n_routed_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, hc_mult=2, index_n_heads=8, index_head_dim=32, index_topk=3,
              sliding_window=8, compress_rates={"compressed_sparse_attention": 4,
                                                "heavily_compressed_attention": 8})


def sizes(cpu: bool) -> dict:
    """Request counts and lengths of every section: full on a GPU, toy with --cpu."""
    if cpu:
        return dict(nano_requests=4, nano_len=(8, 16), decode_outputs=8, v4_prompt=16, v4_outputs=6,
                    v4_prefill=16, max_model_len=256, max_num_seqs=16, batched_tokens=256)
    return dict(nano_requests=256, nano_len=(100, 1024), decode_outputs=128, v4_prompt=128, v4_outputs=32,
                v4_prefill=1024, max_model_len=2048, max_num_seqs=256, batched_tokens=8192)


def emit(kind: str, text: str) -> None:
    print(f"{kind:6s} {text}", flush=True)


def random_prompts(num: int, lengths: tuple[int, int], vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of random token ids, lengths uniform in `lengths` (inclusive)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(num)]


def nano_workload(cpu: bool, vocab_size: int) -> Workload:
    """nano-vllm's bench: prompt and output lengths drawn uniformly (seed 0), EOS ignored."""
    s = sizes(cpu)
    rng = random.Random(0)
    prompts = random_prompts(s["nano_requests"], s["nano_len"], vocab_size, seed=1)
    return Workload("nano", prompts, [rng.randint(*s["nano_len"]) for _ in prompts])


def make_engine(model: str, cpu: bool, device: str, overrides: dict | None, **kwargs) -> LLM:
    """DeepInfer on dummy bf16 weights; toy widths with --cpu; prefix caching off (timed runs repeat prompts)."""
    s = sizes(cpu)
    toy = (TOY_V4 if model == V4_3L else TOY_DENSE) if cpu else {}
    params = dict(max_model_len=s["max_model_len"], max_num_seqs=s["max_num_seqs"],
                  max_num_batched_tokens=s["batched_tokens"]) | kwargs
    return LLM(model, load_format="dummy", dtype="bfloat16", device=device, enable_prefix_caching=False,
               hf_overrides={**toy, **(overrides or {})} or None, **params)


def drop_engine(llm: LLM) -> None:
    """Close the engine and free its weights and KV cache before a peer loads."""
    llm.close()
    llm.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_model(model: str, cpu: bool, device: str):
    """transformers' model of the config (toy widths with --cpu): random bf16 weights, on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    for key, value in ((TOY_V4 if model == V4_3L else TOY_DENSE) if cpu else {}).items():
        setattr(config, key, value)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def run_nano(args) -> None:
    llm = make_engine(QWEN3, args.cpu, args.device, None)
    workload = nano_workload(args.cpu, llm.engine.source.hf_config.vocab_size)
    emit("note", f"nano: {len(workload.prompts)} requests, {sum(map(len, workload.prompts))} prompt tokens, "
         f"{workload.num_output_tokens} output tokens")
    llm.generate([[101, 102, 103]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    ours, _ = measure(llm, workload, "deepinfer")
    emit("result", format_result(ours))
    drop_engine(llm)
    peer = hf_continuous_batching(hf_model(QWEN3, args.cpu, args.device), workload, args.cpu)
    emit("result", format_result(peer))
    emit("result", f"nano     deepinfer / {peer.engine}: {ours.tokens_per_s / peer.tokens_per_s:.2f}x")


def hf_continuous_batching(model, workload: Workload, cpu: bool):
    """transformers' continuous batching (its manager, each request's own max_new_tokens, EOS
    off); where the installed version lacks it or it fails, padded batched `generate`."""
    from deepinfer.entrypoints.bench.common import BenchResult

    try:
        produced, seconds = _hf_manager_run(model, workload, cpu)
        if produced != workload.num_output_tokens:
            raise RuntimeError(f"produced {produced} tokens, expected {workload.num_output_tokens}")
        return BenchResult("hf-cb", workload.name, seconds, produced)
    except Exception as exc:  # noqa: BLE001 - any failure of the optional path falls back, and is reported
        emit("note", f"hf continuous batching failed ({type(exc).__name__}: {exc}); padded generate instead")
    return _hf_padded(model, workload, batch=len(workload.prompts))


@torch.inference_mode()
def _hf_manager_run(model, workload: Workload, cpu: bool) -> tuple[int, float]:
    """(output tokens, seconds) of the workload through `continuous_batching_context_manager`, timed
    from inside it: its warm-up (CUDA-graph capture) is start-up, as our engine's warm-up request is."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                              max_new_tokens=max(workload.output_lens))
    kwargs = dict(generation_config=config, block=True, timeout=30, workload_hints=_workload_hints(workload))
    if cpu:  # a small cache: the default sizes it from the free memory, slow to allocate on a CPU
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=64, page_size=16,
                                                                        max_batch_tokens=256)
    done: dict[str, int] = {}
    with model.continuous_batching_context_manager(**kwargs) as manager:
        start = time.perf_counter()
        for prompt, n in zip(workload.prompts, workload.output_lens, strict=True):
            manager.add_request(input_ids=prompt, max_new_tokens=n)
        while len(done) < len(workload.prompts):
            result = manager.get_result(timeout=1)
            if result is None and not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped")
            if result is not None and result.is_finished():
                done[result.request_id] = len(result.generated_tokens)
        seconds = time.perf_counter() - start
    return sum(done.values()), seconds


def _workload_hints(workload: Workload):
    """What `generate_batch` tells the manager to size its cache (longest prompt and output, requests)."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    return WorkloadHints(max_prompt_length=max(map(len, workload.prompts)),
                         max_generated_length=max(workload.output_lens), num_requests=len(workload.prompts))


@torch.inference_mode()
def _hf_padded(model, workload: Workload, batch: int):
    """Left-padded batched greedy `generate`, `batch` requests at a time, each batch to its longest output."""
    from deepinfer.entrypoints.bench.common import BenchResult

    device = next(model.parameters()).device
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch):
        prompts, lens = workload.prompts[i:i + batch], workload.output_lens[i:i + batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # [B, width]
        mask = (torch.arange(width, device=device) >= width - torch.tensor(
            [len(p) for p in prompts], device=device)[:, None]).long()  # [B, width]
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                       do_sample=False, pad_token_id=0)
    return BenchResult(f"hf-pad{batch}", workload.name, time.perf_counter() - start, workload.num_output_tokens)


def step_ms(run, prompts: list[list[int]], num_outputs: int, repeats: int = 2) -> float:
    """Decode ms per step: (time of `num_outputs` outputs - time of 1) / (num_outputs - 1), each the
    best of `repeats` runs after a warm-up, so prefill and start-up costs cancel."""
    def best(n: int) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(prompts, n)
            times.append(time.perf_counter() - start)
        return min(times)

    run(prompts, 2)  # warm-up
    return (best(num_outputs) - best(1)) / (num_outputs - 1) * 1e3


def engine_runner(llm: LLM):
    """run(prompts, n): all prompts at once through the engine, n greedy outputs each, EOS ignored."""
    def run(prompts, n):
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        if any(len(o.outputs[0].token_ids) != n for o in outs):
            raise RuntimeError(f"deepinfer produced fewer than {n} tokens")
    return run


def hf_batch1_runner(model):
    """run([prompt], n): transformers' greedy generate of exactly n tokens with its KV cache."""
    device = next(model.parameters()).device

    @torch.inference_mode()
    def run(prompts, n):
        ids = torch.tensor(prompts, device=device)  # [1, L]
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
    return run


def run_decode(args) -> None:
    n = sizes(args.cpu)["decode_outputs"]
    for name, path in (("llama3_1_8b", LLAMA8B), ("qwen3_0_6b", QWEN3)):
        llm = make_engine(path, args.cpu, args.device, None, max_num_seqs=4)
        prompt = random_prompts(1, (32, 32), llm.engine.source.hf_config.vocab_size, seed=2)
        ours = step_ms(engine_runner(llm), prompt, n)
        drop_engine(llm)
        emit("result", f"decode1  {name:12s} deepinfer {ours:8.3f} ms/token")
        model = hf_model(path, args.cpu, args.device)
        peer = step_ms(hf_batch1_runner(model), prompt, n)
        del model
        gc.collect()
        emit("result", f"decode1  {name:12s} hf        {peer:8.3f} ms/token  (hf / deepinfer {peer / ours:.2f}x)")


def run_v4(args) -> None:
    s = sizes(args.cpu)
    llm = make_engine(V4_3L, args.cpu, args.device, None, max_num_seqs=16)
    vocab = llm.engine.source.hf_config.vocab_size
    length = (s["v4_prompt"], s["v4_prompt"])
    decode = {batch: random_prompts(batch, length, vocab, seed=3 + batch) for batch in (1, 16)}
    prefill = random_prompts(16, (s["v4_prefill"], s["v4_prefill"]), vocab, seed=5)
    ours = v4_figures(engine_runner(llm), decode, prefill, s["v4_outputs"])
    drop_engine(llm)
    for batch, ms in ours["decode"].items():
        emit("result", f"v4-3l    deepinfer decode batch {batch:2d}: {ms:8.3f} ms/step")
    emit("result", f"v4-3l    deepinfer prefill {ours['prefill_tokens']} tokens in {ours['prefill_s']:.2f} s = "
         f"{ours['prefill_tokens'] / ours['prefill_s']:10.1f} tok/s")
    try:  # after the engine is gone: the two never hold their weights at once
        model = hf_model(V4_3L, args.cpu, args.device)
    except (ImportError, ValueError, KeyError) as exc:
        emit("note", f"v4: no transformers peer ({type(exc).__name__}: {exc})")
        return
    peer = v4_figures(hf_batch1_runner(model), decode, prefill, s["v4_outputs"])
    del model
    gc.collect()
    for batch, ms in peer["decode"].items():
        emit("result", f"v4-3l    hf        decode batch {batch:2d}: {ms:8.3f} ms/step  "
             f"(hf / deepinfer {ms / ours['decode'][batch]:.2f}x)")
    ratio = peer["prefill_s"] / ours["prefill_s"]
    emit("result", f"v4-3l    hf        prefill {peer['prefill_tokens']} tokens in {peer['prefill_s']:.2f} s = "
         f"{peer['prefill_tokens'] / peer['prefill_s']:10.1f} tok/s  (deepinfer / hf {ratio:.2f}x)")


def v4_figures(run, decode: dict, prefill: list[list[int]], num_outputs: int) -> dict:
    """Decode ms/step per batch size (`step_ms`) and the time of one output token for every
    prefill prompt at once (after a warm-up), through `run(prompts, n)`."""
    figures = {"decode": {batch: step_ms(run, prompts, num_outputs) for batch, prompts in decode.items()}}
    run(prefill[:1], 1)  # warm-up
    start = time.perf_counter()
    run(prefill, 1)
    figures["prefill_s"] = time.perf_counter() - start
    figures["prefill_tokens"] = sum(map(len, prefill))
    return figures


SECTIONS = {"nano": run_nano, "decode": run_decode, "v4": run_v4}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("section", choices=list(SECTIONS))
    p.add_argument("--cpu", action="store_true", help="toy sizes on the CPU")
    p.add_argument("--device", default=None, help="default: cpu with --cpu, else cuda")
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.cpu else "cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device (use --cpu for the toy run)")
    SECTIONS[args.section](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
