"""cpu32 with LoRA adapters: the base model alone vs the same 32 requests spread over 4 adapters.

Writes `--adapters` random PEFT adapters (rank `--rank`, every projection of every layer: q/k/v/o
and gate/up/down, lora_alpha = 2 * rank) for the model's shapes into a temporary directory, then
runs `deepinfer bench`'s cpu32 requests (greedy, all at once) twice on one engine: without an
adapter, and with request i using adapter i % N. Prints both throughputs and their ratio.

    python scripts/lora_cpu32_bench.py [--model smollm2-135m] [--adapters 4] [--rank 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from deepinfer import LLM, LoRARequest
from deepinfer.entrypoints.bench.workloads import make_workload

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of a Llama-family config."""
    h, head = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv, inter = cfg.num_attention_heads * head, cfg.num_key_value_heads * head, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def write_adapter(path: str, cfg, rank: int, seed: int) -> None:
    """A PEFT adapter directory with small random A and B for every projection of every layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, (n_in, n_out) in projection_shapes(cfg).items():
            name = f"base_model.model.model.layers.{layer}.{TARGETS[proj]}.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(TARGETS),
              "bias": "none", "use_rslora": False, "task_type": "CAUSAL_LM"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def timed(llm: LLM, prompts, params, lora) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp, \
            LLM(args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank) as llm:
        cfg = llm.engine.source.hf_config
        adapters = []
        for i in range(args.adapters):
            write_adapter(os.path.join(tmp, f"a{i}"), cfg, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, os.path.join(tmp, f"a{i}")))
        work = make_workload("cpu32", cfg.vocab_size)
        params = work.sampling_params()
        llm.generate([[1, 2, 3]] * args.adapters, params[:args.adapters], lora_request=adapters,
                     use_tqdm=False)  # warm-up: every adapter loaded into its slot
        base_s, base_n = timed(llm, work.prompts, params, None)
        mixed = [adapters[i % args.adapters] for i in range(len(work.prompts))]
        lora_s, lora_n = timed(llm, work.prompts, params, mixed)
    print(f"cpu32 base        {base_n} tokens in {base_s:.2f} s = {base_n / base_s:.1f} tok/s")
    print(f"cpu32 {args.adapters} adapters  {lora_n} tokens in {lora_s:.2f} s = {lora_n / lora_s:.1f} tok/s "
          f"(rank {args.rank}, request i on adapter i % {args.adapters})")
    print(f"ratio {base_s / lora_s * lora_n / base_n:.2f}x of the base model alone")


if __name__ == "__main__":
    main()
