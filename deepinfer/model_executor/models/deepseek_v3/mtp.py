"""DeepSeek-V3 multi-token prediction (MTP): the checkpoint's next-n layers as a draft proposer.

One MTP layer (checkpoint `model.layers.{L + i}`, L = num_hidden_layers; transformers' `MtpLayer`)
at each position t of a sequence::

    h      = the main model's final hidden state at t (after its norm: what the head reads) [T, hidden]
    e      = embed(token_{t+1})                                                 [T, hidden]
    x      = eh_proj(enorm(e) | hnorm(h))                                       [T, hidden]
    x      = one MLA decoder layer (attention over the layer's own rows, MoE)
    logits = lm_head(shared_head.norm(x))                                       [T, vocab]

The output at t predicts token t+2. The embedding and the LM head are the main model's (the
checkpoint's copies under the MTP prefix are not loaded). h after the main norm is what
transformers' `MtpModel` and vLLM read. The MTP drafter (spec_decode/mtp.py) chains
the layers: pass 0 over a step's kept positions, pass j >= 1 one position further, with the
previous pass's output `x` before `shared_head.norm` as h (vLLM's chain; transformers drafts
one token per layer and has no chain to follow). Its rows live in
the engine's "mtp" ring group: a ring as long as the model length, so every position the
drafter writes ahead of the request (passes j >= 1) has a row whatever blocks the request holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.models.decoder import DecoderLayer, DecoderSpec
from deepinfer.model_executor.models.deepseek_v3.config import num_mtp_layers


class SharedHead(nn.Module):
    """The MTP layer's final norm (`shared_head.norm`); the head itself is the main model's."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class DeepseekMTPLayer(DecoderLayer):
    """A decoder layer (MoE: its index is past `first_k_dense_replace`) with the MTP input
    projection (`enorm`, `hnorm`, `eh_proj`) and `shared_head.norm`; streams are [T, 1, hidden]
    (one residual stream: DraftingModel's shape)."""

    def __init__(self, spec: DecoderSpec, cfg, layer_idx: int, rotary, expert_parallel_size: int = 1):
        super().__init__(spec, cfg, layer_idx, rotary, expert_parallel_size)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(h, eps)

    def forward_cached(self, prev_streams: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
                       next_ids: torch.Tensor) -> torch.Tensor:
        """prev_streams [T, 1, hidden] (h at each position), next_embeds [T, hidden] (the embedding
        of the token one position later), positions [T], next_ids [T] -> [T, 1, hidden]. The
        attention stores and reads the "mtp" ring through the forward context's metadata."""
        x = torch.cat([self.enorm(next_embeds), self.hnorm(prev_streams[:, 0])], -1)  # [T, 2 hidden]
        return self(positions, self.eh_proj(x))[:, None]  # [T, 1, hidden]

    def logits(self, streams: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """streams [T, 1, hidden] -> [T, vocab] through shared_head.norm and the main model's head."""
        hidden = self.shared_head.norm(streams[:, 0])  # [T, hidden]
        return F.linear(hidden.to(lm_head_weight.dtype), lm_head_weight)  # [T, vocab]


class DeepseekMTP(nn.Module):
    """The `num_nextn_predict_layers` MTP layers (`layers`); spec step j uses `layers[j % n]`."""

    def __init__(self, spec: DecoderSpec, cfg, rotary, expert_parallel_size: int = 1):
        super().__init__()
        n = num_mtp_layers(cfg)
        if n < 1:
            raise ValueError(f"num_nextn_predict_layers must be >= 1 for an MTP module, got {n}")
        self.layers = nn.ModuleList(DeepseekMTPLayer(spec, cfg, cfg.num_hidden_layers + i, rotary,
                                                     expert_parallel_size)
                                    for i in range(n))

    def layer_for_step(self, spec_step_idx: int) -> DeepseekMTPLayer:
        return self.layers[spec_step_idx % len(self.layers)]
