"""`deepinfer info` plans DeepSeek-V3 671B on 8 x H200 (tensor_parallel_size 8, expert_parallel_size 8)
from its config alone: transformers' `DeepseekV3Config` defaults are the published shape (61 layers, 3
dense, hidden 7,168, 128 heads, kv_lora_rank 512 + 64 RoPE, 256 routed experts of 2,048, vocab 129,280),
with DeepSeek's FP8 quantization_config and YaRN (factor 40, 163,840 positions).

Each figure is recomputed here from the config's fields: one latent row per layer per token (K = V,
no factor 2) is 576 values: 1,152 B in bf16, 576 e4m3 + 18 UE8M0 scale bytes = 594 B as MXFP8.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from deepinfer.entrypoints import cli
from deepinfer.entrypoints.capacity_plan import plan_capacity

LENGTH = 32768
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory) -> str:
    """A config-only directory of DeepSeek-V3 (no weights)."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(rope_scaling=YARN, max_position_embeddings=163840, num_nextn_predict_layers=1).to_dict()
    path = tmp_path_factory.mktemp("deepseek_v3_671b")
    with open(path / "config.json", "w") as f:
        json.dump({**cfg, "quantization_config": FP8, "torch_dtype": "bfloat16"}, f)
    return str(path)


def figure(out: str, pattern: str) -> float:
    match = re.search(pattern, out)
    assert match, f"{pattern!r} not in:\n{out}"
    return float(match.group(1).replace(",", ""))


def fp8_bytes(rows: int, cols: int) -> int:
    """An e4m3 matrix and its fp32 weight_scale_inv, one per 128 x 128 block."""
    return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128) * 4


def test_planner_counts_every_value_of_the_checkpoint(v3_dir):
    """671.0B: the published size without the MTP layer; transformers' checkpoint of the config (its
    state dict on the meta device, the correction biases included) holds as many values."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(v3_dir, "config.json")) as f:
        planned = sum(w.params for w in plan_capacity(json.load(f)).weights)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(v3_dir))
    assert planned == sum(t.numel() for t in hf.state_dict().values()) and abs(planned / 671e9 - 1) < 0.001


@pytest.mark.multirank
@pytest.mark.parametrize(("kv_cache_dtype", "row_bytes"), [("bfloat16", 576 * 2), ("fp8", 576 + 576 // 32)])
def test_v3_on_eight_h200(v3_dir, capsys, kv_cache_dtype, row_bytes):
    assert cli.main(["info", "--model", v3_dir, "--tensor-parallel-size", "8", "--expert-parallel-size", "8",
                     "--max-model-len", str(LENGTH), "--kv-cache-dtype", kv_cache_dtype]) == 0
    out = capsys.readouterr().out
    print(out)
    layers, hidden, moe_layers = 61, 7168, 58
    # weights: 32 of 256 experts per MoE layer per rank, gate|up [4096, 7168] and down [7168, 2048] in FP8
    assert "32 of 256 experts per layer per rank" in out
    routed = 32 * moe_layers * (fp8_bytes(2 * 2048, hidden) + fp8_bytes(hidden, 2048))
    assert figure(out, r"routed experts: [\d,]+ params, ([\d,]+) B") == routed
    heads = 128 // 8
    attention = layers * (fp8_bytes(1536, hidden) + fp8_bytes(heads * 192, 1536) + fp8_bytes(576, hidden)
                          + fp8_bytes(heads * 256, 512) + fp8_bytes(hidden, heads * 128))  # its norms: "norms"
    assert figure(out, r"attention: [\d,]+ params, ([\d,]+) B") == attention
    per_rank = figure(out, r"total per rank: [\d,]+ params, ([\d,]+) B")
    assert 80e9 < per_rank < 90e9  # mostly the 32 experts' 82 GB
    # KV: one latent row per layer per token, replicated on every rank
    assert "bf16 1,152 B, MXFP8 594 B (576 e4m3 + 18 UE8M0 scale bytes); x 61 layers = 70,272 B / 36,234 B" in out
    assert figure(out, r"KV bytes per token: ([\d,.]+) B") == layers * row_bytes
    assert "replicated on every rank, not split" in out
    page = layers * 16 * row_bytes  # a block of 16 rows of every layer
    request = math.ceil(LENGTH / 16) * page
    assert figure(out, r"at once \(([\d,]+) B = ") == request
    fits = (int(141e9 * 0.9) - per_rank) // request
    assert figure(out, r"capacity: ([\d,]+) requests at 32,768 tokens") == fits > 10
    assert "1 MTP layer(s): weights not counted" in out
    resident = figure(out, r"dequantizes them to the compute dtype: ([\d,]+) B")
    assert resident > 2 * routed > 141e9 * 0.9 and "more than the 126,900,000,000 B usable" in out


@pytest.mark.multirank
def test_bad_split_is_refused_naming_it(v3_dir):
    with open(os.path.join(v3_dir, "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=128"):
        plan_capacity(cfg, 3, 1)
