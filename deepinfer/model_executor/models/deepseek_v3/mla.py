"""Multi-head latent attention (DeepSeek-V2 / V3) weights and math, independent of any cache layout.

One layer, HF parameter names; H heads of this rank, r = kv_lora_rank, dr = qk_rope_head_dim,
dn = qk_nope_head_dim, dv = v_head_dim (DeepSeek-V3: r 512, dr 64, dn 128, dv 128)::

    q              = q_b_proj(q_a_layernorm(q_a_proj(x)))  or  q_proj(x)   [T, H, dn + dr]
    c | k_pe       = kv_a_proj_with_mqa(x)                                 [T, r], [T, dr]
    row            = kv_a_layernorm(c) | rope(k_pe)                        [T, r + dr]  ONE row for all heads
    k_nope | v     = kv_b_proj(row[:, :r]), per head                       [L, H, dn], [L, H, dv]

The cache keeps only `row` (576 values per token per layer for V3): K and V of every head come
from it. Two forms read it:

    unabsorbed (prefill)  expand each row into per-head K = k_nope | k_pe and V; softmax(q K^T s) V
    absorbed (decode)     W_uk [H, dn, r], W_uv [H, dv, r] = kv_b_proj's per-head blocks;
                          q_lat = q_nope W_uk, so that q_nope . k_nope = q_lat . c
                          o_lat = MQA of (q_lat | q_pe) over the rows (K = V = row, no sink)
                          o     = o_lat[..., :r] W_uv^T                                 [N, H, dv]

Both are the same function of the rows (they differ by float rounding only): the absorbed form
reads r + dr values per row instead of H (dn + dr + dv), the unabsorbed one spends no r-wide
product per head on a long chunk of queries.

RoPE: DeepSeek rotates channel pairs (2i, 2i+1) (V2; V3 with `rope_interleave`); those channels
are de-interleaved first and rotated in the rotate-half layout (layers/rotary.py), for q and k
alike, which leaves every q . k unchanged. Tensor parallelism (n ranks) splits the heads: q_b_proj
(or q_proj) and kv_b_proj by output rows, o_proj by input columns (one all_reduce); q_a_proj,
kv_a_proj_with_mqa and their norms stay whole, so every rank stores the same latent rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed.parallel_state import tp_size
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.layers.parallel_linear import ColumnParallelLinear, even_piece, row_parallel_linear
from deepinfer.model_executor.layers.rotary import RotaryEmbedding, rope_inv_freq
from deepinfer.model_executor.models.deepseek_v3.config import DeepseekConfigFields, interleaved_rope, softmax_scale

NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm (HF builds them with the default eps, not rms_norm_eps)


def mla_rotary(cfg, max_positions: int) -> RotaryEmbedding:
    """The RoPE tables of the rope channels (YaRN and other scaled variants through transformers),
    shared by every layer."""
    inv_freq, scaling = rope_inv_freq(cfg, cfg.qk_rope_head_dim)
    return RotaryEmbedding(inv_freq, max(max_positions, 1), scaling)


def check_head_split(num_heads: int, size: int) -> None:
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={num_heads}")


class MLAAttention(nn.Module):
    """One layer's MLA weights (HF names) and both forms of its attention; the caller owns the rows."""

    def __init__(self, cfg, rotary: RotaryEmbedding):
        super().__init__()
        heads, size = cfg.num_attention_heads, tp_size()
        check_head_split(heads, size)
        self.num_heads = heads // size  # this rank's
        self.kv_lora_rank, self.rope_dim = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.row_dim = self.kv_lora_rank + self.rope_dim
        bias = bool(DeepseekConfigFields.of(cfg).attention_bias)
        q_piece = even_piece(heads * self.qk_dim, "num_attention_heads * qk_head_dim")
        self.q_lora_rank = cfg.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [q_piece], bias=False)
        else:  # DeepSeek-V2-Lite: q_lora_rank None
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, [q_piece], bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.row_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, NORM_EPS)
        kv_piece = even_piece(heads * (self.nope_dim + self.v_dim), "num_attention_heads * (qk_nope_head_dim + "
                                                                     "v_head_dim)")
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, [kv_piece], bias=False)
        self.o_proj = row_parallel_linear(heads * self.v_dim, cfg.hidden_size, bias, "num_attention_heads * v_head_dim")
        self.rotary = rotary
        self.interleaved = interleaved_rope(cfg)
        self.scale = softmax_scale(cfg)

    # ---- projections ------------------------------------------------------------------------
    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (q_nope [T, H, dn], q_pe [T, H, dr] with RoPE, latent rows [T, r + dr])."""
        num_tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(num_tokens, self.num_heads, self.qk_dim).split([self.nope_dim, self.rope_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)  # [T, r], [T, dr]
        q_pe, k_pe = self._rope(positions, q_pe, k_pe)
        return q_nope, q_pe, torch.cat([self.kv_a_layernorm(c.contiguous()), k_pe], -1)  # ..., [T, r + dr]

    def _rope(self, positions, q_pe: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe [T, H, dr], k_pe [T, dr] -> rotated (pairs de-interleaved first when the model interleaves)."""
        if self.interleaved:
            q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], -1)  # [T, H, dr]
            k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], -1)  # [T, dr]
        q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.contiguous()[:, None, :])
        return q_pe, k_pe[:, 0]  # [T, H, dr], [T, dr]

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, dv] -> o_proj -> [T, hidden] (summed over the ranks)."""
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.v_dim))

    # ---- unabsorbed: rows expanded into per-head K and V --------------------------------------
    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [L, r + dr] -> (K [L, H, dn + dr], V [L, H, dv])."""
        num_rows = rows.shape[0]
        c, k_pe = rows.split([self.kv_lora_rank, self.rope_dim], -1)
        kv = self.kv_b_proj(c).view(num_rows, self.num_heads, self.nope_dim + self.v_dim)  # [L, H, dn + dv]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], -1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(num_rows, self.num_heads, self.rope_dim)], -1)  # [L, H, dn+dr]
        return k, v

    def unabsorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                   visible: torch.Tensor | None) -> torch.Tensor:
        """Queries [n, H, dn], [n, H, dr] over latent rows [L, r + dr] shared by all n queries;
        visible [n, L] bool (the mask: no causal mask of its own), or None when the rows are
        exactly the n queries' own positions in order (causal). -> [n, H, dv]"""
        k, v = self.expand(rows.to(q_nope.dtype))  # [L, H, dn+dr], [L, H, dv]
        q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], -1).transpose(0, 1)  # [H, n, dn+dr]
        out = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible,
                                             is_causal=visible is None, scale=self.scale)  # [H, n, dv]
        return out.transpose(0, 1)  # [n, H, dv]

    # ---- absorbed: MQA over the latent rows ------------------------------------------------------
    def _up_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's per-head blocks: W_uk [H, dn, r], W_uv [H, dv, r]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache, index: torch.Tensor, kernels,
                 no_sink: torch.Tensor) -> torch.Tensor:
        """Queries [N, H, dn], [N, H, dr] over the rows of `cache` at index [N, L] (-1: none; the
        index rows are the mask) through the kernel set's sparse MLA hook (K = V = the latent row,
        a sink of -inf: none). -> [N, H, dv]"""
        w_uk, w_uv = self._up_blocks()
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)  # [N, H, r]
        q = torch.cat([q_lat, q_pe.to(q_lat.dtype)], -1)  # [N, H, r + dr]
        o_lat = kernels.sparse_mla(q, cache, index, self.scale, no_sink)  # [N, H, r + dr]
        return torch.einsum("nhr,hvr->nhv", o_lat[..., :self.kv_lora_rank], w_uv)  # [N, H, dv]
