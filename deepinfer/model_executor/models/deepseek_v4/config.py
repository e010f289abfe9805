"""The optional DeepSeek-V4 config fields this package reads, declared once with their defaults.

A config that leaves one out means what the default here says (transformers' `DeepseekV4Config`, or
the checkpoints that predate a field: `num_hash_layers` before `mlp_layer_types` named each layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.contracts.hf_config import HFConfigFields


@dataclass(frozen=True)
class DeepseekV4ConfigFields(HFConfigFields):
    """What a DeepSeek-V4 config sets of the optional fields (`rope_parameters` is HFConfigFields')."""

    hidden_act: str = "silu"  # the experts are SwiGLU: anything else is refused
    norm_topk_prob: bool = True  # renormalise the k routing weights to sum to 1
    mlp_layer_types: Sequence[str] | None = None  # "hash_moe" / "moe" per layer; None: num_hash_layers
    num_hash_layers: int = 0  # the first layers route by token id (when mlp_layer_types is None)
    swiglu_limit: float | None = None  # None: the SwiGLU is not clamped
    n_shared_experts: int = 1  # the shared expert is this many experts wide
    num_nextn_predict_layers: int | None = None  # MTP layers (None: one)
