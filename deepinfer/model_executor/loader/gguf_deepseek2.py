"""DeepSeek-V2 / V2-Lite / V3 / R1 in GGUF (llama.cpp's `deepseek2` architecture): the config fields, the
block tensor names, and the tensors whose layout is not HF's.

Metadata -> HF config (transformers' DeepseekV2Config / DeepseekV3Config), keys `deepseek2.*`:

    attention.q_lora_rank             q_lora_rank (absent: None, V2-Lite's plain q_proj)
    attention.kv_lora_rank            kv_lora_rank
    rope.dimension_count              qk_rope_head_dim
    attention.key_length_mla          qk_nope_head_dim + qk_rope_head_dim   (files with attn_k_b / attn_v_b;
    attention.value_length_mla        v_head_dim                             their key_length is r + dr, value_length r)
    attention.key_length / value_length   the same, in older files (one attn_kv_b, no *_mla keys)
    expert_gating_func                1 softmax: deepseek_v2;  2 sigmoid: deepseek_v3  (absent: softmax, as llama.cpp)
    expert_count / expert_used_count / expert_shared_count / expert_feed_forward_length
                                      n_routed_experts / num_experts_per_tok / n_shared_experts / moe_intermediate_size
    leading_dense_block_count         first_k_dense_replace
    expert_weights_scale / _norm      routed_scaling_factor (absent: 1) / norm_topk_prob (absent: False)
    expert_group_count / _used_count  n_group / topk_group (absent: one group; V2: group_limited_greedy when
                                      fewer groups are used than there are, else greedy)
    rope.scaling.*                    YaRN: factor, original_context_length, yarn_beta_fast / _slow, and
                                      yarn_log_multiplier = 0.1 * mscale_all_dim (the converter's factor, undone)

llama.cpp's RoPE of this architecture rotates channel pairs (2i, 2i+1), as DeepSeek's checkpoints do
(`rope_interleave`), so q and k rows are not permuted. Its YaRN keeps the rotated channels at unit
magnitude and scales the softmax by mscale(factor, mscale_all_dim)^2; in HF terms that is
mscale = mscale_all_dim (as DeepSeek's configs set them). Head counts: K and V of every head come from
the latent row, so HF's num_key_value_heads is the head count (the file's head_count_kv is 1 in newer files).

Tensors: `DEEPSEEK2_BLOCK_NAMES` renames; `iter_deepseek2_tensors` turns the rest into HF's layout:

    attn_kv_b       [H (dn + dv), r]                 kv_b_proj as it is
    attn_k_b        [H, r, dn] (each head's W_uk^T)  kv_b_proj = per head [W_uk | W_uv] rows:
    attn_v_b        [H, dv, r] (each head's W_uv)    [H, dn + dv, r] -> [H (dn + dv), r]
    exp_probs_b     [E] (.bias)                      mlp.gate.e_score_correction_bias
    blk.N, N >= block_count                          next-n (MTP) blocks: dropped (no draft module from GGUF)
    output          absent (tied)                    lm_head read from token_embd

kv_b_proj comes dense whatever the file's type: the absorbed decode reads its per-head blocks.
The routed experts (`ffn_{gate,up,down}_exps`, [E, rows, cols]) are cut per expert by gguf.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import Any

import torch

from deepinfer.model_executor.loader.gguf_file import GGUFTensor

ARCH = "deepseek2"
DEEPSEEK2_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
DENSE_PARTS = ("attn_kv_b", "attn_k_b", "attn_v_b")  # loaded dense, whatever their type in the file
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama.cpp's expert_gating_func values
_MODEL_TYPES = {GATING_SOFTMAX: ("deepseek_v2", "DeepseekV2ForCausalLM"),
                GATING_SIGMOID: ("deepseek_v3", "DeepseekV3ForCausalLM")}
YARN_LOG_MUL_SCALE = 0.1  # the converter writes yarn_log_multiplier = 0.1 * mscale_all_dim
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama.cpp's (and HF's) defaults when the file has none

Dequantize = Callable[[GGUFTensor, torch.dtype], torch.Tensor]


# ---- config -------------------------------------------------------------------------------------

def deepseek2_config_fields(metadata: dict[str, Any], config: dict[str, Any],
                            tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The HF config fields of a `deepseek2` file beyond the shared ones in `config` (hidden size, heads,
    layers, ...): MLA sizes, routing, RoPE (see the module docstring)."""
    rope_dim = int(_required(metadata, "rope.dimension_count"))
    qk_head_dim, v_head_dim = _head_dims(metadata)
    q_lora_rank = metadata.get(_key("attention.q_lora_rank"))
    fields = {
        "kv_lora_rank": int(_required(metadata, "attention.kv_lora_rank")),
        "q_lora_rank": int(q_lora_rank) if q_lora_rank else None,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "v_head_dim": v_head_dim,
        "head_dim": rope_dim,  # transformers' convention for these configs
        "num_key_value_heads": config["num_attention_heads"],
        "rope_parameters": _rope_parameters(metadata),
        "num_nextn_predict_layers": 0,
        "attention_bias": "blk.0.attn_kv_a_mqa.bias" in tensor_shapes,
        **_routing_fields(metadata),
    }
    if fields["model_type"] == "deepseek_v3":
        fields["rope_interleave"] = True  # channel pairs (2i, 2i+1), as V2 always rotates them
    return fields


