"""DeepSeek-V4 attention math, independent of any cache layout.

One V4 attention layer (HF parameter names)::

    q_residual = q_a_norm(q_a_proj(x))                       [T, q_lora_rank]   (also feeds the indexer)
    q          = rope(rms(q_b_proj(q_residual) per head))    [T, H, D]          unweighted per-head RMSNorm
    kv_row     = rope(kv_norm(kv_proj(x)))                   [T, D]             ONE latent row, K = V
    o          = sparse_attention_with_sink(q, rows, valid)  [T, H, D]          rows = window (+ compressed)
    o          = rope^-1(o)                                  [T, H, D]          de-rotation at the query position
    out        = o_b_proj(o_a_proj(o grouped in o_groups))   [T, hidden]

With tensor_parallel_size n > 1 each rank holds H / n heads: q_b_proj's rows of its heads, their
sinks, the o_groups / n whole output groups those heads feed (o_a_proj's rows of the groups,
o_b_proj's columns of them) and one all_reduce after o_b_proj. q_a_proj, kv_proj, the
compressors and the indexer stay whole: the latent row is one K = V row every head reads.

RoPE is interleaved (channel pairs (2i, 2i+1)) on the trailing ``qk_rope_head_dim`` channels of
each head. Sliding-only layers use the ``main`` RoPE (base ``rope_theta``); CSA/HCA layers use the
``compress`` RoPE (base ``compress_rope_theta``, possibly YaRN), the same as their compressor.
Because K = V, every value carries RoPE of its own position; rotating the output's rope channels
by minus the query position (HF: ``cos, -sin``) leaves each row's contribution a function of the
relative distance only.

The sink: a learned logit per head joins the softmax over a query's rows and contributes no
value, so the weights of the real rows sum to less than one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.contracts.weight_storage import FP32, LINEAR
from deepinfer.distributed.parallel_state import tp_size
from deepinfer.model_executor.layers.batch_invariant import linear as invariant_linear
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.layers.ops.torch_sparse_mla import attention_over_parts
from deepinfer.model_executor.layers.parallel_linear import (
    ColumnParallelLinear,
    ShardSpec,
    even_piece,
    row_parallel_linear,
)
from deepinfer.model_executor.layers.rotary import rope_inv_freq
from deepinfer.model_executor.models.deepseek_v4.compressor import apply_interleaved_rope, compress_rope_inv_freq

SLIDING = "sliding_attention"


def rope_label(layer_type: str) -> str:
    """HF's RoPE label for a layer type: ``main`` for sliding-only layers, ``compress`` otherwise."""
    return "main" if layer_type == SLIDING else "compress"


def attention_rope_inv_freq(config, layer_type: str) -> tuple[torch.Tensor, float]:
    """(inv_freq [qk_rope_head_dim/2], attention_scaling) of the RoPE a layer's attention uses."""
    rope_dim = config.qk_rope_head_dim
    if rope_label(layer_type) == "compress":
        return compress_rope_inv_freq(config, rope_dim)
    params = (HFConfigFields.of(config).rope_parameters or {}).get("main") or {}
    return rope_inv_freq(config, rope_dim, params or {"rope_type": "default"}, "main",
                         default_theta=config.rope_theta)


def head_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm over the last axis (HF ``q_b_norm``), computed in fp32."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)  # [..., D]


def sparse_attention_with_sink(q: torch.Tensor, kv_rows: torch.Tensor, valid: torch.Tensor,
                               sink_logits: torch.Tensor, scale: float) -> torch.Tensor:
    """Each query attends over its own rows; a per-head sink logit joins the softmax.

    q [T, H, D], kv_rows [T, L, D] (shared K = V), valid [T, L] bool, sink_logits [H] -> [T, H, D].
    """
    return attention_over_parts(q, [(kv_rows, valid)], sink_logits, scale)  # [T, H, D]


def window_index(num_tokens: int, window: int, device=None) -> torch.Tensor:
    """Token indices [T, W] of each query's window, oldest first; -1 before the sequence start.

    Query i reads tokens ``max(0, i - W + 1) .. i``.
    """
    i = torch.arange(num_tokens, device=device)[:, None]  # [T, 1]
    k = torch.arange(window, device=device)[None, :]  # [1, W]
    idx = i - (window - 1) + k  # [T, W]
    return idx.masked_fill(idx < 0, -1)  # [T, W]


