"""DeepSeek-V4 lightning indexer: picks the top-k compressed CSA rows for each query.

The indexer owns its own CSA compressor (``index_head_dim`` wide, same windows as the
attention's CSA compressor) whose rows are the index keys K_w. For query position p::

    I(p, w) = sum_h w_h(p) · ReLU(q_h(p) · K_w)          (w_h from weights_proj, q_h from q_b_proj)

Query p sees rows ``w < floor((p + 1) / m)`` (the token that completes a window already sees its
row). Invisible rows are masked before the top-k.

Tie rule (deterministic, width-independent): score descending, then lower row index first.
It is implemented as a *stable* descending sort over the row axis, so equal scores keep their
row order. The picks of query p then depend only on the scores of its visible rows, never on
how many invisible rows the score tensor happens to hold (whole-sequence forward, prefix
recompute, chunked prefill and decode all pick the same rows). A plain ``torch.topk`` gives no
such guarantee: which of several tied rows it returns at the k-th boundary depends on the
tensor's width and on k.

When fewer than k rows are visible, all visible rows are taken and the remaining slots are -1.

Under DEEPINFER_BATCH_INVARIANT (`batch_invariant`) the scores come from
`invariant_attention.index_scores`: each (query, row) gets the same bits whatever shares the call, so
the tie rule above compares exactly equal scores the same way in every batch and chunking; the
picks are then handed on in ascending row id, the order the attention sums them in.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_executor.layers.invariant_attention import index_scores
from deepinfer.model_executor.layers.kernel_set import CPU_KERNELS, KernelSet
from deepinfer.model_executor.layers.ops.addressing import visible_rows
from deepinfer.model_executor.models.deepseek_v4.pooling import CSA, WindowCompressor, apply_interleaved_rope


def num_visible_rows(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Rows a query at each position may read: floor((p + 1) / m). positions [n] -> [n]."""
    return visible_rows(positions, ratio)  # [n]


def topk_visible_rows(scores: torch.Tensor, positions: torch.Tensor, k: int, ratio: int) -> torch.Tensor:
    """Top-k row ids [n, k] of scores [n, R]; -1 where fewer than k rows are visible.

    Order: score descending, then lower row index (stable sort), so the result for query p is
    the same for any width R >= floor((p + 1) / m).
    """
    n, width = scores.shape
    visible = num_visible_rows(positions, ratio)  # [n]
    cols = torch.arange(width, device=scores.device)  # [R]
    invisible = cols[None, :] >= visible[:, None]  # [n, R]
    masked = scores.float().masked_fill(invisible, float("-inf"))  # [n, R]
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]  # [n, min(k, R)]
    picks = torch.full((n, k), -1, dtype=torch.long, device=scores.device)  # [n, k]
    picks[:, : order.shape[1]] = order
    return picks.masked_fill(picks >= visible[:, None], -1)  # [n, k]


class IndexerScorer(nn.Module):
    """Per-head query weights w_h (HF name ``scorer.weights_proj``) and the score sum."""

    def __init__(self, config):
        super().__init__()
        self.softmax_scale = config.index_head_dim**-0.5
        self.weights_scaling = config.index_n_heads**-0.5
        self.weights_proj = nn.Linear(config.hidden_size, config.index_n_heads, bias=False)
        self.kernels: KernelSet = CPU_KERNELS  # the indexer_scores hook: set when the model binds its caches
        self.batch_invariant = False  # DEEPINFER_BATCH_INVARIANT: `index_scores` instead of the hook

    def head_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """w_h per query: hidden [n, H] -> [n, h] (fp32)."""
        return self.weights_proj(hidden).float() * self.weights_scaling  # [n, h]

    def score(self, q: torch.Tensor, index_keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """q [n, h, d], index_keys [R, d] (one request's) or [n, R, d] (each query's own request's),
        weights [n, h] -> scores [n, R] (fp32)."""
        if self.batch_invariant:
            return index_scores(q, index_keys, weights, self.softmax_scale)  # [n, R]
        return self.kernels.indexer_scores(q, index_keys, weights, self.softmax_scale)  # [n, R]

    def forward(self, q: torch.Tensor, index_keys: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """q [n, h, d], index_keys [R, d], hidden [n, H] -> scores [n, R] (fp32)."""
        return self.score(q, index_keys, self.head_weights(hidden))  # [n, R]


class Indexer(WindowCompressor):
    """Lightning indexer with HF parameter names (kv_proj, gate_proj, position_bias, kv_norm,
    q_b_proj, scorer.weights_proj).

    Index keys come from ``compress_chunk`` (the inherited streaming CSA compressor); queries
    from the attention's low-rank query ``q_residual`` [n, q_lora_rank] and the layer input
    ``hidden`` [n, H].
    """

    def __init__(self, config):
        super().__init__(config, config.index_head_dim, config.compress_rates[CSA], overlap=True)
        self.num_heads = config.index_n_heads
        self.index_topk = config.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.scorer = IndexerScorer(config)

    def queries(self, q_residual: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Index queries [n, h, d] with the compressor's RoPE at each query position."""
        q = self.q_b_proj(q_residual).view(q_residual.shape[0], self.num_heads, self.head_dim)  # [n, h, d]
        return apply_interleaved_rope(q, positions, self.inv_freq, self.rope_scaling)  # [n, h, d]

    def scores(self, hidden, q_residual, positions, index_keys) -> torch.Tensor:
        """I(p, w) for every query and every row in index_keys [R, d]: [n, R], not yet masked."""
        return self.scorer(self.queries(q_residual, positions), index_keys, hidden)  # [n, R]

    def select(self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
               index_keys: torch.Tensor) -> torch.Tensor:
        """Top-k visible row ids [n, k] for queries at ``positions`` [n]; -1 pads.

        ``index_keys`` [R, d] are the request's index rows 0..R-1 (R may exceed what a query
        sees; invisible rows are masked, so the answer does not depend on R).
        """
        q, weights = self.queries(q_residual, positions), self.scorer.head_weights(hidden)  # [n, h, d], [n, h]
        return self.select_with(q, weights, positions, index_keys)  # [n, k]

    def select_with(self, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                    index_keys: torch.Tensor) -> torch.Tensor:
        """`select` with the queries [n, h, d] and head weights [n, h] already computed; index_keys
        [R, d], or [n, R, d] when the queries belong to different requests (rows past a query's
        visible count may hold anything: they are masked)."""
        scores = self.scorer.score(q, index_keys, weights)  # [n, R]
        picks = topk_visible_rows(scores, positions, self.index_topk, self.compress_rate)  # [n, k]
        return ascending_rows(picks) if self.batch_invariant else picks  # [n, k]


def ascending_rows(picks: torch.Tensor) -> torch.Tensor:
    """Row ids [n, k] (-1: none) sorted ascending, -1 last."""
    last = torch.iinfo(picks.dtype).max
    ordered = picks.masked_fill(picks < 0, last).sort(dim=-1).values  # [n, k]
    return ordered.masked_fill_(ordered == last, -1)