def _key(name: str) -> str:
    return f"{ARCH}.{name}"


def _required(metadata: dict[str, Any], name: str) -> Any:
    if _key(name) not in metadata:
        raise ValueError(f"GGUF metadata key {_key(name)!r} is missing; the model's config cannot be built without it")
    return metadata[_key(name)]


def _head_dims(metadata: dict[str, Any]) -> tuple[int, int]:
    """(qk head dim dn + dr, v head dim dv): the *_mla keys of files that split kv_b, else the plain ones."""
    if _key("attention.key_length_mla") in metadata:
        return int(metadata[_key("attention.key_length_mla")]), int(_required(metadata, "attention.value_length_mla"))
    return int(_required(metadata, "attention.key_length")), int(_required(metadata, "attention.value_length"))


def _routing_fields(metadata: dict[str, Any]) -> dict[str, Any]:
    """model_type by the gating function, the expert counts and sizes, groups and weight scaling."""
    gating = int(metadata.get(_key("expert_gating_func"), GATING_SOFTMAX))
    if gating not in _MODEL_TYPES:
        raise ValueError(f"GGUF metadata {_key('expert_gating_func')}={gating} is not supported: expected "
                         f"{GATING_SOFTMAX} (softmax, DeepSeek-V2) or {GATING_SIGMOID} (sigmoid, DeepSeek-V3)")
    model_type, architecture = _MODEL_TYPES[gating]
    experts = int(metadata.get(_key("expert_count"), 0)) or None
    groups = int(metadata.get(_key("expert_group_count"), 1)) or 1
    used_groups = int(metadata.get(_key("expert_group_used_count"), groups)) or groups
    fields = {
        "model_type": model_type,
        "architectures": [architecture],
        "n_routed_experts": experts,
        "num_experts_per_tok": int(_required(metadata, "expert_used_count")) if experts else None,
        "n_shared_experts": int(metadata.get(_key("expert_shared_count"), 0)),
        "moe_intermediate_size": int(_required(metadata, "expert_feed_forward_length")),
        "first_k_dense_replace": int(metadata.get(_key("leading_dense_block_count"), 0)),
        "routed_scaling_factor": float(metadata.get(_key("expert_weights_scale"), 1.0)),
        "norm_topk_prob": bool(metadata.get(_key("expert_weights_norm"), False)),
        "n_group": groups,
        "topk_group": used_groups,
    }
    if gating == GATING_SOFTMAX:
        fields["topk_method"] = "group_limited_greedy" if used_groups < groups else "greedy"
    return fields


