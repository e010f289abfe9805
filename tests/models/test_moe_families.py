"""Qwen3-MoE, Qwen2-MoE and Mixtral (models/moe_llama.py) against HF transformers on tiny random models
(tests/moe_tiny.py: hidden 64, 8 experts top-2 of size 32, weights of std 0.08, so routing matters).

- fp32 through the engine (chunked prefill, a block pool that forces preemption): each greedy token is
  HF's argmax under teacher forcing and its log-probability within 1e-4 of HF's.
- GGUF files written from the same models, experts quantized (Q8_0; Q5_1 gate|up with Q4_0 down; Q4_1;
  and a model of hidden 256 in Q4_K / Q5_K / Q6_K): the experts stay packed at their file size and at
  least 97% of greedy tokens are the argmax of HF's forward of the stored (dequantized) weights.
- `--quantization int8` packs the experts too (the routers stay fp32): the same agreement against HF
  with every matrix it quantizes rounded through Q8_0.
- DEEPINFER_BATCH_INVARIANT=1: stacked and packed experts give a request the same bits alone and batched.
- The grouped quantized expert matmul equals a per-expert dequantize-then-matmul reference on odd shapes,
  and bit for bit the same pairs run one row at a time.
- Stacked checkpoint experts, the GGUF config fields, and refusals naming the field.
"""

from __future__ import annotations

import contextlib
import random

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from moe_tiny import FAMILIES, make_tiny_moe, packed_matrix, random_moe_model, tiny_moe_config, write_moe_gguf
from tiny_models import assert_teacher_forcing, hf_reference, teacher_forcing_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.layers.fused_moe import FusedExperts, QuantFusedExperts, quant_grouped_experts
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref, qmatmul
from deepinfer.model_executor.layers.quant_linear import kind_runs, packed_weights
from deepinfer.model_executor.layers.router import Router
from deepinfer.model_executor.loader.gguf import packed_file_bytes
from deepinfer.model_executor.loader.gguf_config import gguf_config_dict
from deepinfer.model_executor.loader.source import load_model_source
from deepinfer.model_executor.models.moe_llama import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

pytestmark = [pytest.mark.parity]

MIN_AGREEMENT = 0.97
MAX_PACKED_RATIO = 1.05  # packed bytes held over the file's bytes of those tensors
WIDE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, vocab_size=4096)  # K-quant rows
GGUF_CASES = {  # GGUF name fragment -> ggml type; F32 routers, 1-D tensors and rows a block does not tile
    "qwen3_moe-Q8_0": ("qwen3_moe", {}, {"default": "Q8_0"}),
    "qwen2_moe-Q5_1-Q4_0": ("qwen2_moe", {}, {"ffn_down_exps": "Q4_0", "_exps": "Q5_1", "default": "Q8_0"}),
    "mixtral-Q4_1": ("mixtral", {}, {"_exps": "Q4_1", "default": "Q8_0"}),
    "qwen3_moe-K": ("qwen3_moe", WIDE, {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q5_K", "ffn_down_exps": "Q6_K",
                                        "default": "Q8_0"}),
    "qwen3_moe-IQ": ("qwen3_moe", WIDE, {"ffn_gate_exps": "IQ2_XXS", "ffn_up_exps": "IQ3_S", "ffn_down_exps": "IQ1_M",
                                         "default": "Q8_0"}),
}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory, tokenizer_dir):
    """moe_checkpoint(family) -> a saved tiny random HF checkpoint (built once per module)."""
    cache: dict[str, str] = {}

    def build(family: str) -> str:
        if family not in cache:
            cache[family] = make_tiny_moe(family, str(tmp_path_factory.mktemp(family)), tokenizer_dir)
        return cache[family]

    return build


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list:
    """Greedy completions with logprobs, stepping the engine; every block is returned after."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    engine.kv_manager.check_no_leaks()
    return [done[i] for i in ids]


def _agreement(llm: LLM, hf_model, prompts: list[list[int]], max_tokens: int = 24) -> float:
    """Fraction of greedy tokens that are the reference's argmax given the same history."""
    hits = total = 0
    for prompt, out in zip(prompts, _run(llm, prompts, max_tokens), strict=True):
        ref = teacher_forcing_logprobs(hf_model, prompt, out.token_ids)  # [n, V]
        hits += int((ref.argmax(-1) == torch.tensor(out.token_ids)).sum())
        total += len(out.token_ids)
    return hits / total