class GroupedLinear(nn.Module):
    """Block-diagonal projection (HF ``DeepseekV4GroupedLinear``): each of ``n_groups`` inputs of
    ``in_per_group`` features goes to its own ``out_features / n_groups`` outputs.

    weight [out_features, in_per_group], group g owning rows ``[g·out/G, (g+1)·out/G)``.
    ``batch_invariant`` (DEEPINFER_BATCH_INVARIANT): one `batch_invariant.linear` per group, whose
    rows' bits do not depend on the row count (the einsum's bmm does).
    """

    batch_invariant = False
    param_storage = {"weight": LINEAR}

    def __init__(self, in_per_group: int, out_features: int, n_groups: int):
        super().__init__()
        self.n_groups = n_groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, G, in_per_group] -> [T, G, out/G]."""
        w = self.weight.view(self.n_groups, -1, self.weight.shape[-1])  # [G, out/G, in]
        if self.batch_invariant:
            return torch.stack([invariant_linear(x[:, g], w[g]) for g in range(self.n_groups)], dim=1)
        return torch.einsum("tgi,goi->tgo", x, w)  # [T, G, out/G]


def check_head_split(num_heads: int, o_groups: int, size: int) -> None:
    """Refuse a head split that does not work, naming the sizes: n must divide the query heads and
    the output groups (each rank holds whole groups of its heads)."""
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={num_heads}")
    if o_groups % size:
        raise ValueError(f"tensor_parallel_size={size} must divide o_groups={o_groups}")


def _q_b_proj(q_lora_rank: int, num_heads: int, head_dim: int) -> nn.Linear:
    """[H·D, q_lora_rank], split by heads over the ranks (a plain Linear with one rank)."""
    if tp_size() == 1:
        return nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
    return ColumnParallelLinear(q_lora_rank, [even_piece(num_heads * head_dim, "num_attention_heads * head_dim")],
                                bias=False)


def _o_a_proj(in_per_group: int, o_groups: int, o_lora_rank: int) -> GroupedLinear:
    """The rank's whole groups: rows [g·o_lora_rank, (g+1)·o_lora_rank) of each group g it holds."""
    size = tp_size()
    proj = GroupedLinear(in_per_group, o_groups // size * o_lora_rank, o_groups // size)
    if size > 1:
        proj.shard_specs = {"weight": ShardSpec(0, (even_piece(o_groups * o_lora_rank, "o_groups * o_lora_rank"),))}
    return proj


class DeepseekV4Attention(nn.Module):
    """V4 attention weights and math for one layer; the caller owns the cache and the row lists.

    Parameters mirror HF ``DeepseekV4Attention`` (q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm,
    o_a_proj, o_b_proj, sinks); a CSA/HCA layer's ``compressor`` lives elsewhere.
    """

    param_storage = {"sinks": FP32}

    def __init__(self, config, layer_type: str = SLIDING):
        super().__init__()
        h, d, groups, size = config.num_attention_heads, config.head_dim, config.o_groups, tp_size()
        check_head_split(h, groups, size)
        self.num_heads, self.head_dim, self.o_groups = h // size, d, groups // size  # this rank's
        self.eps, self.scale = config.rms_norm_eps, d**-0.5
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = _q_b_proj(config.q_lora_rank, h, d)
        self.kv_proj = nn.Linear(config.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.o_a_proj = _o_a_proj(h * d // groups, groups, config.o_lora_rank)
        self.o_b_proj = row_parallel_linear(groups * config.o_lora_rank, config.hidden_size, False,
                                            "o_groups * o_lora_rank")
        self.sinks = nn.Parameter(torch.zeros(h // size, dtype=torch.float32))
        if size > 1:
            self.shard_specs = {"sinks": ShardSpec(0, (even_piece(h, "num_attention_heads"),))}
        inv_freq, self.rope_scaling = attention_rope_inv_freq(config, layer_type)
        self.inv_freq = inv_freq  # [rope_dim/2] fp32; a plain tensor, so casting the model to bf16 keeps it exact

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_interleaved_rope(x, positions, self.inv_freq, self.rope_scaling).to(x.dtype)

    def queries(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> (q [T, H, D] with RoPE, q_residual [T, q_lora_rank] for the indexer)."""
        q_residual = self.q_a_norm(self.q_a_proj(hidden))  # [T, q_lora_rank]
        q = self.q_b_proj(q_residual).view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        q = head_rms_norm(q, self.eps)  # [T, H, D]
        return self._rope(q, positions), q_residual  # [T, H, D], [T, q_lora_rank]

    def kv_rows(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> the latent row [T, D] the window cache stores (K = V), with RoPE."""
        kv = self.kv_norm(self.kv_proj(hidden))  # [T, D]
        return self._rope(kv, positions)  # [T, D]

    def attend(self, q: torch.Tensor, kv_rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] over each query's rows [T, L, D] (valid [T, L]) with this layer's sinks."""
        return sparse_attention_with_sink(q, kv_rows, valid, self.sinks, self.scale)  # [T, H, D]

    def attend_parts(self, q: torch.Tensor, parts) -> torch.Tensor:
        """q [T, H, D] over shared and per-query row sets (see `attention_over_parts`)."""
        return attention_over_parts(q, parts, self.sinks, self.scale)  # [T, H, D]

    def output(self, attn_out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """De-rotate at the query position, grouped low-rank projection, mix: [T, H, D] -> [T, hidden]."""
        o = apply_interleaved_rope(attn_out, -positions, self.inv_freq, self.rope_scaling)  # [T, H, D]
        o = o.to(attn_out.dtype).reshape(o.shape[0], self.o_groups, -1)  # [T, G, H·D/G]
        o = self.o_a_proj(o).flatten(1)  # [T, G·o_lora_rank]
        return self.o_b_proj(o)  # [T, hidden]

    def forward_full(self, hidden: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
        """Reference for ONE sequence, sliding-window attention only (no compressed rows).

        hidden [T, hidden], positions [T] consecutive; query p reads the fresh rows of positions
        ``max(p0, p - W + 1) .. p`` (p0 = positions[0]; earlier rows are not available here).
        """
        num_tokens = hidden.shape[0]
        if num_tokens and not torch.equal(positions, positions[0] + torch.arange(num_tokens, device=positions.device)):
            raise ValueError("forward_full needs consecutive positions for one sequence")
        q, _ = self.queries(hidden, positions)  # [T, H, D]
        rows = self.kv_rows(hidden, positions)  # [T, D]
        idx = window_index(num_tokens, window, hidden.device)  # [T, W]
        gathered = rows[idx.clamp(min=0)]  # [T, W, D]
        out = self.attend(q, gathered, idx >= 0)  # [T, H, D]
        return self.output(out, positions)  # [T, hidden]