def _rope_parameters(metadata: dict[str, Any]) -> dict[str, Any]:
    """HF `rope_parameters`: the base, and YaRN from the scaling keys (mscale = mscale_all_dim: see above)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(metadata.get(_key("rope.freq_base"),
                                                                                       10000.0))}
    scaling = metadata.get(_key("rope.scaling.type"), "none")
    if scaling == "none":
        return params
    if scaling != "yarn":
        raise ValueError(f"GGUF metadata {_key('rope.scaling.type')}={scaling!r} is not supported: expected "
                         "'none' or 'yarn'")
    params.update(rope_type="yarn", factor=float(_required(metadata, "rope.scaling.factor")),
                  original_max_position_embeddings=int(_required(metadata, "rope.scaling.original_context_length")),
                  beta_fast=float(metadata.get(_key("rope.scaling.yarn_beta_fast"), YARN_BETA_FAST)),
                  beta_slow=float(metadata.get(_key("rope.scaling.yarn_beta_slow"), YARN_BETA_SLOW)))
    log_mul = float(metadata.get(_key("rope.scaling.yarn_log_multiplier"), 0.0))
    if log_mul:
        mscale_all_dim = log_mul / YARN_LOG_MUL_SCALE
        params.update(mscale=mscale_all_dim, mscale_all_dim=mscale_all_dim)
    return params


# ---- tensors ------------------------------------------------------------------------------------

def iter_deepseek2_tensors(tensors: list[GGUFTensor], config: Any, dtype: torch.dtype, dequantize: Dequantize
                           ) -> Generator[tuple[str, torch.Tensor], None, list[GGUFTensor]]:
    """Yield (HF name, tensor) of the tensors whose layout is not HF's (kv_b_proj from attn_kv_b or from
    attn_k_b | attn_v_b, dense in `dtype`; the routers' correction biases in fp32) and return the other
    tensors for the plain renaming: next-n blocks dropped, `token_embd` again as `output` when the
    file ties the head."""
    rest: list[GGUFTensor] = []
    halves: dict[int, dict[str, GGUFTensor]] = {}
    for tensor in tensors:
        layer, part = _block_part(tensor.name)
        if layer is not None and layer >= config.num_hidden_layers:
            continue  # a next-n (MTP) block
        prefix = f"model.layers.{layer}"
        if part == "attn_kv_b":
            yield f"{prefix}.self_attn.kv_b_proj.weight", dequantize(tensor, dtype)
        elif part in ("attn_k_b", "attn_v_b"):
            halves.setdefault(layer, {})[part] = tensor
            if len(halves[layer]) == 2:
                yield f"{prefix}.self_attn.kv_b_proj.weight", joined_kv_b(halves.pop(layer), config, dtype, dequantize)
        elif part == "exp_probs_b":
            yield f"{prefix}.mlp.gate.e_score_correction_bias", dequantize(tensor, torch.float32)
        else:
            rest.append(tensor)
    if halves:
        layer, parts = next(iter(halves.items()))
        raise ValueError(f"GGUF layer {layer} has {', '.join(parts)} without its other half (attn_k_b and attn_v_b)")
    names = {t.name for t in rest}
    if "output.weight" not in names and "token_embd.weight" in names:
        embedding = next(t for t in rest if t.name == "token_embd.weight")
        rest.append(dataclasses.replace(embedding, name="output.weight"))
    return rest


def _block_part(name: str) -> tuple[int | None, str | None]:
    """`blk.3.attn_k_b.weight` -> (3, "attn_k_b"); a top-level tensor -> (None, None)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None, None


def joined_kv_b(halves: dict[str, GGUFTensor], config: Any, dtype: torch.dtype, dequantize: Dequantize
                ) -> torch.Tensor:
    """kv_b_proj [H (dn + dv), r] from attn_k_b [H, r, dn] (each head's W_uk transposed) and attn_v_b [H, dv, r]."""
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    nope, v_dim = config.qk_nope_head_dim, config.v_head_dim
    k_b = _heads(dequantize(halves["attn_k_b"], dtype), (heads, rank, nope), halves["attn_k_b"].name)
    v_b = _heads(dequantize(halves["attn_v_b"], dtype), (heads, v_dim, rank), halves["attn_v_b"].name)
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, dn + dv, r]
    return kv_b.reshape(heads * (nope + v_dim), rank).contiguous()  # [H (dn + dv), r]


def _heads(values: torch.Tensor, shape: tuple[int, int, int], name: str) -> torch.Tensor:
    """`values` as [H, rows, cols] (3-D in the file, or its rows flattened); ValueError naming the tensor."""
    if values.numel() != shape[0] * shape[1] * shape[2] or values.shape[-1] != shape[-1]:
        raise ValueError(f"GGUF tensor {name!r} has shape {tuple(values.shape)}, expected {shape} "
                         "(heads, rows, cols) from the config")
    return values.reshape(shape)
