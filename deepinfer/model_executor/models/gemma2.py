"""Gemma 2: the Gemma spec of models/gemma3.py with Gemma 2's choices.

    layers      alternating sliding (HF `layer_types`: the even layers) and global; the sliding ones
                keep their rows in rings (one "swa" group), the global ones in paged blocks
    attention   logits soft-capped, cap * tanh(s / cap) (`attn_logit_softcapping`, 50.0), in every
                kernel set (attention/layer.py); scale query_pre_attn_scalar ** -0.5; no q/k norm
    RoPE        one base (`rope_parameters`) for all layers
    logits      soft-capped (`final_logit_softcapping`, 30.0)

Parameter names are HF's `Gemma2ForCausalLM` names.
"""

from __future__ import annotations

from deepinfer.model_executor.models.decoder import DecoderSpec, shared_rotary
from deepinfer.model_executor.models.gemma3 import Gemma3ForCausalLM, gemma_spec


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """HF `gemma2`: Gemma 3's decoder without q/k norm, one RoPE, logit soft-caps as configured."""

    @classmethod
    def decoder_spec(cls, cfg, expert_parallel_size: int = 1) -> DecoderSpec:
        return gemma_spec(cfg, qk_norm=False, rotaries=shared_rotary)
