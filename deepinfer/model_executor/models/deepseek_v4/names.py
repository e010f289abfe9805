"""DeepSeek-V4 checkpoint names -> this package's parameter names (which follow HF's modules).

V4 checkpoints (DeepSeek's release, and what transformers' `save_pretrained` writes) name
tensors `layers.3.attn.wq_a.weight`, `layers.3.ffn.experts.7.w1.weight`, `hc_head_fn`, ... with
or without a leading `model.`. Names already in module form pass through unchanged.

Routed experts are stored one matrix per expert; `expert_target` says where such a matrix goes
in the stacked `experts.gate_up_proj` / `experts.down_proj`.
"""

from __future__ import annotations

import re

# applied in order; each is (pattern, replacement)
_RENAMES = (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^(model\.)?embed\.weight$", r"model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^(model\.)?hc_head_(fn|base|scale)$", r"model.hc_head.hc_\2"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.(self_attn|compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)
_COMPILED = tuple((re.compile(p), r) for p, r in _RENAMES)
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def module_name(name: str) -> str:
    """A V4 checkpoint name in this package's module form (`model.` prefix added where missing)."""
    for pattern, repl in _COMPILED:
        name = pattern.sub(repl, name)
    if name.startswith("layers.") or name.startswith("norm."):
        name = "model." + name
    return name


def expert_target(name: str) -> tuple[str, int, str] | None:
    """(`...experts` module name, expert index, projection) of a per-expert matrix, else None."""
    m = _EXPERT.match(name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None
