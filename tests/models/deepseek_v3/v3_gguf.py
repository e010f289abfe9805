"""A GGUF writer for tiny DeepSeek-V2 / V3 models, laid out as llama.cpp's converter (`DeepseekV2Model`,
architecture `deepseek2`) writes them, independently of the loader under test.

    names       attn_q_a, attn_q_a_norm, attn_q_b (or attn_q), attn_kv_a_mqa, attn_kv_a_norm, attn_output,
                attn_norm, ffn_norm, ffn_{gate,up,down} (dense layers), ffn_gate_inp (router, F32),
                exp_probs_b.bias (V3's correction bias), ffn_{gate,up,down}_exps [E, rows, cols],
                ffn_{gate,up,down}_shexp; no q/k row permutation (llama.cpp rotates adjacent pairs, as DeepSeek)
    kv_b_proj   `split_kv_b`: attn_k_b [H, r, dn] (each head's rows transposed) and attn_v_b [H, dv, r], with
                head_count_kv 1, key_length r + dr, value_length r and the *_mla keys; else one attn_kv_b
                [H (dn + dv), r] with head_count_kv H, key_length dn + dr, value_length dv (older converters)
    metadata    q_lora_rank (only when set), kv_lora_rank, rope.dimension_count, expert_* keys,
                leading_dense_block_count, YaRN with yarn_log_multiplier = 0.1 * mscale_all_dim;
                `gating=False` leaves out expert_gating_func and the group keys (files of V2 / V2.5 days)

Matrices are quantized by the gguf package (types by name fragment, as tests/moe_tiny.py); a K-quant gets
random blocks of bounded scale (moe_tiny.packed_matrix). `write_v3_gguf` returns the HF state dict of the
values as stored, the reference's weights.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from moe_tiny import packed_matrix

_TOP_LEVEL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
_IN_BLOCK = {
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.q_proj": "attn_q", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
_FLOAT_ONLY = ("ffn_gate_inp", "exp_probs_b")  # llama.cpp never quantizes a router or its bias


def converter_tensors(cfg, state: dict[str, torch.Tensor], split_kv_b: bool) -> dict[str, np.ndarray]:
    """GGUF name -> fp32 array (torch order) of an HF state dict (transformers' fused experts)."""
    out = {}
    for name, tensor in state.items():
        array = tensor.detach().float().numpy()
        if name in _TOP_LEVEL:
            out[_TOP_LEVEL[name]] = array
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = np.split(array, 2, axis=1)
        elif rest == "mlp.experts.down_proj":
            out[f"{blk}.ffn_down_exps.weight"] = array
        elif rest == "mlp.gate.e_score_correction_bias":
            out[f"{blk}.exp_probs_b.bias"] = array
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            kv_b = array.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            k_b, v_b = kv_b[:, :cfg.qk_nope_head_dim], kv_b[:, cfg.qk_nope_head_dim:]
            out[f"{blk}.attn_k_b.weight"] = np.ascontiguousarray(k_b.transpose(0, 2, 1))  # [H, r, dn]
            out[f"{blk}.attn_v_b.weight"] = np.ascontiguousarray(v_b)  # [H, dv, r]
        else:
            stem, _, suffix = rest.rpartition(".")
            out[f"{blk}.{_IN_BLOCK[stem]}.{suffix}"] = array
    return out


def _write_metadata(writer: gguf.GGUFWriter, cfg, split_kv_b: bool, gating: bool) -> None:
    heads, rank, rope_dim = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1 if split_kv_b else heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    if split_kv_b:
        writer.add_key_length(rank + rope_dim)
        writer.add_value_length(rank)
        writer.add_key_length_mla(cfg.qk_nope_head_dim + rope_dim)
        writer.add_value_length_mla(cfg.v_head_dim)
    else:
        writer.add_key_length(cfg.qk_nope_head_dim + rope_dim)
        writer.add_value_length(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    if gating:
        gating_func = gguf.ExpertGatingFuncType
        writer.add_expert_gating_func(gating_func.SIGMOID if cfg.model_type == "deepseek_v3" else gating_func.SOFTMAX)
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
    writer.add_rope_dimension_count(rope_dim)
    _write_rope_scaling(writer, cfg.rope_parameters)


def _write_rope_scaling(writer: gguf.GGUFWriter, rope: dict) -> None:
    if rope.get("rope_type", "default") != "yarn":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if rope.get("mscale_all_dim"):
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _qtype_of(name: str, array: np.ndarray, qtypes: dict[str, str]):
    """The ggml type of a tensor: by the first key of `qtypes` its name contains ('default' otherwise);
    None (F32) for 1-D tensors, routers, their biases and rows a type's blocks do not tile."""
    kind = next((q for key, q in qtypes.items() if key in name), qtypes.get("default", "F32"))
    if kind == "F32" or array.ndim < 2 or name.split(".")[-2] in _FLOAT_ONLY:
        return None
    qtype = gguf.GGMLQuantizationType[kind]
    return qtype if array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else None


def write_v3_gguf(path, cfg, state: dict[str, torch.Tensor], qtypes: dict[str, str], split_kv_b: bool = True,
                  gating: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Write `state` (an HF DeepSeek state dict) as llama.cpp's converter would. Returns the HF state dict
    of the values as stored (each packed tensor dequantized by the gguf package) and each GGUF tensor's type."""
    writer, rng = gguf.GGUFWriter(str(path), "deepseek2"), np.random.default_rng(0)
    _write_metadata(writer, cfg, split_kv_b, gating)
    stored, types = {}, {}
    for name, array in converter_tensors(cfg, state, split_kv_b).items():
        qtype = _qtype_of(name, array, qtypes)
        data = array if qtype is None else packed_matrix(qtype.name, array, rng)
        stored[name] = array if qtype is None else gguf.quants.dequantize(data, qtype)
        types[name] = "F32" if qtype is None else qtype.name
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf_state(cfg, state, stored), types


def hf_state(cfg, state: dict[str, torch.Tensor], stored: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """`state` with every tensor replaced by its stored value (the inverse of `converter_tensors`)."""
    out = {}
    for name, tensor in state.items():
        if name in _TOP_LEVEL:
            value = stored[_TOP_LEVEL[name]]
        else:
            _, _, layer, rest = name.split(".", 3)
            blk = f"blk.{layer}"
            if rest == "mlp.experts.gate_up_proj":
                value = np.concatenate([stored[f"{blk}.ffn_gate_exps.weight"], stored[f"{blk}.ffn_up_exps.weight"]], 1)
            elif rest == "mlp.experts.down_proj":
                value = stored[f"{blk}.ffn_down_exps.weight"]
            elif rest == "mlp.gate.e_score_correction_bias":
                value = stored[f"{blk}.exp_probs_b.bias"]
            elif rest == "self_attn.kv_b_proj.weight" and f"{blk}.attn_k_b.weight" in stored:
                k_b = np.asarray(stored[f"{blk}.attn_k_b.weight"]).transpose(0, 2, 1)  # [H, dn, r]
                value = np.concatenate([k_b, stored[f"{blk}.attn_v_b.weight"]], axis=1)  # [H, dn + dv, r]
            else:
                stem, _, suffix = rest.rpartition(".")
                value = stored[f"{blk}.{_IN_BLOCK[stem]}.{suffix}"]
        out[name] = torch.from_numpy(np.asarray(value, dtype=np.float32)).reshape(tensor.shape).clone()
    return out
