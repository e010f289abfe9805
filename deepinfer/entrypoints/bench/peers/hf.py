"""The HF transformers peer of `deepinfer bench --peer hf`: the same requests in transformers, fp32.

DeepSeek-V4 runs in transformers one request at a time (`hf-batch1`): its compressor windows
align to tensor index 0, so a left-padded batch is not a valid V4 reference. With
`--load-format dummy` the peer gets our engine's own seeded weights (`hf_v4_state_dict`,
`hf_v4_model`): same names as transformers' modules except the shared expert's merged gate_up.
"""

from __future__ import annotations

import copy
import os
import re
import time

import torch

from deepinfer.entrypoints.bench.common import BenchResult, Workload

HF_BATCH = 8
V4_MODEL_TYPE = "deepseek_v4"
HF_BATCH1 = "hf-batch1"  # the engine name of a peer measured one request at a time


def _hf_model(source):
    from transformers import AutoModelForCausalLM

    if source.format == "gguf":
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(source.path), dtype=torch.float32,
                                                    gguf_file=os.path.basename(source.path)).eval()
    return AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()


@torch.inference_mode()
def run_hf(source, workload: Workload) -> BenchResult:
    """fp32, batched generate with left padding, HF_BATCH requests a batch, EOS ignored
    (DeepSeek-V4: one request at a time, see run_hf_batch1)."""
    model = _hf_model(source)
    if model.config.model_type == V4_MODEL_TYPE:
        return run_hf_batch1(model, workload)
    pad = source.tokenizer.pad_token_id if source.tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), HF_BATCH):
        prompts, lens = workload.prompts[i:i + HF_BATCH], workload.output_lens[i:i + HF_BATCH]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, width]
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                       min_new_tokens=max(lens), do_sample=False, pad_token_id=pad)
    seconds = time.perf_counter() - start
    return BenchResult("hf", workload.name, seconds, workload.num_output_tokens)


@torch.inference_mode()
def run_hf_batch1(model, workload: Workload) -> BenchResult:
    """One request at a time: greedy generate of exactly the request's output length with the
    KV cache, after a 2-token warm-up; engine name `hf-batch1`."""
    device = next(model.parameters()).device
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(prompt: list[int], n: int) -> int:
        ids = torch.tensor([prompt], device=device)  # [1, len]
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=pad)
        return out.shape[1] - ids.shape[1]

    generate([1, 2, 3], 2)  # warm-up
    start = time.perf_counter()
    produced = sum(generate(p, n) for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    seconds = time.perf_counter() - start
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"hf produced {produced} tokens, expected {workload.num_output_tokens}")
    return BenchResult(HF_BATCH1, workload.name, seconds, produced)


_SHARED_GATE_UP = re.compile(r"^(.*\.shared_experts)\.gate_up_proj\.weight$")


def hf_v4_state_dict(model) -> dict[str, torch.Tensor]:
    """Our DeepseekV4ForCausalLM's persistent state under transformers' names, sharing storage:
    each shared expert's merged gate_up_proj [2I, H] becomes gate_proj (rows [0, I)) and up_proj
    (rows [I, 2I)); every other name (routed-expert stacks, tid2eid, e_score_correction_bias) is
    already transformers' module name. No tensor is copied."""
    out = {}
    for name, tensor in model.state_dict().items():
        shared = _SHARED_GATE_UP.match(name)
        if shared:
            gate, up = tensor.chunk(2, dim=0)  # views, [I, H] each
            out[f"{shared.group(1)}.gate_proj.weight"], out[f"{shared.group(1)}.up_proj.weight"] = gate, up
        else:
            out[name] = tensor
    return out


def hf_v4_model(hf_config, state_dict: dict[str, torch.Tensor]):
    """transformers' DeepseekV4ForCausalLM (fp32, eager attention, eval) holding `state_dict`'s
    tensors: built on the meta device, then the tensors are assigned (strict: every persistent
    parameter and buffer, nothing extra), so no second copy of the weights is made. The rotary
    embeddings' non-persistent inv_freq buffers are rebuilt on the weights' device.

    Entries of `state_dict` are replaced by their fp32 versions as they are converted (callers
    may drop their own references first so that a bf16 model is not held twice)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4RotaryEmbedding

    config = copy.deepcopy(hf_config)
    config._attn_implementation = "eager"  # V4 ships eager only (no SDPA: per-head sinks)
    for name in list(state_dict):
        if state_dict[name].is_floating_point():
            state_dict[name] = state_dict[name].float()
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    device = next(iter(state_dict.values())).device
    for name, module in list(model.named_modules()):
        if isinstance(module, DeepseekV4RotaryEmbedding):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, DeepseekV4RotaryEmbedding(config, device=device))
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} tensors of the HF peer stayed on the meta device, e.g. {left[:3]}")
    return model.eval()
