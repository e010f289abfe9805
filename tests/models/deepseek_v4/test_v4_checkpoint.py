"""A DeepSeek-V4 checkpoint through `LLM(path)`: fp32 names as transformers writes them, and an FP8 / FP4
copy in DeepSeek's quantized layout that must load to the very same weights.

The fp32 reference is first snapped onto values the quantized formats hold exactly (e4m3 times a
power-of-two scale per 128 x 128 block; e2m1 times a power-of-two scale per 32 inputs), so the
dequantized checkpoint must equal it bit for bit. The quantizer here encodes by its own tables,
not with the engine's dequantizer.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from slice_reads import spy_slice_reads
from transformers import DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

from deepinfer import LLM, SamplingParams

pytestmark = [pytest.mark.parity]

H, VOCAB, MAX_LEN, NEW_TOKENS = 128, 512, 256, 16
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(29)], [(11 * i + 40) % VOCAB for i in range(41)]]

FP8_BLOCK, FP8_MAX = 128, 448.0
FP4_GROUP, FP4_MAX = 32, 6.0
# e2m1 magnitudes by 3-bit code (exponent bits 2..1, mantissa bit 0): subnormal 0, 0.5; then 2**(e-1) * (1 + m/2)
E2M1_MAGNITUDES = torch.tensor([(c & 1) * 0.5 if c < 2 else 2.0 ** ((c >> 1) - 1) * (1 + (c & 1) / 2)
                                for c in range(8)])
FP4_NAME = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def v4_config() -> DeepseekV4Config:
    """Sliding, CSA and HCA layers; hidden 128 so FP8 blocks and FP4 groups apply; q_lora_rank 192 so
    some matrices span two (one partial) FP8 blocks."""
    return DeepseekV4Config(
        hidden_size=H, num_hidden_layers=3, vocab_size=VOCAB, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=64, hc_mult=4, hc_sinkhorn_iters=20, num_attention_heads=2, head_dim=32,
        q_lora_rank=192, o_lora_rank=128, o_groups=2, index_n_heads=8, index_head_dim=16, index_topk=3,
        sliding_window=8, layer_types=LAYER_TYPES, mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        max_position_embeddings=MAX_LEN, swiglu_limit=0.75, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)


def randomize(model: torch.nn.Module) -> None:
    """Random values everywhere HF's init leaves zeros / ones (sinks, biases, hash table, scales)."""
    gen = torch.Generator().manual_seed(0)
    experts = model.config.n_routed_experts
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                rows = [torch.randperm(experts, generator=gen)[: t.shape[1]] for _ in range(t.shape[0])]
                t.copy_(torch.stack(rows))
            elif t.dim() == 1 and ("norm" in name or name.endswith("scale")):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * (0.08 if t.dim() > 1 else 0.3))


# ----------------------------------------------------------------------------- quantizers

def _pow2_exponents(amax: torch.Tensor, qmax: float, spread: int) -> torch.Tensor:
    """Power-of-two scale exponents with amax / 2**e <= qmax, bumped by 0..spread-1 so neighbours differ."""
    e = torch.ceil(torch.log2(amax.clamp(min=1e-30) / qmax))
    bump = torch.arange(e.numel()).reshape(e.shape) % spread
    return (e + bump).to(torch.int32)


