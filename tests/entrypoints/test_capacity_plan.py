"""`deepinfer info --tensor-parallel-size N --expert-parallel-size M`: the capacity plan from config.json.

configs/deepseek_v4_flash is the published DeepSeek-V4-Flash shape (no weights): the widths of
configs/deepseek_v4_flash_3l (hidden 4096, 64 heads of 512, q/o LoRA 1024, 8 o_groups, 256 routed experts
of 2048, 6 per token, 1 shared, vocab 129,280, index 64 x 128, window 128, m = 4, m' = 128) over 43 layers.
Its layer_types are transformers' DeepSeek-V4 default (`DeepseekV4Config`, checkpoint
deepseek-ai/DeepSeek-V4-Flash-Base): 2 HCA layers, then CSA / HCA alternating, which gives the issue's 20 CSA
and 23 HCA layers (43 = 20 + 23: no sliding-only layer; every layer also has its 128-token window ring);
3 hash-routed MoE layers first (transformers' default), one MTP layer; routed experts FP4, projections FP8
(UE8M0 scales, 128 x 128 blocks) as DeepSeek ships them.

The issue's figures (#17): about 154 GB of weights (277B routed-expert parameters in FP4 plus about 6.7B in
FP8), about 3.4 KB of KV per token in MXFP8 (20 CSA layers at 165 B, 23 HCA layers at about 4 B). Each
test below recomputes the printed numbers from the config's fields with its own arithmetic, not the
planner's helpers. Our weight total is 155.7 GB: the non-expert parameters count 7.3B (284.3B in all, the
published 284B), with embeddings and LM head kept in bf16; so it matches 154 GB within 2%.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from deepinfer.entrypoints import cli
from deepinfer.entrypoints.capacity_plan import hf_config_of, load_config, plan_capacity

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
FLASH = os.path.join(CONFIGS, "deepseek_v4_flash")
QWEN3 = os.path.join(CONFIGS, "qwen3_0_6b")
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def run_info(capsys, *argv) -> str:
    assert cli.main(["info", *argv]) == 0
    return capsys.readouterr().out


def figure(out: str, pattern: str) -> float:
    """The number the regex group captures in the printed plan (commas dropped)."""
    match = re.search(pattern, out)
    assert match, f"{pattern!r} not in:\n{out}"
    return float(match.group(1).replace(",", ""))


@pytest.fixture(scope="module")
def flash() -> dict:
    with open(os.path.join(FLASH, "config.json")) as f:
        return json.load(f)


def test_flash_config_is_the_published_shape(flash):
    from transformers import AutoConfig

    types = flash["layer_types"]
    assert flash["num_hidden_layers"] == len(types) == 43
    assert (types.count(CSA), types.count(HCA), types.count("sliding_attention")) == (20, 23, 0)
    assert types[:4] == [HCA, HCA, HCA, CSA]  # 2 HCA layers, then HCA / CSA alternating
    assert flash["mlp_layer_types"] == ["hash_moe"] * 3 + ["moe"] * 40
    assert (flash["n_routed_experts"], flash["moe_intermediate_size"], flash["hidden_size"]) == (256, 2048, 4096)
    assert flash["quantization_config"]["expert_dtype"] == "fp4"
    cfg = AutoConfig.from_pretrained(FLASH)
    assert cfg.layer_types == types and cfg.sliding_window == 128 and cfg.qk_rope_head_dim == 64


def test_planner_counts_every_parameter_the_model_builds():
    """At one rank the plan's parameters equal the meta-device build of configs/deepseek_v4_flash_mini
    (3,244,994,317, pinned in test_v4_bench_info); the Flash routed experts are the issue's 277B."""
    mini = plan_capacity(load_config(os.path.join(CONFIGS, "deepseek_v4_flash_mini")))
    assert sum(w.params for w in mini.weights) == 3_244_994_317
    routed = sum(w.params for w in plan_capacity(load_config(FLASH)).weights if w.part == "routed experts")
    assert routed == 256 * 43 * 3 * 4096 * 2048 and abs(routed / 277e9 - 1) < 0.001


def test_qwen3_plan_counts_every_parameter_the_model_builds():
    import torch
    from transformers import AutoConfig

    from deepinfer.model_executor.models.registry import get_model_class

    cfg = AutoConfig.from_pretrained(QWEN3)
    with torch.device("meta"):
        model = get_model_class(cfg.model_type)(cfg, 4096)
    built = sum(p.numel() for p in model.parameters())
    assert sum(w.params for w in plan_capacity(load_config(QWEN3)).weights) == built


