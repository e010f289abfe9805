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

The planner sums the parameters of the model it builds on the meta device, in the stored formats their
layers declare; the tests below hold those sums to counts made without our model code: the checkpoint
transformers would write for the config (its state dict, on the meta device), and the bytes of tiny
checkpoints as stored (dense, GPT-OSS's MXFP4 experts, DeepSeek-V4's FP8 projections and FP4 experts).
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


def hf_checkpoint_values(cfg: dict) -> int:
    """Values in the checkpoint transformers writes for `cfg` (its state dict: parameters and persistent
    buffers, a tied matrix once), counted on the meta device: independent of our model code."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config_of({**cfg, "pad_token_id": None}))
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() for t in tensors.values())


def stored_bytes(path: str) -> int:
    """Bytes of every tensor of a checkpoint directory's safetensors files, as stored."""
    from safetensors import safe_open

    total = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                total += sum(f.get_tensor(key).nbytes for key in f.keys())
    return total


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


def test_planner_counts_every_value_of_the_checkpoint():
    """At one rank the plan's parameters are transformers' checkpoint of configs/deepseek_v4_flash_mini
    (3,244,994,317, pinned in test_v4_bench_info; no MTP layer); the Flash routed experts are the issue's 277B."""
    cfg = load_config(os.path.join(CONFIGS, "deepseek_v4_flash_mini"))
    assert sum(w.params for w in plan_capacity(cfg).weights) == hf_checkpoint_values(cfg) == 3_244_994_317
    routed = sum(w.params for w in plan_capacity(load_config(FLASH)).weights if w.part == "routed experts")
    assert routed == 256 * 43 * 3 * 4096 * 2048 and abs(routed / 277e9 - 1) < 0.001


def test_qwen3_plan_counts_every_value_of_the_checkpoint():
    cfg = load_config(QWEN3)
    assert sum(w.params for w in plan_capacity(cfg).weights) == hf_checkpoint_values(cfg) == 596_049_920


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_plan_counts_the_stored_bytes_of_a_tiny_checkpoint(tiny_checkpoint, arch):
    """fp32 checkpoints (gemma3's tied head once): the plan at one rank is the file's tensors, byte for byte."""
    path = tiny_checkpoint(arch)
    assert plan_capacity(load_config(path)).weight_bytes == stored_bytes(path)


def test_plan_counts_packed_mxfp4_experts_as_stored(tmp_path, tokenizer_dir):
    """GPT-OSS's experts held packed (blocks + scales, 17 B per 32 values), the rest fp32, as the file is."""
    from models.test_gpt_oss import write_mxfp4_checkpoint

    write_mxfp4_checkpoint(str(tmp_path), tokenizer_dir)
    plan = plan_capacity(load_config(str(tmp_path)))
    assert plan.weight_bytes == stored_bytes(str(tmp_path))
    assert {w.fmt for w in plan.weights if w.part == "routed experts"} == {"mxfp4 blocks", "mxfp4 scales", "fp32"}