# ---- fp32 parity ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forcing_parity(family, moe_checkpoint):
    path = moe_checkpoint(family)
    prompts = _prompts(6, 49152, seed=len(family))
    llm = LLM(path, dtype="float32", num_blocks=12, block_size=8, max_num_batched_tokens=29, max_num_seqs=6,
              max_model_len=96, enable_prefix_caching=False)  # 12 blocks of 8 hold one request at 96
    outs = _run(llm, prompts, max_tokens=24)
    assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    assert all(isinstance(b.experts, FusedExperts) for b in llm.engine.runner.model.moe_blocks())
    hf = hf_reference(path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 24
        sampled = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        assert_teacher_forcing(hf, prompt, out.token_ids, sampled, atol=1e-4)


# ---- quantized paths --------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_experts_stay_packed_and_agree(case, tmp_path):
    family, overrides, qtypes = GGUF_CASES[case]
    hf = random_moe_model(tiny_moe_config(family, **overrides))  # the checkpoints' model (seed 0)
    path = str(tmp_path / f"{case}.gguf")
    hf.load_state_dict(write_moe_gguf(path, family, hf.config, hf.state_dict(), qtypes))  # the stored values
    with LLM(path, quantization="gguf", dtype="float32", num_blocks=48, block_size=8, max_num_batched_tokens=32,
             max_num_seqs=4, max_model_len=96, enable_prefix_caching=False) as llm:
        model = llm.engine.runner.model
        blocks = model.moe_blocks()
        assert blocks and all(isinstance(b.experts, QuantFusedExperts) for b in blocks)
        written = {next((q for key, q in qtypes.items() if key in part), qtypes["default"])
                   for part in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
        assert {w.kind for b in blocks for w in b.experts.qweights} == written
        held, in_file = sum(w.nbytes for w in packed_weights(model)), sum(packed_file_bytes(path).values())
        assert in_file <= held <= MAX_PACKED_RATIO * in_file, (held, in_file)
        assert _agreement(llm, hf, _prompts(4, hf.config.vocab_size, seed=1)) >= MIN_AGREEMENT


def _q8_0_round_trip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What --quantization int8 packs (every linear weight and expert matrix; not the embedding, the
    routers, norms or biases), quantized to Q8_0 and back by the gguf package."""
    kept = ("embed_tokens.weight", "mlp.gate.weight", "shared_expert_gate.weight")
    q8 = gguf.GGMLQuantizationType.Q8_0
    out = {}
    for name, t in state.items():
        if t.dim() < 2 or name.endswith(kept):
            out[name] = t
            continue
        values = gguf.quants.dequantize(gguf.quants.quantize(t.float().numpy(), q8), q8)
        out[name] = torch.from_numpy(np.asarray(values)).reshape(t.shape)
    return out


def test_int8_packs_the_experts(moe_checkpoint):
    path = moe_checkpoint("qwen2_moe")
    hf = hf_reference(path)
    hf.load_state_dict(_q8_0_round_trip(hf.state_dict()))
    with LLM(path, quantization="int8", num_blocks=48, block_size=8, max_num_seqs=4, max_model_len=96,
             enable_prefix_caching=False) as llm:
        blocks = llm.engine.runner.model.moe_blocks()
        assert blocks and all(isinstance(b.experts, QuantFusedExperts) for b in blocks)
        assert {w.kind for b in blocks for w in b.experts.qweights} == {"Q8_0"}
        assert all(type(b.gate) is Router and b.gate.weight.dtype == torch.float32 for b in blocks)
        assert _agreement(llm, hf, _prompts(4, 49152, seed=2)) >= MIN_AGREEMENT


def _packed(kind: str, rows: int, cols: int, rng: np.random.Generator) -> QuantWeight:
    blocks = packed_matrix(kind, rng.normal(0.0, 0.08, (rows, cols)), rng)
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(blocks)), kind)


@pytest.mark.parametrize("kinds, hidden, inter", [(("Q8_0", "Q8_0", "Q8_0"), 96, 64),
                                                  (("Q5_1", "Q4_0", "Q4_1"), 96, 160),
                                                  (("Q4_K", "Q5_K", "Q6_K"), 256, 256),
                                                  (("IQ2_XXS", "IQ3_S", "IQ1_M"), 256, 256),
                                                  (("TQ2_0", "IQ2_S", "Q2_K"), 256, 256)])
def test_quant_grouped_experts_equal_dequantized_matmul(kinds, hidden, inter):
    """13 tokens, top-3 of 6 experts (one unused), gate and up of different types in two parts: within
    2e-4 of the output's largest value of float64 matmuls of the dequantized experts (measured <= 6e-5:
    the activations' two-level int8 rounding), and the same bits as each pair run alone."""
    rng, gen = np.random.default_rng(1), torch.Generator().manual_seed(0)
    num_experts, num_tokens, top_k = 6, 13, 3
    gate = [_packed(kinds[0], inter, hidden, rng) for _ in range(num_experts)]
    up = [_packed(kinds[1], inter, hidden, rng) for _ in range(num_experts)]
    down = tuple(_packed(kinds[2], hidden, inter, rng) for _ in range(num_experts))
    gate_up = tuple(kind_runs([g, u]) for g, u in zip(gate, up, strict=True))
    x = torch.randn(num_tokens, hidden, generator=gen)  # [T, H]
    ids = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(num_tokens)])  # [T, k]
    weights = torch.rand(num_tokens, top_k, generator=gen)  # [T, k]
    got = quant_grouped_experts(x, ids, weights, gate_up, down, None)  # [T, H]
    ref = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    alone = torch.zeros(num_tokens, hidden)
    for t in range(num_tokens):
        for j in ids[t].argsort().tolist():  # ascending expert id, as the grouped sum adds them
            e, xt = int(ids[t, j]), x[t].double()
            act = F.silu(dequantize_ref(gate[e]).double() @ xt) * (dequantize_ref(up[e]).double() @ xt)  # [I]
            ref[t] += weights[t, j].double() * (dequantize_ref(down[e]).double() @ act)
            one = F.silu(qmatmul(x[t:t + 1], gate[e])) * qmatmul(x[t:t + 1], up[e])  # [1, I]
            alone[t] += weights[t, j] * qmatmul(one, down[e])[0]
    assert (got.double() - ref).abs().max() <= 2e-4 * ref.abs().max()
    assert torch.equal(got, alone)


