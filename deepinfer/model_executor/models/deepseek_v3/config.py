"""The DeepSeek-V2 / V3 config fields this package reads, checked once at construction.

A field whose value the model cannot run is refused with a ValueError naming it and its value.
HF transformers (`DeepseekV2Config`, `DeepseekV3Config`) is the reference for every meaning here:

    softmax scale   qk_head_dim^-1/2, times mscale^2 for a scaled RoPE with `mscale_all_dim`
                    (mscale = 0.1 * mscale_all_dim * ln(factor) + 1 when factor > 1)
    RoPE            V2 and V3 with `rope_interleave`: channel pairs (2i, 2i+1) rotate;
                    V3 without it: rotate-half pairs (i, i + d/2)
    routing         V3: sigmoid scores, `e_score_correction_bias`, n_group / topk_group (top-2 sum per group)
                    V2: softmax scores, `topk_method` "greedy" or "group_limited_greedy" (max per group)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepinfer.contracts.hf_config import HFConfigFields

V2, V3 = "deepseek_v2", "deepseek_v3"
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
V3_TOPK_METHODS = (None, "noaux_tc")


@dataclass(frozen=True)
class DeepseekConfigFields(HFConfigFields):
    """The optional config fields DeepSeek-V2 / V3 read (the defaults of transformers' config classes,
    or what an absent field means)."""

    rope_interleave: bool = True  # V3: RoPE on channel pairs (2i, 2i+1)
    num_nextn_predict_layers: int | None = None  # V3's MTP layers (None, as in V2 configs: none)
    hidden_act: str = "silu"
    mlp_bias: bool = False
    attention_bias: bool = False
    moe_layer_freq: int | None = 1
    scoring_func: str | None = None
    topk_method: str | None = None


def rope_parameters(cfg) -> dict:
    """The config's RoPE dict (transformers fills `rope_parameters` from a legacy `rope_scaling`)."""
    return dict(DeepseekConfigFields.of(cfg).rope_parameters or {"rope_type": "default"})


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude: 0.1 * mscale * ln(factor) + 1, or 1 for factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg) -> float:
    """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under a scaled RoPE that sets mscale_all_dim."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = rope_parameters(cfg)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


def interleaved_rope(cfg) -> bool:
    """Whether RoPE rotates channel pairs (2i, 2i+1) (V2 always; V3 with `rope_interleave`)."""
    return cfg.model_type == V2 or bool(DeepseekConfigFields.of(cfg).rope_interleave)


def num_mtp_layers(cfg) -> int:
    """`num_nextn_predict_layers` (V3's MTP layers; 0 when absent, as in V2 configs)."""
    return int(DeepseekConfigFields.of(cfg).num_nextn_predict_layers or 0)


def is_moe_layer(cfg, layer_idx: int) -> bool:
    """Layers from `first_k_dense_replace` on route to experts; the first ones are dense MLPs."""
    return cfg.n_routed_experts is not None and layer_idx >= (cfg.first_k_dense_replace or 0)


def check_config(cfg) -> None:
    """Refuse, naming the field and value, what this package does not run."""
    _require(cfg.model_type in (V2, V3), "model_type", cfg.model_type, f"{V2!r} or {V3!r}")
    fields = DeepseekConfigFields.of(cfg)
    act, bias, freq = fields.hidden_act, fields.mlp_bias, fields.moe_layer_freq
    _require(act == "silu", "hidden_act", act, "'silu'")
    _require(not bias, "mlp_bias", bias, "False")
    _require(freq in (None, 1), "moe_layer_freq", freq, "1 (every layer from first_k_dense_replace on is MoE)")
    if cfg.n_routed_experts:
        _check_routing(cfg, fields)


def _check_routing(cfg, fields: DeepseekConfigFields) -> None:
    experts, groups = cfg.n_routed_experts, cfg.n_group or 1
    _require(experts % groups == 0, "n_group", cfg.n_group, f"a divisor of n_routed_experts={experts}")
    _require(1 <= (cfg.topk_group or groups) <= groups, "topk_group", cfg.topk_group, f"in [1, n_group={groups}]")
    scoring, method = fields.scoring_func, fields.topk_method
    if cfg.model_type == V3:
        _require(scoring in (None, "sigmoid"), "scoring_func", scoring, "'sigmoid' for deepseek_v3")
        _require(method in V3_TOPK_METHODS, "topk_method", method, "'noaux_tc' for deepseek_v3")
        _require(experts // groups >= 2, "n_group", cfg.n_group, "at most n_routed_experts / 2 (groups score "
                 "by their top-2 experts)")
        return
    _require(scoring in (None, "softmax"), "scoring_func", scoring, "'softmax' for deepseek_v2")
    _require(method in V2_TOPK_METHODS, "topk_method", method, " or ".join(map(repr, V2_TOPK_METHODS)))
    # transformers' DeepseekV2 router never renormalises; DeepSeek's own code does when this is set
    _require(not cfg.norm_topk_prob, "norm_topk_prob", cfg.norm_topk_prob, "False for deepseek_v2")


def _require(ok: bool, field: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r} is not supported: expected {expected}")