@pytest.fixture(scope="module")
def v4_quantized_dir(tmp_path_factory) -> str:
    """A tiny DeepSeek-V4 checkpoint as DeepSeek ships it (models/deepseek_v4/test_v4_checkpoint.py's
    quantizers): FP4 routed experts, FP8 projections with UE8M0 block scales, the rest fp32."""
    from models.deepseek_v4.test_v4_checkpoint import (
        FP4_NAME,
        QUANTIZATION_CONFIG,
        is_fp8_target,
        quantize_fp4,
        quantize_fp8,
        randomize,
        v4_config,
    )
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM

    root = tmp_path_factory.mktemp("v4-stored")
    model = DeepseekV4ForCausalLM(v4_config()).eval()
    randomize(model)
    model.save_pretrained(root)
    tensors = {}
    for name, t in load_file(os.path.join(root, "model.safetensors")).items():
        quantize = quantize_fp4 if FP4_NAME.search(name) else quantize_fp8 if is_fp8_target(name, t) else None
        if quantize is None:
            tensors[name] = t
        else:
            tensors[name], tensors[name[: -len("weight")] + "scale"], _ = quantize(t)
    save_file(tensors, os.path.join(root, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(root, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": {**QUANTIZATION_CONFIG, "expert_dtype": "fp4"}}, f)  # as DeepSeek's
    return str(root)


def test_plan_counts_fp8_and_fp4_weights_as_stored(v4_quantized_dir):
    """Every FP8 matrix with its block scales (gate and up two matrices), every FP4 expert with its
    group scales, mHC, sinks, position biases fp32, the hash table int64: the file's bytes exactly."""
    plan = plan_capacity(load_config(v4_quantized_dir), kv_cache_dtype="bfloat16")  # index keys of 16: no MXFP8
    assert plan.weight_bytes == stored_bytes(v4_quantized_dir)
    formats = {(w.part, w.fmt) for w in plan.weights}
    assert {("routed experts", "fp4"), ("shared experts", "fp8"), ("attention", "fp8"),
            ("compressors + indexer", "fp8"), ("mHC", "fp32"), ("routers", "int64")} <= formats


@pytest.mark.multirank
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
    # mostly split; whole on every rank: the vocabulary, the shared experts, compressors, routers, q_a, kv
    assert unsplit / 8 < per_rank < unsplit / 6
    vocab = 2 * 129280 * h * 2  # embedding and LM head, bf16
    blocks = 3 * (inter // 128) * (h // 128)  # gate, up, down: one UE8M0 scale byte per 128 x 128 block
    shared = layers * (3 * h * inter + blocks)  # e4m3 values + scales
    assert figure(out, r"embedding \+ LM head: [\d,]+ params, ([\d,]+) B") == vocab
    assert figure(out, r"shared experts: [\d,]+ params, ([\d,]+) B") == shared
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


@pytest.mark.multirank
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


@pytest.mark.multirank
def test_config_only_directory_is_planned_without_building(monkeypatch, capsys):
    def refuse(args):
        raise AssertionError("info built the engine for a config-only directory")

    monkeypatch.setattr(cli, "make_llm", refuse)
    out = run_info(capsys, "--model", FLASH, "--tensor-parallel-size", "8", "--expert-parallel-size", "8")
    assert out.startswith("capacity plan: deepseek_v4") and "1,048,576 tokens" in out


@pytest.mark.multirank
def test_buildable_model_prints_info_then_the_plan(tiny_checkpoint, capsys):
    out = run_info(capsys, "--model", tiny_checkpoint("llama"), "--kv-cache-memory", "1MiB",
                   "--tensor-parallel-size", "2")
    assert "512 B per token; 128 blocks x 16" in out  # the engine's own info, unchanged
    assert out.index("KV bytes per token, all layers") < out.index("capacity plan: llama")


@pytest.mark.multirank
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


@pytest.mark.multirank
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


@pytest.mark.multirank
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral", "gemma2", "phi3", "gpt_oss"])
def test_llama_family_plans_count_every_value_of_the_checkpoint(model_type):
    """Dense and MoE members: the plan's parameters at one rank are transformers' checkpoint, every
    part is named, and at expert_parallel_size 2 the routed experts halve (the rest does not move)."""
    cfg = _family_config(model_type)
    plan = plan_capacity(cfg)
    assert sum(w.params for w in plan.weights) == hf_checkpoint_values(cfg)
    assert "other" not in plan.part_totals()
    if model_type in ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"):
        one, two = (plan_capacity(cfg, tp=2, ep=ep).part_totals() for ep in (1, 2))
        assert two["routed experts"][0] * 2 == one["routed experts"][0]
        assert {k: v for k, v in two.items() if k != "routed experts"} == \
            {k: v for k, v in one.items() if k != "routed experts"}