@contextlib.contextmanager
def _batch_invariant():
    """DEEPINFER_BATCH_INVARIANT=1 for the engines built inside (EngineConfig reads it once)."""
    from deepinfer.environ import get_environ

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_BATCH_INVARIANT", "1")
        get_environ.cache_clear()
        try:
            yield
        finally:
            get_environ.cache_clear()


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_batch_invariant_under_preemption(quantization, moe_checkpoint):
    """With DEEPINFER_BATCH_INVARIANT=1, Qwen2-MoE (shared expert, a dense layer) with stacked or packed
    experts: each request alone vs all of them batched, chunked by 29 tokens and preempted, give the
    same token ids and logprobs, greedy and seeded (without the knob, all five differ here)."""
    path = moe_checkpoint("qwen2_moe")
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randrange(3, 60))] for _ in range(5)]
    params = [SamplingParams(max_tokens=20, temperature=0.9 * (i % 2), seed=i, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    with _batch_invariant():
        roomy = LLM(path, max_model_len=256, kv_cache_memory="16MiB", quantization=quantization)
        tight = LLM(path, num_blocks=12, block_size=8, max_num_batched_tokens=29, max_num_seqs=5, max_model_len=96,
                    quantization=quantization)
    assert tight.engine.runner.batch_invariant
    alone = [roomy.generate([p], [sp], use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params, strict=True)]
    batched = [o.outputs[0] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    for ours, theirs in zip(batched, alone, strict=True):
        assert (ours.token_ids, ours.logprobs) == (theirs.token_ids, theirs.logprobs)


# ---- checkpoint forms, GGUF config, refusals --------------------------------------------------------

def test_stacked_experts_load_as_per_expert_ones(moe_checkpoint):
    """transformers' in-memory names (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) and
    the per-expert names save_pretrained writes give the same parameters."""
    path = moe_checkpoint("qwen2_moe")
    cfg = load_model_source(path).hf_config
    stacked, per_expert = Qwen2MoeForCausalLM(cfg, 64), Qwen2MoeForCausalLM(cfg, 64)
    stacked.load_weights(hf_reference(path).state_dict().items())
    per_expert.load_weights(load_model_source(path).iter_weights(torch.float32))
    want = dict(per_expert.named_parameters())
    assert any(".experts.gate_up_proj" in n for n in want)
    for name, param in stacked.named_parameters():
        assert torch.equal(param, want[name]), name


def test_gguf_config_fields():
    shapes = {"token_embd.weight": (64, 16), "blk.0.ffn_gate_inp.weight": (4, 16),
              "blk.0.ffn_gate_exps.weight": (4, 8, 16), "blk.1.ffn_gate.weight": (24, 16),
              "blk.0.ffn_gate_shexp.weight": (12, 16), "blk.0.attn_q.bias": (16,)}
    meta = {f"{{a}}.{k}": v for k, v in {"context_length": 64, "block_count": 2, "feed_forward_length": 24,
                                          "embedding_length": 16, "attention.head_count": 2,
                                          "attention.head_count_kv": 1, "attention.layer_norm_rms_epsilon": 1e-6,
                                          "expert_count": 4, "expert_used_count": 2}.items()}

    def fields(arch: str, **extra):
        metadata = {k.format(a=arch): v for k, v in meta.items()} | {k.format(a=arch): v for k, v in extra.items()}
        return gguf_config_dict(arch, metadata, shapes, None)

    qwen2 = fields("qwen2moe")
    assert (qwen2["model_type"], qwen2["num_experts"], qwen2["num_experts_per_tok"]) == ("qwen2_moe", 4, 2)
    assert (qwen2["moe_intermediate_size"], qwen2["shared_expert_intermediate_size"]) == (8, 12)
    assert qwen2["mlp_only_layers"] == [1] and qwen2["qkv_bias"] and not qwen2["norm_topk_prob"]
    assert fields("qwen3moe")["norm_topk_prob"] and not fields("qwen3moe", **{"{a}.expert_weights_norm": False})[
        "norm_topk_prob"]
    mixtral = fields("llama", **{"{a}.expert_feed_forward_length": 8})
    assert (mixtral["model_type"], mixtral["num_local_experts"], mixtral["intermediate_size"]) == ("mixtral", 4, 8)
    del meta["{a}.expert_used_count"]
    with pytest.raises(ValueError, match="qwen3moe.expert_used_count"):
        fields("qwen3moe")


@pytest.mark.parametrize("step, dense", [(2, []), (1, [0, 2]), (3, [1])])
def test_dense_layers_are_hf_ones(step, dense):
    """decoder_sparse_step and mlp_only_layers pick the same sparse layers as HF's Qwen2-MoE."""
    from transformers import Qwen2MoeForCausalLM as HFQwen2Moe
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = tiny_moe_config("qwen2_moe", num_hidden_layers=4, layer_types=["full_attention"] * 4,
                          decoder_sparse_step=step, mlp_only_layers=dense, vocab_size=256)
    ours = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in Qwen2MoeForCausalLM(cfg, 64).model.layers]
    assert ours == [isinstance(layer.mlp, Qwen2MoeSparseMoeBlock) for layer in HFQwen2Moe(cfg).model.layers]
    assert any(ours) and not all(ours)


def test_bad_configs_and_checkpoints_are_refused_naming_them(moe_checkpoint):
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        Qwen3MoeForCausalLM(tiny_moe_config("qwen3_moe", hidden_act="gelu"), 64)
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        Qwen3MoeForCausalLM(tiny_moe_config("qwen3_moe", num_experts_per_tok=9), 64)
    with pytest.raises(ValueError, match="decoder_sparse_step=0"):
        Qwen2MoeForCausalLM(tiny_moe_config("qwen2_moe", decoder_sparse_step=0), 64)
    path = moe_checkpoint("qwen3_moe")
    model = Qwen3MoeForCausalLM(load_model_source(path).hf_config, 64)
    weights = [(n, t) for n, t in load_model_source(path).iter_weights(torch.float32) if ".experts.5.up_proj" not in n]
    with pytest.raises(ValueError, match="lacks 1 of 24 expert matrices, e.g. expert 5 up"):
        model.load_weights(weights)
