"""A DeepSeek-V3 checkpoint as DeepSeek ships it: FP8 e4m3 linear weights, each with a
`weight_scale_inv` of one fp32 scale per 128 x 128 block (edge blocks partial), the routers, norms,
embedding and head in full precision.

One rank: parity with HF transformers' forward of the dequantized weights (fp32, 1e-4).
tensor_parallel_size=2, expert_parallel_size=2 over gloo: the greedy tokens of one rank, logprobs
within 1e-4; rank 0 reads split tensors as slices (the scale blocks holding its rows or columns)
and never its partner's experts.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import save_file
from slice_reads import spy_slice_reads
from tiny_models import teacher_forcing_logprobs
from v3_tiny import VOCAB, make_tiny

from deepinfer import LLM, SamplingParams

pytestmark = [pytest.mark.parity]

BLOCK = 128
FP8_LINEARS = ("_proj.weight", "_proj_with_mqa.weight")  # q/kv/o projections, MLPs, experts
PROMPT_LENGTHS, MAX_TOKENS = (3, 29, 47), 8
SPLIT = (".q_b_proj.", ".kv_b_proj.", ".o_proj.", ".mlp.gate_proj.", ".shared_experts.down_proj.")


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (e4m3 [R, C], scale_inv [ceil(R/128), ceil(C/128)] fp32) with w ~ e4m3 * scale_inv."""
    rows, cols = w.shape
    grid = (-(-rows // BLOCK), -(-cols // BLOCK))
    padded = torch.zeros(grid[0] * BLOCK, grid[1] * BLOCK)
    padded[:rows, :cols] = w
    blocks = padded.view(grid[0], BLOCK, grid[1], BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [gr, gc]
    values = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return values, scale.float()


def dequantized(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:values.shape[0], :values.shape[1]]
    return values.float() * full


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(path, HF model holding the dequantized weights). intermediate_size 160: the dense MLP spans
    two 128-row blocks, and its split over two ranks cuts one."""
    path = str(tmp_path_factory.mktemp("v3fp8"))
    hf = make_tiny(path, seed=11, intermediate_size=160)
    tensors = {}
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                continue  # written per expert below
            if t.dim() == 2 and name.endswith(FP8_LINEARS):
                values, scale = quantize_blocks(t)
                t.copy_(dequantized(values, scale))  # the reference runs on what the file holds
                tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = values, scale
            else:
                tensors[name] = t.clone()
        for i, layer in enumerate(hf.model.layers):
            if hasattr(layer.mlp, "experts"):
                _fp8_experts(layer.mlp.experts, f"model.layers.{i}.mlp.experts", tensors)
    os.remove(os.path.join(path, "model.safetensors"))
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}  # as DeepSeek-V3's config.json
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path, hf


def _fp8_experts(experts, prefix: str, tensors: dict) -> None:
    """Each expert's gate / up / down as its own FP8 matrix (DeepSeek's names); the HF stacks take
    the dequantized values."""
    inter = experts.down_proj.shape[-1]
    for e in range(experts.gate_up_proj.shape[0]):
        views = {"gate_proj": experts.gate_up_proj.data[e, :inter], "up_proj": experts.gate_up_proj.data[e, inter:],
                 "down_proj": experts.down_proj.data[e]}
        for proj, view in views.items():
            values, scale = quantize_blocks(view)
            view.copy_(dequantized(values, scale))
            tensors[f"{prefix}.{e}.{proj}.weight"] = values
            tensors[f"{prefix}.{e}.{proj}.weight_scale_inv"] = scale


def _generate(path: str, **parallel) -> list:
    """Greedy completions of three prompts with chunked prefill (16-token steps); no block leaks."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(path, dtype="float32", block_size=8, num_blocks=64, max_model_len=128, max_num_seqs=4,
             max_num_batched_tokens=16, enable_prefix_caching=False, **parallel) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.kv_manager.check_no_leaks()
    return prompts, [o.outputs[0] for o in outs]


def test_fp8_checkpoint_matches_transformers_on_the_dequantized_weights(fp8_checkpoint):
    path, hf = fp8_checkpoint
    prompts, outs = _generate(path)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = teacher_forcing_logprobs(hf, prompt, out.token_ids)  # [n, V]
        for i, token in enumerate(out.token_ids):
            assert ref[i, token] >= ref[i].max() - 1e-5
            assert abs(out.logprobs[i][token].logprob - float(ref[i, token])) < 1e-4


@pytest.mark.multirank
def test_two_ranks_give_one_ranks_tokens(fp8_checkpoint, monkeypatch):
    path, _ = fp8_checkpoint
    _, want = _generate(path)
    reads = spy_slice_reads(monkeypatch)
    _, got = _generate(path, tensor_parallel_size=2, expert_parallel_size=2)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for i, token in enumerate(w.token_ids):
            assert abs(g.logprobs[i][token].logprob - w.logprobs[i][token].logprob) < 1e-4
    assert not [n for n in reads["read"] if any(s in n for s in SPLIT)], reads["read"]
    assert {n for n in reads["narrow"] if ".kv_b_proj.weight_scale_inv" in n}  # scales read by block
    experts = [n for n in reads["read"] + reads["narrow"] if ".experts." in n]
    assert experts and all(int(n.split(".experts.")[1].split(".")[0]) < 4 for n in experts), experts
