"""Gemma 2: the Gemma body of models/gemma3.py with Gemma 2's choices.

    layers      alternating sliding (HF `layer_types`: the even layers) and global; the sliding ones
                keep their rows in rings (one "swa" group), the global ones in paged blocks
    attention   logits soft-capped, cap * tanh(s / cap) (`attn_logit_softcapping`, 50.0), in every
                kernel set (attention/layer.py); scale query_pre_attn_scalar ** -0.5; no q/k norm
    RoPE        one base (`rope_parameters`) for all layers
    logits      soft-capped (`final_logit_softcapping`, 30.0)

Parameter names are HF's `Gemma2ForCausalLM` names.
"""

from __future__ import annotations

from deepinfer.model_executor.layers.rotary import RotaryEmbedding, rope_inv_freq
from deepinfer.model_executor.models.gemma3 import Gemma3ForCausalLM
from deepinfer.model_executor.models.llama import head_dim_of


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """HF `gemma2`: Gemma 3's body without q/k norm, one RoPE, logit soft-caps as configured."""

    qk_norm = False

    @staticmethod
    def rotaries(cfg, max_positions: int) -> dict[str, RotaryEmbedding]:
        """The one RoPE every layer kind shares."""
        inv_freq, scaling = rope_inv_freq(cfg, head_dim_of(cfg))
        rotary = RotaryEmbedding(inv_freq, max_positions, scaling)
        return {kind: rotary for kind in set(cfg.layer_types)}
