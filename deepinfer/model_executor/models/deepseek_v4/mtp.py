"""DeepSeek-V4 multi-token prediction (MTP): the checkpoint's `mtp.{i}` blocks as a draft proposer.

One MTP layer, for each position t of a sequence (structure of DeepSeek's `MTPBlock` and vLLM's
`DeepSeekV4MultiTokenPredictorLayer`)::

    h       = the main model's residual streams at t, before its hc_head     [T, N, hidden]
    e       = embed(token_{t+1}), zeroed where the position is 0             [T, hidden]
    streams = h_proj(hnorm(h)) + e_proj(enorm(e))[:, None]                   [T, N, hidden]
    streams = one V4 decoder layer (hyper-connected sliding-window attention, score-routed MoE)
    logits  = lm_head(norm(hc_head(streams)))                                [T, vocab]

The output streams at t predict token t+2. In the engine (`forward_cached`), the block's
sliding-window rows live in the engine's "mtp" ring group, one ring per request like the main
layers' window, written and read through the step's metadata (`spec_decode/mtp.py`).
`hnorm` normalises each stream on its own. The
embedding and the LM head are the main model's (the checkpoint carries no MTP copies); `hc_head`
and `norm` are the MTP layer's own. The block's attention is sliding-window only (no compressor)
with the `main` RoPE, and its MoE routes by score, never by token hash.

Checkpoint names `mtp.{i}.X` are the main layers' V4 names (`attn.wq_a`, `ffn.experts.7.w1`,
`hc_attn_fn`, `attn_norm`, ...) plus `enorm`, `hnorm`, `e_proj`, `h_proj`, `norm` and
`hc_head_{fn,base,scale}`; they load into `layers.{i}.*` here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.models.deepseek_v4.attn import SLIDING
from deepinfer.model_executor.models.deepseek_v4.cached_attn import CachedV4Attention
from deepinfer.model_executor.models.deepseek_v4.config import DeepseekV4ConfigFields
from deepinfer.model_executor.models.deepseek_v4.hyper_connection import HyperConnection, HyperHead
from deepinfer.model_executor.models.deepseek_v4.moe import DeepseekV4MoE
from deepinfer.model_executor.models.deepseek_v4.names import module_name
from deepinfer.model_executor.models.deepseek_v4.weights import dequantize_v4_weights, load_v4_weights

_MTP_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
# the main model's embedding / head under an MTP prefix (vLLM maps them onto the shared modules)
_SHARED_NAMES = re.compile(r"^(emb\.tok_emb|embed|embed_tokens|head|shared_head\.head)\.")
_HC_HEAD = re.compile(r"\.hc_head_(fn|base|scale)$")


def num_mtp_layers(cfg) -> int:
    """`num_nextn_predict_layers` of the config (1 when absent)."""
    n = DeepseekV4ConfigFields.of(cfg).num_nextn_predict_layers
    return 1 if n is None else int(n)


class DeepseekV4MTPLayer(nn.Module):
    """One MTP block (checkpoint `mtp.{i}`); see the module docstring for the math.

    Parameters: `enorm`, `hnorm`, `e_proj`, `h_proj`, then a decoder layer's `self_attn`, `mlp`,
    `input_layernorm`, `post_attention_layernorm`, `attn_hc`, `ffn_hc`, then `hc_head`, `norm`.
    """

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        h = cfg.hidden_size
        self.hc_mult, self.window = cfg.hc_mult, cfg.sliding_window
        self.layer_idx = layer_idx  # its id in the "mtp" cache group (after the main layers)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.self_attn = CachedV4Attention(cfg, layer_idx, layer_type=SLIDING)
        self.mlp = DeepseekV4MoE(cfg, 0, score_routed=True)  # routes by score, whatever layer 0 does
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection.from_config(cfg)
        self.ffn_hc = HyperConnection.from_config(cfg)
        self.hc_head = HyperHead.from_config(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, prev_streams: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
                next_ids: torch.Tensor) -> torch.Tensor:
        """One sequence, stateless: prev_streams [T, N, hidden] (the previous model's streams at each
        position), next_embeds [T, hidden] (embedding of the token one position later), positions
        [T] consecutive, next_ids [T] (those tokens) -> streams [T, N, hidden].

        The attention reads only the rows of `positions` (query p: `max(p0, p - W + 1) .. p`).
        """
        num_tokens = positions.shape[0]
        if prev_streams.shape[:2] != (num_tokens, self.hc_mult) or next_embeds.shape[0] != num_tokens:
            raise ValueError(f"prev_streams must be [{num_tokens}, {self.hc_mult}, hidden] and next_embeds "
                             f"[{num_tokens}, hidden], got {tuple(prev_streams.shape)} and {tuple(next_embeds.shape)}")
        return self._block(prev_streams, next_embeds, positions, next_ids,
                           lambda x: self.self_attn.forward_full(x, positions, self.window))

    def forward_cached(self, prev_streams: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
                       next_ids: torch.Tensor) -> torch.Tensor:
        """`forward` for a packed step of many requests, its attention over the engine's "mtp"
        ring through the forward context's metadata (store the new rows, read each query's
        window). Same shapes as `forward`."""
        return self._block(prev_streams, next_embeds, positions, next_ids, lambda x: self.self_attn(x, positions))

    def _block(self, prev_streams, next_embeds, positions, next_ids, attention) -> torch.Tensor:
        e = next_embeds.masked_fill((positions == 0)[:, None], 0)  # [T, hidden]  position 0 sees no token
        streams = self.h_proj(self.hnorm(prev_streams)) + self.e_proj(self.enorm(e)).unsqueeze(1)  # [T, N, hidden]
        x, post, comb = self.attn_hc(streams)  # [T, hidden], [T, N], [T, N, N]
        streams = self.attn_hc.merge(attention(self.input_layernorm(x)), streams, post, comb)
        x, post, comb = self.ffn_hc(streams)
        moe = self.mlp(self.post_attention_layernorm(x), next_ids)  # [T, hidden]
        return self.ffn_hc.merge(moe, streams, post, comb)  # [T, N, hidden]

    def logits(self, streams: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """streams [T, N, hidden] -> [T, vocab] through this layer's hc_head and norm and the shared head."""
        hidden = self.norm(self.hc_head(streams))  # [T, hidden]
        return F.linear(hidden.to(lm_head_weight.dtype), lm_head_weight)  # [T, vocab]


