"""One DeepSeek-V2 / V3 decoder layer: pre-norm MLA attention, then a dense MLP or an MoE block.

    h = h + self_attn(input_layernorm(h))
    h = h + mlp(post_attention_layernorm(h))      mlp: SplitMLP (layers < first_k_dense_replace) or DeepseekMoE
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.models.deepseek_v3.cached_attn import CachedMLAAttention
from deepinfer.model_executor.models.deepseek_v3.config import is_moe_layer
from deepinfer.model_executor.models.deepseek_v3.moe import DeepseekMoE, SplitMLP


class DeepseekDecoderLayer(nn.Module):
    """HF names: `self_attn`, `mlp`, `input_layernorm`, `post_attention_layernorm`. `moe` forces an
    MoE block (the MTP layers); by default layer `layer_idx` is MoE from `first_k_dense_replace` on."""

    def __init__(self, cfg, layer_idx: int, rotary, expert_parallel_size: int = 1, moe: bool | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = CachedMLAAttention(cfg, layer_idx, rotary)
        moe = is_moe_layer(cfg, layer_idx) if moe is None else moe
        self.mlp = DeepseekMoE(cfg, expert_parallel_size) if moe else SplitMLP(cfg.hidden_size, cfg.intermediate_size,
                                                                                "intermediate_size")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]."""
        h = h + self.self_attn(self.input_layernorm(h), positions)  # [T, hidden]
        return h + self.mlp(self.post_attention_layernorm(h))  # [T, hidden]
