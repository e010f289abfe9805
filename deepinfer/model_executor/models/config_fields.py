"""The optional fields of a Llama-family config, declared once with their defaults.

A transformers config holds only what its model class and config.json name. The family spec
functions (`llama_spec`, `gemma_spec`, `moe_spec`, `gpt_oss_spec`) read the optional fields through
`DecoderFields.of(cfg)`, never probing the config where they use a field; a member family passes its
own default where it differs (Gemma ties its embeddings, GPT-OSS biases its attention). Fields every
config of the family has (`hidden_size`, `num_hidden_layers`, ...) are read from the config itself.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class DecoderFields:
    """What a config sets of the optional fields; a field it does not set has the default here."""

    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    sliding_window: int | None = None  # W of the sliding layers (None: full attention everywhere)
    layer_types: list[str] | None = None  # per layer "sliding_attention" / "full_attention"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attn_logit_softcapping: float | None = None  # Gemma
    final_logit_softcapping: float | None = None  # Gemma
    use_bidirectional_attention: bool = False  # Gemma 3 (refused: the engine decodes causally)
    decoder_sparse_step: int = 1  # MoE: every n-th layer sparse
    mlp_only_layers: list[int] | None = None  # MoE: layers kept dense
    norm_topk_prob: bool = False  # MoE: renormalise the top-k weights
    swiglu_alpha: float | None = None  # GPT-OSS (None: its default)
    quantization_config: Any = None  # GPT-OSS's MXFP4 experts

    @classmethod
    def of(cls, cfg: Any, **defaults: Any) -> DecoderFields:
        """The fields `cfg` sets, the others at `defaults` (a family's) or the defaults here."""
        return cls(**{f.name: getattr(cfg, f.name, defaults.get(f.name, f.default)) for f in fields(cls)})