class DeepseekV4MTP(nn.Module):
    """The `num_nextn_predict_layers` MTP layers (`layers`) and a greedy draft proposer.

    Spec step j uses `layers[j % len(layers)]` (vLLM's `spec_step_idx % num_mtp_layers`).
    """

    def __init__(self, cfg):
        super().__init__()
        n = num_mtp_layers(cfg)
        if n < 1:
            raise ValueError(f"num_nextn_predict_layers must be >= 1 for an MTP module, got {n}")
        self.config, self.window, self.hc_mult = cfg, cfg.sliding_window, cfg.hc_mult
        self.layers = nn.ModuleList(DeepseekV4MTPLayer(cfg, cfg.num_hidden_layers + i) for i in range(n))

    # ---- weights ---------------------------------------------------------------------------
    def _owns(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (a weight or its scale) belongs to one of our layers."""
        m = _MTP_NAME.match(name)
        return m is not None and int(m.group(1)) < len(self.layers) and not _SHARED_NAMES.match(m.group(2))

    def checkpoint_name(self, name: str) -> str | None:
        """This module's parameter name for checkpoint tensor `name`; None when it is not ours
        (not `mtp.*`, an MTP layer past `num_nextn_predict_layers`, or a copy of the shared
        embedding / head)."""
        if not self._owns(name):
            return None
        m = _MTP_NAME.match(name)
        target = _HC_HEAD.sub(r".hc_head.hc_\1", module_name(f"layers.{m.group(1)}.{m.group(2)}"))
        return target.removeprefix("model.")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load V4-named checkpoint tensors (`mtp.{i}.*`; FP8 / FP4 ones with their scales).

        Other names (the main model's, `mtp.{i}` past the layer count, MTP copies of the shared
        embedding / head) are skipped, so a whole checkpoint may be streamed in. Returns the
        parameter names loaded; raises ValueError when any parameter is left unloaded.
        """
        ours = ((n, t) for n, t in named_tensors if self._owns(n))
        loaded = load_v4_weights(self, dequantize_v4_weights(ours, torch.float32), rename=self.checkpoint_name)
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} MTP parameters, e.g. {sorted(missing)[:3]}")
        return loaded

    # ---- draft -----------------------------------------------------------------------------
    def layer_for_step(self, spec_step_idx: int) -> DeepseekV4MTPLayer:
        return self.layers[spec_step_idx % len(self.layers)]

    @torch.no_grad()
    def propose(self, main_model, token_ids: list[int], k: int, prev_streams: torch.Tensor,
                start_pos: int = 0) -> list[int]:
        """k greedy draft tokens after `token_ids`.

        Contract (one sequence, stateless):
        - `prev_streams [T, N, hidden]`: the main model's residual streams before its hc_head
          (`model.forward_streams`) at positions `start_pos .. start_pos + T - 1`;
        - `token_ids`: T + 1 ids, the tokens at those T positions followed by the token the main
          model sampled after them (position `start_pos + T`);
        - `main_model`: supplies the shared `model.embed_tokens` and `lm_head`.
        Step 0 runs MTP layer 0 over the T positions (streams h_t with the embedding of token
        t + 1); its output at the last position gives draft 1 (position `start_pos + T + 1`). Step
        j >= 1 appends one position: the previous step's output streams at the last position as
        prev_streams, the embedding of draft j as the next token, and runs `layers[j % L]`; its
        output there gives draft j + 1. Every step attends over the same extended sequence (the T
        positions then one per earlier step), which is what a cached single-layer MTP sees.
        The attention reads the last `sliding_window` positions only, so supplying at least that
        many (or the whole sequence from position 0) gives exact results; fewer truncate the
        window at `start_pos`. The embedding at position 0 is zeroed (vLLM).
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        num_tokens = prev_streams.shape[0]
        if prev_streams.dim() != 3 or prev_streams.shape[1] != self.hc_mult or num_tokens < 1:
            raise ValueError(f"prev_streams must be [T >= 1, {self.hc_mult}, hidden], got {tuple(prev_streams.shape)}")
        if len(token_ids) != num_tokens + 1:
            raise ValueError(f"token_ids must hold T + 1 = {num_tokens + 1} ids, got {len(token_ids)}")
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        embed_weight, head_weight = main_model.model.embed_tokens.weight, main_model.lm_head.weight
        device = prev_streams.device
        rows = list(prev_streams.unbind(0))  # per position [N, hidden]
        next_ids = list(token_ids[1:])  # the token one position later, per position
        drafts: list[int] = []
        for step in range(k):
            layer = self.layer_for_step(step)
            lo = max(0, len(rows) - self.window)  # the last query's window
            ids = torch.tensor(next_ids[lo:], dtype=torch.long, device=device)  # [n]
            positions = start_pos + torch.arange(lo, len(rows), device=device)  # [n]
            out = layer(torch.stack(rows[lo:]), F.embedding(ids, embed_weight), positions, ids)  # [n, N, hidden]
            draft = int(layer.logits(out[-1:], head_weight)[0].argmax())
            drafts.append(draft)
            rows.append(out[-1])
            next_ids.append(draft)
        return drafts