def e8m0(exponents: torch.Tensor, raw: bool) -> torch.Tensor:
    """UE8M0 scale bytes (exponent + 127): raw uint8, or viewed as float8_e8m0fnu."""
    byte = (exponents + 127).to(torch.uint8)
    return byte if raw else byte.view(torch.float8_e8m0fnu)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, C] -> (e4m3 weight, e8m0 scales [ceil(R/128), ceil(C/128)], the exact value it encodes)."""
    rows, cols = w.shape
    gr, gc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(gr * FP8_BLOCK, gc * FP8_BLOCK)
    padded[:rows, :cols] = w.abs()
    amax = padded.reshape(gr, FP8_BLOCK, gc, FP8_BLOCK).amax(dim=(1, 3))  # [gr, gc]
    exps = _pow2_exponents(amax, FP8_MAX, spread=3)
    full = exps.double().exp2().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    q = (w.double() / full).float().to(torch.float8_e4m3fn)  # exact power-of-two division, then RNE
    exact = (q.double() * full).float()
    assert torch.isfinite(exact).all()
    return q, e8m0(exps, raw=False), exact


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, C] -> (packed e2m1 int8 [R, C/2], uint8 scales [R, C/32], the exact value it encodes)."""
    rows, cols = w.shape
    amax = w.abs().reshape(rows, cols // FP4_GROUP, FP4_GROUP).amax(-1)  # [R, C/32]
    exps = _pow2_exponents(amax, FP4_MAX, spread=2)
    full = exps.float().exp2().repeat_interleave(FP4_GROUP, 1)  # [R, C]
    x = w / full
    magnitude_code = (x.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(-1)  # nearest magnitude
    sign = (x < 0).to(torch.uint8)
    codes = (sign << 3) | magnitude_code.to(torch.uint8)  # [R, C]
    exact = E2M1_MAGNITUDES[magnitude_code] * (1 - 2 * sign.float()) * full
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)  # element 2j in the low nibble
    return packed, e8m0(exps, raw=True), exact


def is_fp8_target(name: str, t: torch.Tensor) -> bool:
    """Attention (incl. compressor and indexer) and shared-expert matrices, as DeepSeek stores them."""
    return name.endswith(".weight") and t.dim() == 2 and (".attn." in name or ".shared_experts." in name)


# ----------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(fp32 dir, quantized dir, names quantized as FP8, names quantized as FP4)."""
    root = tmp_path_factory.mktemp("v4ckpt")
    ref_dir, quant_dir = str(root / "fp32"), str(root / "fp8")
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(v4_config()).eval()
    randomize(model)
    model.save_pretrained(ref_dir)
    files = [f for f in os.listdir(ref_dir) if f.endswith(".safetensors")]
    assert files == ["model.safetensors"]
    state = load_file(os.path.join(ref_dir, "model.safetensors"))
    exact, quantized, fp8_names, fp4_names = {}, {}, [], []
    for name, t in state.items():
        if FP4_NAME.search(name):
            packed, scale, exact[name] = quantize_fp4(t)
            quantized[name], quantized[name[: -len("weight")] + "scale"] = packed, scale
            fp4_names.append(name)
        elif is_fp8_target(name, t):
            q, scale, exact[name] = quantize_fp8(t)
            quantized[name], quantized[name[: -len("weight")] + "scale"] = q, scale
            fp8_names.append(name)
        else:
            exact[name] = quantized[name] = t
    save_file(exact, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    os.makedirs(quant_dir)
    save_file(quantized, os.path.join(quant_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ref_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(quant_dir, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": QUANTIZATION_CONFIG}, f, indent=2)
    assert len(fp8_names) >= 20 and len(fp4_names) == 3 * 8 * 3
    return ref_dir, quant_dir, fp8_names, fp4_names


@pytest.fixture(scope="module")
def engines(checkpoints):
    ref_dir, quant_dir, _, _ = checkpoints
    # fp32 also where "auto" would pick bf16 (a GPU), so greedy tokens can follow transformers' fp32 forward
    return LLM(ref_dir, max_model_len=MAX_LEN, dtype="float32"), LLM(quant_dir, max_model_len=MAX_LEN, dtype="float32")


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_quantized_checkpoint_holds_fp8_and_fp4(checkpoints):
    _, quant_dir, fp8_names, fp4_names = checkpoints
    state = load_file(os.path.join(quant_dir, "model.safetensors"))
    assert {state[n].dtype for n in fp8_names} == {torch.float8_e4m3fn}
    assert {state[n].dtype for n in fp4_names} == {torch.int8}
    # multi-block grids (one partial block) and distinct scales per block are exercised
    assert tuple(state["model.layers.1.attn.wq_a.scale"].shape) == (2, 1)
    assert tuple(state["model.layers.1.attn.wq_b.scale"].shape) == (1, 2)
    assert tuple(state["model.layers.1.attn.indexer.wq_b.scale"].shape) == (1, 2)
    assert state["model.layers.1.attn.wq_a.scale"].view(torch.uint8).unique().numel() == 2
    assert state["model.layers.0.ffn.experts.0.w1.scale"].unique().numel() >= 2


def test_quantized_and_fp32_load_identical_weights(checkpoints, engines):
    ref_dir, _, fp8_names, _ = checkpoints
    ref, quant = ({k: v.cpu() for k, v in llm.engine.runner.model.state_dict().items()} for llm in engines)
    assert ref.keys() == quant.keys()
    differing = [name for name in ref if not torch.equal(ref[name], quant[name])]
    assert not differing, differing[:5]
    # the weights are the snapped reference values, not something both loaders agree on by accident
    exact = load_file(os.path.join(ref_dir, "model.safetensors"))
    assert torch.equal(quant["model.layers.1.self_attn.q_a_proj.weight"], exact["model.layers.1.attn.wq_a.weight"])
    w1, w3 = exact["model.layers.2.ffn.experts.5.w1.weight"], exact["model.layers.2.ffn.experts.5.w3.weight"]
    assert torch.equal(quant["model.layers.2.mlp.experts.gate_up_proj"][5], torch.cat([w1, w3]))
    w2 = exact["model.layers.2.ffn.experts.5.w2.weight"]
    assert torch.equal(quant["model.layers.2.mlp.experts.down_proj"][5], w2)


@torch.no_grad()
def test_greedy_generation_matches_and_follows_transformers(checkpoints, engines):
    ref_dir = checkpoints[0]
    outputs = [greedy(llm) for llm in engines]
    assert outputs[0] == outputs[1]
    assert all(len(ids) == NEW_TOKENS for ids in outputs[0])
    hf, info = DeepseekV4ForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.config._attn_implementation = "eager"
    hf.eval()
    for prompt, generated in zip(PROMPTS, outputs[0], strict=True):
        # one causal forward over prompt + output: row 0 is the prompt's own next-token prediction (the
        # first greedy token), later rows teacher-force the rest of the greedy sequence
        logits = hf(input_ids=torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:]
        assert generated[0] == int(logits[0].argmax())
        assert logits.argmax(-1).tolist() == generated


@pytest.mark.parametrize("drop", ["model.layers.1.attn.wq_a.scale", "model.layers.2.ffn.experts.4.w2.scale"])
def test_missing_scale_is_named(checkpoints, tmp_path, drop):
    _, quant_dir, _, _ = checkpoints
    shutil.copy(os.path.join(quant_dir, "config.json"), tmp_path / "config.json")
    state = load_file(os.path.join(quant_dir, "model.safetensors"))
    del state[drop]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    weight = drop[: -len("scale")] + "weight"
    with pytest.raises(ValueError, match=re.escape(repr(weight))):
        LLM(str(tmp_path), max_model_len=MAX_LEN)


def _config_only_dir(path, config: dict) -> str:
    with open(path / "config.json", "w") as f:
        json.dump(config, f)
    save_file({"unused": torch.zeros(1)}, str(path / "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("case", ["llama_fp8", "v4_gptq", "v4_other_block"])
def test_other_quantized_checkpoints_are_refused(tmp_path, case):
    from transformers import LlamaConfig

    if case == "llama_fp8":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2).to_dict()
        quantization = QUANTIZATION_CONFIG
    else:
        config = v4_config().to_dict()
        quantization = ({"quant_method": "gptq", "bits": 4} if case == "v4_gptq"
                        else {**QUANTIZATION_CONFIG, "weight_block_size": [64, 64]})
    path = _config_only_dir(tmp_path, {**config, "quantization_config": quantization})
    with pytest.raises(ValueError, match="quantized HF checkpoints .* are not supported"):
        LLM(path, max_model_len=MAX_LEN)


def _lazy(tensor: torch.Tensor, path) -> object:
    """`tensor` saved and reopened as a lazy slice, as a tensor-parallel rank reads checkpoints."""
    from safetensors import safe_open

    from deepinfer.model_executor.loader.hf import SafetensorsSlice

    save_file({"t": tensor.contiguous()}, str(path))
    return SafetensorsSlice(safe_open(str(path), framework="pt").get_slice("t"), torch.float32)


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "fp4_stacked"])
def test_a_quantized_slice_reads_as_the_whole_weight_cut(tmp_path, fmt):
    from deepinfer.model_executor.models.deepseek_v4.weights import QuantizedSlice

    torch.manual_seed(1)
    w = torch.randn(200, 320)  # rows span two FP8 blocks (one partial), columns three (one partial)
    if fmt == "fp8":
        q, scale, exact = quantize_fp8(w)
    else:
        q, scale, exact = quantize_fp4(w)
    if fmt == "fp4_stacked":  # [E, R, C/2] experts stacked, sliced on the expert axis
        q, scale, exact = (torch.stack([t, t.flip(0)]) for t in (q, scale, exact))
    lazy = QuantizedSlice(_lazy(q, tmp_path / "w.safetensors"), _lazy(scale, tmp_path / "s.safetensors"),
                          "w", torch.float32)
    assert lazy.shape == exact.shape and torch.equal(lazy.read(), exact)
    cuts = [(-2, 0, 100), (-2, 100, 100), (-2, 37, 130), (-1, 160, 160), (-1, 16, 96), (-1, 130, 2)]
    if fmt == "fp4_stacked":
        cuts.append((0, 1, 1))
    for dim, start, length in cuts:
        assert torch.equal(lazy.narrow(dim, start, length), exact.narrow(dim, start, length)), (dim, start, length)


@pytest.mark.multirank
def test_quantized_checkpoint_across_two_ranks_gives_one_ranks_tokens(checkpoints, engines, monkeypatch):
    """FP8 attention and FP4 experts split over 2 gloo ranks (heads, output groups, 4 of 8 experts
    each): rank 0 reads its blocks of the split weights and scales only, never its partner's
    experts, and the greedy tokens are one rank's."""
    quant_dir = checkpoints[1]
    whole = spy_slice_reads(monkeypatch)["read"]
    with LLM(quant_dir, max_model_len=MAX_LEN, dtype="float32", tensor_parallel_size=2,
             expert_parallel_size=2) as split:
        assert greedy(split) == greedy(engines[1])
    assert not [n for n in whole if re.search(r"\.attn\.(wq_b|wo_a|wo_b)\.", n)], whole  # the split ones
    experts = [int(m.group(1)) for n in whole if (m := re.search(r"\.experts\.(\d+)\.", n))]
    assert experts and max(experts) < 4, experts
