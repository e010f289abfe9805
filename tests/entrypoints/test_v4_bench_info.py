"""`--load-format dummy`, `deepinfer info` and `deepinfer bench` on DeepSeek-V4 configs (no weights).

The shipped configs/deepseek_v4_flash_mini (real V4-Flash widths, 4 layers, 16 experts) takes about
a minute and 14 GB to build on a 2-core CPU, so the engine tests run a width-reduced copy of it
that keeps what the cache figures depend on: head_dim 512 (528 B MXFP8 rows), index_head_dim 128,
W = 128 (a ring of S = 134 rows), m = 4 / m' = 128, and the same layer types. The full-width config
itself is checked on the meta device (no memory).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from deepinfer.config import EngineConfig
from deepinfer.entrypoints import cli
from deepinfer.entrypoints.bench.workloads import make_workload
from deepinfer.model_executor.layers.ops.cache_common import get_inference_swa_block_size
from deepinfer.model_executor.loader import load_model_source

pytestmark = [pytest.mark.parity]

MINI = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "deepseek_v4_flash_mini")
SL, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
REDUCED = dict(hidden_size=64, num_attention_heads=2, q_lora_rank=32, o_groups=2, o_lora_rank=16,
               index_n_heads=2, n_routed_experts=8, moe_intermediate_size=32, vocab_size=512,
               max_position_embeddings=4096)


@pytest.fixture(scope="module")
def reduced_mini(tmp_path_factory) -> str:
    """configs/deepseek_v4_flash_mini with small widths, the cache-shaping ones kept; config.json only."""
    with open(os.path.join(MINI, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(REDUCED)
    path = tmp_path_factory.mktemp("v4-reduced")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(path)


def test_mini_config_has_v4_flash_widths_and_fits_a_24_gib_cpu():
    from transformers import AutoConfig

    from deepinfer.model_executor.models.registry import get_model_class

    cfg = AutoConfig.from_pretrained(MINI)
    assert cfg.model_type == "deepseek_v4" and cfg.layer_types == [SL, CSA, HCA, CSA]
    assert cfg.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    assert (cfg.hidden_size, cfg.head_dim, cfg.qk_rope_head_dim, cfg.num_attention_heads) == (4096, 512, 64, 64)
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.sliding_window) == (1024, 8, 1024, 128)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.vocab_size) == (64, 128, 512, 129280)
    assert cfg.compress_rates == {CSA: 4, HCA: 128}
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hc_mult) == (16, 6, 2048, 4)
    with torch.device("meta"):
        model = get_model_class(cfg.model_type)(cfg, 4096)
    params = sum(p.numel() for p in model.parameters())
    assert params == 3_244_994_317  # docs/deepseek_v4.md: 12.1 GiB in fp32, 6.0 GiB in bf16
    assert params * 4 < 13 * 2**30


def test_unknown_load_format_is_refused_naming_field_and_value(reduced_mini):
    with pytest.raises(ValueError, match=r"load_format.*'safetensors'"):
        EngineConfig(load_format="safetensors")
    with pytest.raises(ValueError, match=r"load_format.*'bogus'"):
        load_model_source(reduced_mini, load_format="bogus")
    assert EngineConfig().load_format == "auto"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["info", "--load-format", "bogus"])


def test_dummy_needs_only_config_json_and_is_deterministic(reduced_mini):
    from deepinfer.worker.model_runner import build_model

    with pytest.raises(ValueError, match="safetensors"):
        load_model_source(reduced_mini)  # auto: the weights are missing
    source = load_model_source(reduced_mini, load_format="dummy")
    assert source.load_format == "dummy" and source.tokenizer is None
    assert load_model_source(source) is source
    a = build_model(source, torch.float32, torch.device("cpu"), 256)
    b = build_model(source, torch.float32, torch.device("cpu"), 256)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert all(torch.equal(pa[name], pb[name]) for name in pa)
    q = pa["model.layers.0.self_attn.q_b_proj.weight"].detach()
    assert 0.015 < float(q.std()) < 0.025 and abs(float(q.mean())) < 0.002
    assert torch.equal(pa["model.layers.0.input_layernorm.weight"], torch.ones(64))
    assert torch.equal(pa["model.layers.1.mlp.gate.e_score_correction_bias"], torch.zeros(8))
    assert torch.equal(pa["model.layers.0.attn_hc.scale"], torch.ones(3))
    tid2eid = pa["model.layers.0.mlp.gate.tid2eid"]  # [vocab, k]: k distinct experts per token
    assert tid2eid.shape == (512, 6) and 0 <= int(tid2eid.min()) and int(tid2eid.max()) < 8
    assert all(len(set(row)) == 6 for row in tid2eid.tolist())
    assert len({tuple(row) for row in tid2eid.tolist()}) > 100


def test_info_prints_each_groups_row_format_ring_and_compression(reduced_mini, capsys):
    ring = get_inference_swa_block_size(128)
    assert ring == 134  # the default allowance: W + max(0, 5 + 1)
    assert cli.main(["info", "--model", reduced_mini, "--load-format", "dummy", "--kv-cache-dtype", "fp8",
                     "--max-num-seqs", "4", "--kv-cache-memory", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "(dummy weights" in out
    # the latent K = V row: 512 e4m3 + 16 UE8M0 scale bytes; the index keys: 128 + 4
    assert "cache group 'swa' (ring, 4 layers): row MXFP8 K=V latent row, 512 elements = 528 B per row " \
           "(512 data + 16 scale)" in out
    assert "window W=128: 128 visible rows, 134 allocated rows (S) per request per layer = 70,752 B per layer, " \
           "283,008 B per request" in out
    assert re.search(r"'csa' \(paged, 2 layers\).* = 528 B per row", out)
    assert re.search(r"'index' \(paged, 2 layers\).*128 elements = 132 B per row", out)
    assert "1 row per 4 tokens, 16 rows = 64 tokens per block; 264 B per token (528 B / 4 x 2 layers)" in out
    assert "1 row per 128 tokens, 32 rows = 4,096 tokens per block; 4.125 B per token" in out
    assert "1 row per 4 tokens, 64 rows = 256 tokens per block; 66 B per token (132 B / 4 x 2 layers)" in out
    assert "pages of 16,896 B" in out  # one page size: 16 rows x 2 layers x 528 B
    # per layer; compressor state: CSA 6 * 4 * (512 + 128) * 4 B, HCA 2 * 128 * 512 * 4 B
    assert "layer 0 (sliding_attention): 0 B per token + 70,752 B per request" in out
    assert "layer 1 (compressed_sparse_attention): 165 B per token + 132,192 B per request" in out
    assert "layer 2 (heavily_compressed_attention): 4.125 B per token + 595,040 B per request" in out
    assert "compressor state per request (fp32, all layers): 647,168 B" in out
    assert "KV bytes per token, all layers: 334.125 B (paged rows, growing) + 930,176 B per request" in out
    assert re.search(r"capacity: 4 requests at max_model_len 4096 at once \(81 blocks", out)
    # 81 = 1,024 csa rows / 16 + 32 hca rows / 32 + 1,024 index keys / 64


def test_info_bf16_rows_are_1024_bytes(reduced_mini, capsys):
    assert cli.main(["info", "--model", reduced_mini, "--load-format", "dummy", "--dtype", "bfloat16",
                     "--max-num-seqs", "2", "--kv-cache-memory", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "512 elements = 1,024 B per row (1,024 data + 0 scale)" in out
    assert "128 visible rows, 134 allocated rows (S)" in out


def test_workload_prompts_are_token_ids_and_max_tokens_caps_outputs():
    full, capped = make_workload("cpu32", 512, 4), make_workload("cpu32", 512, 4, max_output_len=5)
    assert all(isinstance(t, int) and 100 <= t < 512 for p in full.prompts for t in p)
    assert capped.prompts == full.prompts and capped.output_lens == [min(n, 5) for n in full.output_lens]


@pytest.mark.bench
def test_bench_dummy_v4_reports_tokens_per_s_and_kv_bytes(reduced_mini, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert cli.main(["bench", "--model", reduced_mini, "--load-format", "dummy", "--workload", "cpu32",
                     "--num-requests", "2", "--max-tokens", "3", "--max-num-seqs", "2", "--kv-cache-memory", "64MiB",
                     "--kv-cache-dtype", "fp8", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    (result,) = json.loads(out_json.read_text())
    assert result["output_tokens"] == 6 and result["tokens_per_s"] > 0
    assert re.search(r"cpu32 +deepinfer +6 tokens in .* = +\d+\.\d+ tok/s", out)
    assert "MISMATCH" not in out
    assert "kv       swa    ring  4 layers, rows of 528 B, ring of S = 134 rows per layer: engine 283,008 B " \
           "per request, fixed; formula 4 layers x S 134 x 528 B = 283,008 B [ok]" in out
    assert "engine 264 B per token; formula 2 x 528 B / 4 = 264 B [ok]" in out
    assert "engine 4.125 B per token; formula 1 x 528 B / 128 = 4.125 B [ok]" in out
    assert "engine 66 B per token; formula 2 x 132 B / 4 = 66 B [ok]" in out
    assert "engine 647,168 B per request" in out and "kv       total  334.125 B per token" in out
    assert "kv       book   payload at L = 4,096" in out and "kv       cpu32  allocated for its 2 requests" in out


@pytest.mark.bench
def test_bench_refuses_peers_with_dummy_weights(reduced_mini, tmp_path, capsys):
    """Dummy weights have a peer only for V4 in transformers (which then runs our weights)."""
    from tiny_models import tiny_config

    assert cli.main(["bench", "--model", reduced_mini, "--load-format", "dummy", "--peer", "llama.cpp"]) == 2
    assert "load_format='dummy'" in capsys.readouterr().err
    tiny_config("llama").save_pretrained(tmp_path)  # config.json only
    assert cli.main(["bench", "--model", str(tmp_path), "--load-format", "dummy", "--peer", "hf"]) == 2
    err = capsys.readouterr().err
    assert "load_format='dummy'" in err and "model_type is 'llama'" in err


@pytest.mark.bench
def test_bench_dummy_v4_runs_hf_peer_on_the_same_weights_at_batch_1(reduced_mini, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert cli.main(["bench", "--model", reduced_mini, "--load-format", "dummy", "--peer", "hf", "--num-requests", "2",
                     "--workload", "cpu32", "--workload", "decode1",
                     "--max-tokens", "8", "--max-num-seqs", "2", "--kv-cache-memory", "64MiB",
                     "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    results = {(r["workload"], r["engine"]): r for r in json.loads(out_json.read_text())}
    assert set(results) == {(w, e) for w in ("cpu32", "decode1") for e in ("deepinfer", "hf-batch1")}
    for (workload, _), r in results.items():
        assert r["output_tokens"] == (16 if workload == "cpu32" else 8) and r["tokens_per_s"] > 0
    assert re.search(r"cpu32 +hf-batch1 +16 tokens in .* = +\d+\.\d+ tok/s", out)
    assert re.search(r"decode1 +hf-batch1 +8 tokens in .* = +\d+\.\d+ tok/s", out)
    assert "one request at a time" in out
    for workload in ("cpu32", "decode1"):
        ratio = float(re.search(rf"{workload} +deepinfer / hf-batch1: (\d+\.\d+)x", out).group(1))
        want = results[(workload, "deepinfer")]["tokens_per_s"] / results[(workload, "hf-batch1")]["tokens_per_s"]
        assert ratio == pytest.approx(want, abs=0.006)


@pytest.fixture(scope="module")
def reduced_llm(reduced_mini):
    from deepinfer import LLM

    return LLM(reduced_mini, load_format="dummy", max_num_seqs=2, kv_cache_memory="64MiB", max_model_len=512)


def test_hf_v4_state_dict_is_a_strict_load_and_shares_storage(reduced_llm):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM

    from deepinfer.entrypoints.bench.peers.hf import hf_v4_model, hf_v4_state_dict

    ours = reduced_llm.engine.runner.model
    state = hf_v4_state_dict(ours)
    config = reduced_llm.engine.source.hf_config
    with torch.device("meta"):
        meta = DeepseekV4ForCausalLM(config)
    want = meta.state_dict()  # persistent parameters and buffers (tid2eid, e_score_correction_bias)
    assert set(state) == set(want)
    assert all(state[k].shape == want[k].shape and state[k].dtype == want[k].dtype for k in want)
    non_persistent = {n for n, _ in meta.named_buffers()} - set(want)
    assert non_persistent and all(re.search(r"rotary_emb\.\w+_inv_freq$", n) for n in non_persistent)
    # the shared expert: rows [0, I) are gate, [I, 2I) up, views of our merged weight
    merged = dict(ours.named_parameters())["model.layers.1.mlp.shared_experts.gate_up_proj.weight"]
    gate, up = state["model.layers.1.mlp.shared_experts.gate_proj.weight"], \
        state["model.layers.1.mlp.shared_experts.up_proj.weight"]
    assert gate.data_ptr() == merged.data_ptr() and torch.equal(torch.cat([gate, up]), merged)
    assert state["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64

    hf = hf_v4_model(config, dict(state))
    assert hf.model.embed_tokens.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # no copy
    assert hf.config._attn_implementation == "eager" and config is not hf.config
    reference = DeepseekV4ForCausalLM(hf.config)  # built on the CPU: its rotary buffers from __init__
    ref_buffers = dict(reference.named_buffers())
    for name in non_persistent:
        assert torch.equal(dict(hf.named_buffers())[name], ref_buffers[name]), name


def test_hf_peer_logits_and_greedy_tokens_equal_the_engines(reduced_llm):
    """fp32: the engine's top-20 logprobs at each of 6 greedy steps on a 40-token prompt equal
    transformers' full forward on our weights; its cached batch-1 generate picks the same tokens."""
    import random

    from tiny_models import teacher_forcing_logprobs

    from deepinfer import SamplingParams
    from deepinfer.entrypoints.bench.peers.hf import hf_v4_model, hf_v4_state_dict

    rng = random.Random(1)
    prompt = [rng.randrange(100, 512) for _ in range(40)]
    out = reduced_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=20),
                               use_tqdm=False)[0].outputs[0]
    hf = hf_v4_model(reduced_llm.engine.source.hf_config, hf_v4_state_dict(reduced_llm.engine.runner.model))
    with torch.inference_mode():
        ref = teacher_forcing_logprobs(hf, prompt, out.token_ids)  # [6, V]
        ids = torch.tensor([prompt])
        generated = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                min_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)[0, 40:]
    assert int(ref[0].argmax()) == out.token_ids[0]
    assert generated.tolist() == out.token_ids
    worst = 0.0
    for i, token in enumerate(out.token_ids):
        assert int(ref[i].argmax()) == token
        assert len(out.logprobs[i]) >= 20
        for t, lp in out.logprobs[i].items():
            worst = max(worst, abs(lp.logprob - float(ref[i, t])))
    assert worst < 1e-4, worst
    assert float(ref[0].topk(2).values.diff().abs()) > 10 * worst  # the first pick is not a near-tie


def test_dummy_v4_peer_frees_the_engine_before_building_hf(reduced_mini):
    import weakref

    from deepinfer import LLM
    from deepinfer.entrypoints.bench.peers import run_dummy_v4_peer

    llm = LLM(reduced_mini, load_format="dummy", max_num_seqs=2, kv_cache_memory="64MiB", max_model_len=512)
    engine, runner = weakref.ref(llm.engine), weakref.ref(llm.engine.runner)
    (result,) = run_dummy_v4_peer(llm, [make_workload("decode1", 512, max_output_len=3)])
    assert engine() is None and runner() is None
    assert (result.engine, result.workload, result.output_tokens) == ("hf-batch1", "decode1", 3)
