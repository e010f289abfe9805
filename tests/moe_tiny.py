"""Tiny random Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints, and a llama.cpp-style GGUF writer for them.

The configs: vocabulary of the default tokenizer, hidden 64, 8 experts top-2 of intermediate 32,
random weights of std 0.08 (as tiny_models.py) so that routing matters. Qwen3-MoE renormalises its
top-k weights, Qwen2-MoE does not and has a shared expert and a dense middle layer; Mixtral always
renormalises.

The writer follows llama.cpp's converter independently of the loader under test: per layer one 3-D
tensor per expert projection (`blk.N.ffn_gate_exps` [E, I, H] in torch order, `ffn_up_exps`,
`ffn_down_exps` [E, H, I]), the router `ffn_gate_inp` and the shared expert's gate
`ffn_gate_inp_shexp` kept F32 (llama.cpp never quantizes a router), q/k rows permuted per head for the
llama architecture (Mixtral), and the metadata keys `{arch}.expert_count`, `expert_used_count`,
`expert_feed_forward_length`, `expert_shared_feed_forward_length`. Tensors are quantized by the gguf
package; it has no K-quant quantizer, so K-quant tensors are random blocks of bounded scale (the model's
values there are then the blocks', which the writer returns for the reference).
"""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import torch
from llamacpp_writer import llama_cpp_permute
from tiny_models import VOCAB

from deepinfer.model_executor.layers.ops.block_encode import ENCODED_KINDS, encode_blocks

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, num_experts_per_tok=2)


def tiny_moe_config(family: str, **overrides):
    import transformers as tf

    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**_COMMON, head_dim=32, intermediate_size=64, moe_intermediate_size=32,
                                num_experts=8, norm_topk_prob=True)
    elif family == "qwen2_moe":  # layer 1 dense (mlp_only_layers), the others sparse with a shared expert
        cfg = tf.Qwen2MoeConfig(**{**_COMMON, "num_hidden_layers": 3}, intermediate_size=64,
                                moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                                norm_topk_prob=False, mlp_only_layers=[1])
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**_COMMON, intermediate_size=32, num_local_experts=8)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def random_moe_model(cfg, seed: int = 0):
    """An HF *ForCausalLM of `cfg` with every matrix (experts and routers included) ~ N(0, 0.08)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    return model.eval()


def make_tiny_moe(family: str, path: str, tokenizer_dir: str, seed: int = 0, **overrides) -> str:
    """save_pretrained of a random tiny model, with the default tokenizer's files."""
    random_moe_model(tiny_moe_config(family, **overrides), seed).save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    return path


# ---- GGUF -----------------------------------------------------------------------------------------

_TOP_LEVEL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
_IN_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_FLOAT_ONLY = ("ffn_gate_inp", "ffn_gate_inp_shexp")


def gguf_tensors(family: str, cfg, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """GGUF name -> fp32 array (HF order: q/k not yet permuted) of an HF state dict; transformers'
    fused experts `mlp.experts.gate_up_proj [E, 2I, H]` become `ffn_gate_exps` and `ffn_up_exps`."""
    out = {}
    for name, tensor in state.items():
        array = tensor.detach().float().numpy()
        if name in _TOP_LEVEL:
            out[_TOP_LEVEL[name]] = array
            continue
        _, _, layer, rest = name.split(".", 3)
        stem, _, suffix = rest.rpartition(".")
        if rest == "mlp.experts.gate_up_proj":
            gate, up = np.split(array, 2, axis=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = array
        else:
            out[f"blk.{layer}.{_IN_BLOCK[stem]}.{suffix}"] = array
    return out


def _write_metadata(writer: gguf.GGUFWriter, family: str, cfg) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if family == "mixtral":
        writer.add_rope_dimension_count(head_dim)
        return
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


# gguf's Python quantizer has no K-quants: their blocks are drawn at random, with fp16 scales that keep
# values within about +-0.2; (byte offset of each fp16 scale, its value) per type
_K_SCALES = {"Q4_K": ((0, 2e-4), (2, 1e-3)), "Q5_K": ((0, 1e-4), (2, 1e-3)), "Q6_K": ((208, 2e-5),)}


def packed_matrix(kind: str, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`values` [..., K] in ggml type `kind` as uint8 blocks [..., row bytes]: quantized by the gguf
    package or block_encode.py, or for Q4_K..Q6_K random blocks with bounded scales (the values are
    then the blocks')."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ENCODED_KINDS:  # the i-quants, Q2_K/Q3_K: our encoders (checked against gguf's decoding)
        flat = values.reshape(-1, values.shape[-1]).astype(np.float32)
        return encode_blocks(flat, kind).reshape(*values.shape[:-1], -1)
    if kind not in _K_SCALES:
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(*values.shape[:-1], values.shape[-1] // block, size), dtype=np.uint8)
    for offset, scale in _K_SCALES[kind]:
        blocks[..., offset:offset + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(*values.shape[:-1], -1)


def _qtype_of(name: str, array: np.ndarray, qtypes: dict[str, str]):
    """The ggml type a tensor is written in: by the first key of `qtypes` its name contains
    ('default' otherwise); F32 for 1-D tensors, routers and rows a type's blocks do not tile."""
    kind = next((q for key, q in qtypes.items() if key in name), qtypes.get("default", "F32"))
    stem = name.split(".")[-2]
    if kind == "F32" or array.ndim < 2 or stem in _FLOAT_ONLY:
        return None
    qtype = gguf.GGMLQuantizationType[kind]
    return qtype if array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else None


def write_moe_gguf(path, family: str, cfg, state: dict[str, torch.Tensor],
                   qtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Write `state` (an HF state dict) as llama.cpp would; `qtypes`: GGUF name fragment -> ggml type
    name ('default' for the rest). Returns the HF state dict of the values as stored (each packed
    tensor dequantized by the gguf package), the reference's weights."""
    arch, rng = GGUF_ARCH[family], np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, family, cfg)
    stored = {}
    for name, array in gguf_tensors(family, cfg, state).items():
        qtype = _qtype_of(name, array, qtypes)
        data = array if qtype is None else packed_matrix(qtype.name, array, rng)
        stored[name] = array if qtype is None else gguf.quants.dequantize(data, qtype)
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):  # whole rows move: blocks stay
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _as_hf_state(state, stored)


def _as_hf_state(state: dict[str, torch.Tensor], stored: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """`state` with every tensor replaced by its stored value (names as gguf_tensors maps them)."""
    out = {}
    for name, tensor in state.items():
        if name in _TOP_LEVEL:
            value = stored[_TOP_LEVEL[name]]
        else:
            _, _, layer, rest = name.split(".", 3)
            stem, _, suffix = rest.rpartition(".")
            if rest == "mlp.experts.gate_up_proj":
                value = np.concatenate([stored[f"blk.{layer}.ffn_gate_exps.weight"],
                                        stored[f"blk.{layer}.ffn_up_exps.weight"]], axis=1)
            elif rest == "mlp.experts.down_proj":
                value = stored[f"blk.{layer}.ffn_down_exps.weight"]
            else:
                value = stored[f"blk.{layer}.{_IN_BLOCK[stem]}.{suffix}"]
        out[name] = torch.from_numpy(np.asarray(value, dtype=np.float32)).reshape(tensor.shape)
    return out
