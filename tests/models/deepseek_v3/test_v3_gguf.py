"""DeepSeek-V3 / V2 from GGUF files of llama.cpp's `deepseek2` architecture, against HF transformers.

Tiny random HF models (v3_tiny.py) are written as llama.cpp's converter lays them out (v3_gguf.py):

    v3_yarn   DeepSeek-V3: sigmoid routing with the correction bias and groups, YaRN, kv_b_proj split into
              attn_k_b | attn_v_b (newer converters)
    v2_lite   DeepSeek-V2-Lite: no q LoRA (attn_q), softmax greedy routing, one attn_kv_b, and no gating or
              group keys (older converters)
    v3_kquant v3 of hidden 256 and experts of 256 (K-quant rows): experts in Q4_K / Q5_K / Q6_K (quantized
              files only)
    v3_iquant the same shape, experts in IQ2_XXS / IQ3_XXS / IQ2_S, attn_kv_a_mqa IQ3_S

- the config read back equals the HF model's fields that shape the computation, and its softmax scale HF's;
- an F32 file yields HF's tensors exactly, and through the engine (13-token prefill chunks) every greedy
  token is HF's argmax with its logprob within 1e-4 of HF's;
- a quantized file (Q8_0 matrices, experts Q5_1 / Q4_0 or K-quants) loaded with quantization="gguf" keeps its
  matrices packed (experts as QuantFusedExperts, the linears and the embedding as quantized twins;
  kv_b_proj dense) at their file size, and >= 97% of greedy tokens are the argmax of HF's fp32 forward of
  the stored (dequantized) weights;
- metadata and tensors the loader cannot use are refused, naming them.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import teacher_forcing_logprobs
from torch import nn
from v3_gguf import write_v3_gguf
from v3_tiny import VOCAB, YARN, randomize, tiny_config

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.layers.fused_moe import QuantFusedExperts
from deepinfer.model_executor.layers.quant_linear import QuantEmbedding, QuantLinear, packed_weights
from deepinfer.model_executor.loader.gguf import packed_file_bytes
from deepinfer.model_executor.loader.gguf_config import gguf_config_dict
from deepinfer.model_executor.loader.source import load_model_source
from deepinfer.model_executor.models.deepseek_v3.config import softmax_scale
from deepinfer.model_executor.models.deepseek_v3.moe import DeepseekMoE

pytestmark = [pytest.mark.parity]

QTYPES = {"ffn_down_exps": "Q4_0", "ffn_up_exps": "Q5_1", "default": "Q8_0"}  # GGUF name fragment -> ggml type
K_QTYPES = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q5_K", "ffn_down_exps": "Q6_K", "default": "Q8_0"}
IQ_QTYPES = {"ffn_gate_exps": "IQ2_XXS", "ffn_up_exps": "IQ3_XXS", "ffn_down_exps": "IQ2_S", "attn_kv_a_mqa": "IQ3_S",
             "default": "Q8_0"}
CASES = {  # model type, config overrides, writer options, types of the quantized file
    "v3_yarn": ("deepseek_v3", {"q_lora_rank": 64, "rope_scaling": {**YARN, "mscale": 0.707,
                                                                     "original_max_position_embeddings": 128}},
                {"split_kv_b": True, "gating": True}, QTYPES),
    "v2_lite": ("deepseek_v2", {"q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1},
                {"split_kv_b": False, "gating": False}, QTYPES),
    "v3_kquant": ("deepseek_v3", {"hidden_size": 256, "moe_intermediate_size": 256, "q_lora_rank": 64},
                  {"split_kv_b": True, "gating": True}, K_QTYPES),
    "v3_iquant": ("deepseek_v3", {"hidden_size": 256, "moe_intermediate_size": 256, "q_lora_rank": 64},
                  {"split_kv_b": True, "gating": True}, IQ_QTYPES),
}
PARITY_CASES = ("v3_yarn", "v2_lite")
CONFIG_FIELDS = ("model_type", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace",
                 "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group", "vocab_size",
                 "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id")
MIN_AGREEMENT = 0.97
ATOL = 1e-4
MAX_PACKED_RATIO = 1.05  # packed bytes held over the file's bytes of the matrices kept packed


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """files(case) -> (hf model, F32 path, quantized path, HF model of the quantized file's stored values,
    ggml type per GGUF tensor of that file); built once per case."""
    cache = {}

    def build(case: str):
        if case not in cache:
            model_type, overrides, options, qtypes = CASES[case]
            from transformers import AutoModelForCausalLM

            cfg = tiny_config(model_type, **overrides)
            hf = randomize(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), seed=len(case)).eval()
            folder = tmp_path_factory.mktemp(case)
            f32, quant = str(folder / "f32.gguf"), str(folder / "q.gguf")
            write_v3_gguf(f32, cfg, hf.state_dict(), {"default": "F32"}, **options)
            stored, types = write_v3_gguf(quant, cfg, hf.state_dict(), qtypes, **options)
            hf_q = randomize(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), seed=0).eval()
            hf_q.load_state_dict(stored)
            cache[case] = hf, f32, quant, hf_q, types
        return cache[case]

    return build


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _llm(path: str, quantization: str) -> LLM:
    return LLM(path, quantization=quantization, dtype="float32", block_size=4, max_num_batched_tokens=13,
               max_num_seqs=4, max_model_len=128)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 24) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.kv_manager.check_no_leaks()
    return outs


# ---- config -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", PARITY_CASES)
def test_config_read_back_is_the_models(case, files):
    hf, f32, _, _, _ = files(case)
    ours, theirs = load_model_source(f32).hf_config, hf.config
    assert {f: getattr(ours, f) for f in CONFIG_FIELDS} == {f: getattr(theirs, f) for f in CONFIG_FIELDS}
    for field in ("topk_method", "rope_interleave"):  # V2's and V3's own fields
        assert getattr(ours, field, None) == getattr(theirs, field, None), field
    assert ours.num_nextn_predict_layers == 0  # llama.cpp's converter writes no next-n layers
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)  # a float32 in the file
    got, want = ours.rope_parameters, theirs.rope_parameters
    assert got.keys() == want.keys() and got["rope_type"] == want["rope_type"]
    assert {k: v for k, v in got.items() if k != "rope_type"} == pytest.approx(
        {k: v for k, v in want.items() if k != "rope_type"}, rel=1e-6)  # mscale*: float32 in the file
    assert softmax_scale(ours) == pytest.approx(softmax_scale(theirs), rel=1e-6)


def _metadata(**extra) -> dict:
    keys = {"context_length": 512, "block_count": 2, "feed_forward_length": 96, "embedding_length": 64,
            "attention.head_count": 4, "attention.head_count_kv": 1, "attention.layer_norm_rms_epsilon": 1e-6,
            "attention.kv_lora_rank": 32, "attention.key_length": 40, "attention.value_length": 32,
            "attention.key_length_mla": 24, "attention.value_length_mla": 16, "rope.dimension_count": 8,
            "expert_count": 160, "expert_used_count": 6, "expert_feed_forward_length": 32,
            "expert_shared_count": 2, "leading_dense_block_count": 1, "expert_gating_func": 1,
            "expert_group_count": 8, "expert_group_used_count": 3, **extra}
    return {f"deepseek2.{k}": v for k, v in keys.items()}


def test_v2_groups_and_refusals_name_the_key():
    """DeepSeek-V2 (236B)'s routing from its keys: 8 groups, 3 used -> group_limited_greedy; all groups
    used -> greedy. A gating function, scaling or missing key the loader cannot map is refused by name."""
    shapes = {"token_embd.weight": (512, 64)}
    fields = gguf_config_dict("deepseek2", _metadata(), shapes, None)
    assert (fields["model_type"], fields["topk_method"], fields["n_group"], fields["topk_group"]) == \
        ("deepseek_v2", "group_limited_greedy", 8, 3)
    assert (fields["qk_nope_head_dim"], fields["v_head_dim"], fields["num_key_value_heads"]) == (16, 16, 4)
    assert gguf_config_dict("deepseek2", _metadata(**{"expert_group_used_count": 8}), shapes, None)[
        "topk_method"] == "greedy"
    with pytest.raises(ValueError, match="deepseek2.expert_gating_func=3"):
        gguf_config_dict("deepseek2", _metadata(expert_gating_func=3), shapes, None)
    with pytest.raises(ValueError, match="deepseek2.rope.scaling.type='linear'"):
        gguf_config_dict("deepseek2", _metadata(**{"rope.scaling.type": "linear"}), shapes, None)
    metadata = _metadata()
    del metadata["deepseek2.attention.kv_lora_rank"]
    with pytest.raises(ValueError, match="deepseek2.attention.kv_lora_rank"):
        gguf_config_dict("deepseek2", metadata, shapes, None)


# ---- F32 files: HF's tensors and logits -------------------------------------------------------------

def _hf_value(state: dict[str, torch.Tensor], name: str, inter: int) -> torch.Tensor:
    """HF's tensor for one of our names (per-expert matrices out of transformers' fused stacks)."""
    owner, sep, rest = name.partition(".experts.")
    if not sep:
        return state[name]
    expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
    if proj == "down_proj":
        return state[f"{owner}.experts.down_proj"][expert]
    gate_up = state[f"{owner}.experts.gate_up_proj"][expert]  # [2I, H]
    return gate_up[:inter] if proj == "gate_proj" else gate_up[inter:]


@pytest.mark.parametrize("case", PARITY_CASES)
def test_f32_file_yields_hf_tensors(case, files):
    """Every tensor read back (kv_b_proj rebuilt from attn_k_b | attn_v_b, the correction bias renamed,
    experts cut per expert) equals HF's, and every HF tensor is read."""
    hf, f32, _, _, _ = files(case)
    state = hf.state_dict()
    weights = dict(load_model_source(f32).iter_weights(torch.float32))
    for name, tensor in weights.items():
        assert torch.equal(tensor, _hf_value(state, name, hf.config.moe_intermediate_size)), name
    expert_stacks = {n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    assert set(state) - expert_stacks <= set(weights)
    assert sum(".experts." in n for n in weights) == 3 * hf.config.n_routed_experts * len(
        [layer for layer in hf.model.layers if hasattr(layer.mlp, "experts")])


def _worst_logprob_gap(hf, prompts, outs) -> float:
    """Every token is HF's argmax under teacher forcing; returns the worst logprob difference."""
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        ref = teacher_forcing_logprobs(hf, prompt, out.token_ids)  # [n, V]
        for i, token in enumerate(out.token_ids):
            assert ref[i, token] >= ref[i].max() - 1e-5, (i, token, int(ref[i].argmax()))
            worst = max(worst, abs(out.logprobs[i][token].logprob - float(ref[i, token])))
    return worst


@pytest.mark.parametrize("case", PARITY_CASES)
def test_f32_file_matches_hf_through_the_engine(case, files):
    hf, f32, _, _, _ = files(case)
    prompts = _prompts(4, seed=len(case))
    with _llm(f32, "gguf") as llm:
        assert not packed_weights(llm.engine.runner.model)  # F32 tensors are never packed
        worst = _worst_logprob_gap(hf, prompts, _generate(llm, prompts))
    assert worst < ATOL, worst


# ---- quantized files: packed, and agreeing with HF on the stored values ------------------------------

def _agreement(hf, prompts, outs) -> float:
    """Fraction of greedy tokens that are the reference's argmax given the same history."""
    hits = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ref = teacher_forcing_logprobs(hf, prompt, out.token_ids)  # [n, V]
        hits += int((ref.argmax(-1) == torch.tensor(out.token_ids)).sum())
        total += len(out.token_ids)
    return hits / total


def _assert_packed(model, types: dict[str, str], path: str) -> None:
    """Experts packed in the file's types; the Linear weights the file quantized are quantized twins (the
    embedding too); kv_b_proj stays a dense Linear; the packed bytes are the file's."""
    blocks = [m for m in model.modules() if isinstance(m, DeepseekMoE)]
    assert blocks and all(isinstance(b.experts, QuantFusedExperts) for b in blocks)
    expert_kinds = {k for n, k in types.items() if "_exps" in n}
    assert {w.kind for b in blocks for w in b.experts.qweights} == expert_kinds
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    for layer in model.model.layers:
        attn = layer.self_attn
        q = attn.q_b_proj if attn.q_lora_rank else attn.q_proj
        assert all(isinstance(m, QuantLinear) for m in (q, attn.kv_a_proj_with_mqa, attn.o_proj)), layer.layer_idx
        assert type(attn.kv_b_proj) is not QuantLinear and isinstance(attn.kv_b_proj, nn.Linear)
        mlp = layer.mlp.shared_experts if isinstance(layer.mlp, DeepseekMoE) else layer.mlp
        assert isinstance(mlp.gate_up_proj, QuantLinear) and isinstance(mlp.down_proj, QuantLinear)
    held, in_file = sum(w.nbytes for w in packed_weights(model)), sum(packed_file_bytes(path).values())
    assert in_file <= held <= MAX_PACKED_RATIO * in_file, (held, in_file)


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_file_stays_packed_and_agrees_with_hf(case, files):
    _, _, quant, hf_q, types = files(case)
    prompts = _prompts(4, seed=10 + len(case))
    with _llm(quant, "gguf") as llm:
        _assert_packed(llm.engine.runner.model, types, quant)
        agreement = _agreement(hf_q, prompts, _generate(llm, prompts))
    assert agreement >= MIN_AGREEMENT, agreement


def test_tied_head_is_read_from_the_embedding(files, tmp_path):
    """A file without `output` (tied head): the config says so and lm_head comes from token_embd."""
    hf, _, _, _, _ = files("v3_yarn")
    state = {n: t for n, t in hf.state_dict().items() if n != "lm_head.weight"}
    path = tmp_path / "tied.gguf"
    write_v3_gguf(path, hf.config, state, {"default": "F32"})
    source = load_model_source(str(path))
    weights = dict(source.iter_weights(torch.float32))
    assert source.hf_config.tie_word_embeddings
    assert torch.equal(weights["lm_head.weight"], state["model.embed_tokens.weight"])


def test_unpaired_k_b_is_refused(files, tmp_path):
    """A file with attn_k_b but no attn_v_b in a layer cannot give kv_b_proj: refused naming the layer."""
    import gguf

    from deepinfer.model_executor.loader.gguf_file import read_gguf_file

    _, f32, _, _, _ = files("v3_yarn")
    source = read_gguf_file(f32)
    writer = gguf.GGUFWriter(str(tmp_path / "broken.gguf"), "deepseek2")
    for key, value in source.metadata.items():
        if key.startswith("deepseek2."):
            _add_like(writer, key, value)
    for tensor in source.tensors:
        if tensor.name != "blk.1.attn_v_b.weight":
            writer.add_tensor(tensor.name, tensor.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF layer 1 has attn_k_b without its other half"):
        dict(load_model_source(str(tmp_path / "broken.gguf")).iter_weights(torch.float32))


def _add_like(writer, key: str, value) -> None:
    """Copy one scalar metadata value with a type that holds it."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, value)