def test_v4_flash_plan_at_tp8_ep8_matches_the_formula_and_the_issue(flash, capsys):
    out = run_info(capsys, "--model", FLASH, "--tensor-parallel-size", "8", "--expert-parallel-size", "8",
                   "--max-model-len", "131072")
    h, inter, layers = flash["hidden_size"], flash["moe_intermediate_size"], flash["num_hidden_layers"]
    # routed experts: 256 / 8 = 32 per layer per rank; FP4 = half a byte per value + 1 B per 32 input values
    fp4 = 2 * inter * (h // 2 + h // 32) + h * (inter // 2 + inter // 32)
    assert "32 of 256 experts per layer per rank" in out
    assert figure(out, r"routed experts: [\d,]+ params, ([\d,]+) B") == 32 * layers * fp4
    # MXFP8 rows: 512 + 512/32 = 528 B latent, 128 + 4 = 132 B index key
    csa = (528 + 132) / 4
    hca = 528 / 128
    assert csa == 165 and abs(hca / 4 - 1) < 0.05  # the issue: CSA 165 B, HCA about 4 B
    assert "CSA 165 B per token per layer x 20, HCA 4.125 B per token per layer x 23" in out
    per_token = 20 * csa + 23 * hca
    assert figure(out, r"KV bytes per token: ([\d,.]+) B") == per_token == 3394.875
    assert abs(per_token / 3400 - 1) < 0.01  # about 3.4 KB per token
    ring = 43 * (128 + 6) * 528  # S = W + max(backtracking 0, nextn 5 + 1) = 134 rows per layer
    state = 20 * 4 * (2 * 4 * 1024 + 2 * 4 * 512 + 2 * 4 * 256 + 2 * 4 * 128) + 23 * 4 * (2 * 128 * 512)
    assert figure(out, r"window ring: .* = ([\d,]+) B per request") == ring
    assert figure(out, r"fixed per request: ([\d,]+) B") == ring + state
    assert "replicated on every rank, not split" in out
    # weights: the model unsplit is about 154 GB; what fits next to one rank's share at 131,072 tokens
    unsplit = figure(out, r"the model unsplit: ([\d,]+) B")
    assert abs(unsplit / 154e9 - 1) < 0.02
    per_rank = figure(out, r"total per rank: [\d,]+ params, ([\d,]+) B")
    assert unsplit / 8 < per_rank < unsplit / 6  # mostly split: replicated attention parts and routers
    # a request takes whole pages of the pool the paged groups share, as the engine allocates them
    # (worker/cache_sizing.py): one page = 16 rows of the widest group (HCA: 23 layers x 528 B), and
    # each group fits as many of its rows as the page holds; so 2,334 pages, not 20 x 32,768 x 660
    # + 23 x 1,024 x 528 B of exact rows (1.8% fewer than the engine needs)
    length, page = 131072, 16 * 23 * 528
    assert "pages of 194,304 B" in out
    csa_rows, hca_rows, index_rows = page // (20 * 528), page // (23 * 528), page // (20 * 132)
    assert (csa_rows, hca_rows, index_rows) == (18, 16, 73)
    pages = -(-(length // 4) // csa_rows) + -(-(length // 128) // hca_rows) + -(-(length // 4) // index_rows)
    request = ring + state + pages * page
    fits = (int(141e9 * 0.9) - per_rank) // request
    assert figure(out, r"capacity: ([\d,]+) requests at 131,072 tokens") == fits > 100
    assert figure(out, r"at once \(([\d,]+) B = ") == request == 469_835_296


def test_qwen3_at_tp2_splits_attention_mlp_and_vocab(capsys):
    cfg = load_config(QWEN3)
    out = run_info(capsys, "--model", QWEN3, "--tensor-parallel-size", "2")
    h, d, n = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"]
    heads, kv, inter = 16 // 2, 8 // 2, 3072 // 2
    attention = n * (h * (heads + 2 * kv) * d + heads * d * h)
    assert figure(out, r"attention: ([\d,]+) params") == attention
    assert "8 of 16 heads per rank, 4 of 8 kv heads" in out
    assert figure(out, r"MLP: ([\d,]+) params") == n * 3 * h * inter
    vocab_rows = math.ceil(151936 / 2)
    assert figure(out, r"embedding \+ LM head: ([\d,]+) params") == vocab_rows * h  # tied: one matrix
    assert f"{vocab_rows:,} of 151,936 vocab rows per rank (tied: one matrix)" in out
    assert figure(out, r"KV bytes per token: ([\d,.]+) B") == n * 2 * kv * d * 2  # bf16 K and V of 4 kv heads
    assert figure(out, r"total per rank: [\d,]+ params, ([\d,]+) B") == 2 * (
        attention + n * 3 * h * inter + vocab_rows * h + (2 * n + 1) * h + 2 * n * d)


def test_config_only_directory_is_planned_without_building(monkeypatch, capsys):
    def refuse(args):
        raise AssertionError("info built the engine for a config-only directory")

    monkeypatch.setattr(cli, "make_llm", refuse)
    out = run_info(capsys, "--model", FLASH, "--tensor-parallel-size", "8", "--expert-parallel-size", "8")
    assert out.startswith("capacity plan: deepseek_v4") and "1,048,576 tokens" in out


def test_buildable_model_prints_info_then_the_plan(tiny_checkpoint, capsys):
    out = run_info(capsys, "--model", tiny_checkpoint("llama"), "--kv-cache-memory", "1MiB",
                   "--tensor-parallel-size", "2")
    assert "512 B per token; 128 blocks x 16" in out  # the engine's own info, unchanged
    assert out.index("KV bytes per token, all layers") < out.index("capacity plan: llama")


@pytest.mark.parametrize("model, tp, ep, cfg_change, message", [
    (FLASH, 3, 1, {}, "tensor_parallel_size=3 does not divide num_attention_heads=64"),
    (FLASH, 8, 8, {"n_routed_experts": 100}, "n_routed_experts=100 is not divisible by expert_parallel_size=8"),
    (FLASH, 2, 4, {}, "expert_parallel_size=4 must divide tensor_parallel_size=2"),
    (FLASH, 16, 1, {}, "tensor_parallel_size=16 does not divide o_groups=8"),
    (QWEN3, 2, 2, {}, "expert_parallel_size=2 but qwen3 has no routed experts"),
    (QWEN3, 32, 1, {}, "tensor_parallel_size=32 does not divide num_attention_heads=16"),
    (QWEN3, 0, 1, {}, "tensor_parallel_size must be a positive integer, got 0"),
])
def test_bad_sizes_are_refused_naming_them(model, tp, ep, cfg_change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_capacity({**load_config(model), **cfg_change}, tp, ep)


def test_cli_reports_bad_sizes_as_an_error(capsys):
    assert cli.main(["info", "--model", FLASH, "--tensor-parallel-size", "3"]) == 2
    assert "tensor_parallel_size=3 does not divide num_attention_heads=64" in capsys.readouterr().err


def _family_config(model_type: str) -> dict:
    """A small config of each newer Llama-family type (some dense layers, biases, shared experts)."""
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    configs = {
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                               num_experts=8, num_experts_per_tok=2, head_dim=16,
                                               mlp_only_layers=[1], decoder_sparse_step=1),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=48, num_experts=8,
                                               num_experts_per_tok=2, decoder_sparse_step=2),
        "mixtral": lambda: tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
        "gemma2": lambda: tf.Gemma2Config(**common, intermediate_size=96, head_dim=16),
        "phi3": lambda: tf.Phi3Config(**common, intermediate_size=96),
        "gpt_oss": lambda: tf.GptOssConfig(**common, intermediate_size=32, num_local_experts=4, head_dim=16,
                                           num_experts_per_tok=2, sliding_window=16,
                                           layer_types=["sliding_attention", "full_attention"] * 2),
    }
    return configs[model_type]().to_dict()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral", "gemma2", "phi3", "gpt_oss"])
def test_llama_family_plans_count_every_parameter_the_model_builds(model_type):
    """Dense and MoE members: the plan's parameters at one rank equal the meta-device build, and at
    expert_parallel_size 2 the routed experts halve (the rest does not move)."""
    import torch

    from deepinfer.model_executor.models.registry import get_model_class

    cfg = _family_config(model_type)
    with torch.device("meta"):
        model = get_model_class(model_type)(hf_config_of(cfg), 256)
    built = sum(p.numel() for p in model.parameters())
    assert sum(w.params for w in plan_capacity(cfg).weights) == built
    if model_type in ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"):
        one, two = (plan_capacity(cfg, tp=2, ep=ep).part_totals() for ep in (1, 2))
        assert two["routed experts"][0] * 2 == one["routed experts"][0]
        assert {k: v for k, v in two.items() if k != "routed experts"} == \
            {k: v for k, v in one.items() if k != "routed experts"}
