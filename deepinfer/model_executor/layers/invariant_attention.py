"""The batch-invariant attention math (`DEEPINFER_BATCH_INVARIANT`, `batch_invariant.py`): each
query's result is the same bits whatever else shares its call, however its prompt was chunked.

The plain backend pads decode reads to the widest query of the batch and runs
prefill over [loaded | chunk] with a mask: different lengths and kernels for the same query.
Here every query reduces over its visible keys in blocks of `KEY_BLOCK` at absolute position
offsets (attention/invariant.py lays them out), from the block of its first visible key: per
(KV head, block) the query rows times the block's keys and the weights times its values as
`row_matmul`s (MKL bmm on rows padded to a multiple of 4: for these K = B or D columns a row's
bits then depend on neither the row count nor the row's place, so decode's own [G, B] blocks and
prefill's shared [n*G, B] ones agree), an exact max, `exp`, a sum over each B-element block,
and a pairwise sum over blocks, zero-padded to a power of two, in which padding blocks add exact
zeros. A chunk's own keys are taken as the cache will return them (fp8 / bf16 caches). On the
fused (CPU) kernel set the same rule runs in C++ for fp32 queries over plain rows
(invariant_cpu.cpp: per query and KV head, 16-lane dot products, the exact max, the polynomial
exp, 16-lane sums per 64-key block, blocks added in position order): its own bits, not these,
with the same invariance, tested against float64 attention.

DeepSeek-V4's sparse MLA (`latent_block_attention`: each query over its own latent rows, the sink
in the one softmax) and its lightning indexer's scores (`index_scores`) follow the same rule: per
(query, block of KEY_BLOCK rows) `row_matmul`s, an exact max, `exp`, per-block sums, pairwise sums
over blocks. The primitives (`row_matmul`, `pairwise_sum`, `pad_dim`) are `batch_invariant.py`'s.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.batch_invariant import pad_dim, pairwise_sum, row_matmul

KEY_BLOCK = 64  # keys per attention block
DECODE_PAIR_BUDGET = 1 << 15  # query x key pairs per decode sub-batch (each pair gathers one cache row)
PREFILL_PAIR_BUDGET = 1 << 20  # query x key pairs per prefill sub-batch (scores, expanded queries)


def block_softmax(scores: torch.Tensor, visible: torch.Tensor,
                  sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """scores [n, Hkv, nb, G, B] (fp32), visible [n, nb, B], sinks [Hkv * G] or None -> (weights
    exp(s - max) with 0 for hidden keys [n, Hkv, nb, G, B], their per-block sums [n, Hkv, nb, G],
    the sinks' weights exp(sink - max) [n, Hkv, G] or None). The max (over the visible scores and
    the sink) is exact in any order; each block sum runs over B elements."""
    hidden = ~visible[:, None, :, None, :]  # [n, 1, nb, 1, B]
    scores = scores.masked_fill(hidden, float("-inf"))
    best = scores.amax(dim=(2, 4), keepdim=True)  # [n, Hkv, 1, G, 1]
    sink_weights = None
    if sinks is not None:
        sink = sinks.float().view(1, scores.shape[1], 1, scores.shape[3], 1)  # [1, Hkv, 1, G, 1]
        best = torch.maximum(best, sink)
        sink_weights = (sink - best).exp()[:, :, 0, :, 0]  # [n, Hkv, G]
    weights = (scores - best).exp_()  # [n, Hkv, nb, G, B]
    return weights, weights.sum(dim=-1), sink_weights


def combine_blocks(partials: torch.Tensor, block_sums: torch.Tensor,
                   sink_weights: torch.Tensor | None = None) -> torch.Tensor:
    """partials [n, Hkv, nb, G, D] (weights @ values per block), block_sums [n, Hkv, nb, G], block 0
    being each query's first block, the sinks' weights [n, Hkv, G] (the denominator's first term) or
    None -> [n, Hkv * G, D]: pairwise trees over the blocks, divided."""
    denominator = pairwise_sum(block_sums, dim=2)  # [n, Hkv, G]
    if sink_weights is not None:
        denominator = sink_weights + denominator
    out = pairwise_sum(partials, dim=2) / denominator[..., None]  # [n, Hkv, G, D]
    return out.flatten(1, 2)  # [n, H, D]


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logit soft-capping, softcap * tanh(scores / softcap) (elementwise), or the scores as they are."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _heads(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q [n, H, D] -> [n, Hkv, G, D] in fp32 (query head h reads KV head h // G)."""
    n, num_heads, head_dim = q.shape
    return q.float().view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[..., L, Hkv, D] -> [..., Hkv, L / B, B, D] (fp32)."""
    *lead, length, num_kv_heads, head_dim = x.shape
    x = x.float().reshape(*lead, length // KEY_BLOCK, KEY_BLOCK, num_kv_heads, head_dim)
    return x.movedim(-2, len(lead))


def per_query_attention(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, scale: float,
                        softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode: each query over its own rows. q [n, H, D]; kv [n, L, 2, Hkv, D] (L a multiple of
    KEY_BLOCK, column 0 at a block boundary of absolute positions, the query's first visible key
    in block 0); visible [n, L]; the layer's soft-cap and sinks [H] (attention/layer.py) or None.
    -> [n, H, D] in q's dtype."""
    n, num_blocks, num_kv_heads = q.shape[0], kv.shape[1] // KEY_BLOCK, kv.shape[3]
    heads = _heads(q, num_kv_heads)  # [n, Hkv, G, D]
    keys, values = _blocks(kv[:, :, 0]), _blocks(kv[:, :, 1])  # [n, Hkv, nb, B, D] each
    queries = heads[:, :, None].expand(-1, -1, num_blocks, -1, -1)  # [n, Hkv, nb, G, D]
    scores = capped(row_matmul(queries, keys.transpose(-1, -2)) * scale, softcap)  # [n, Hkv, nb, G, B]
    weights, block_sums, sink_weights = block_softmax(scores, visible.view(n, num_blocks, KEY_BLOCK), sinks)
    partials = row_matmul(weights, values)  # [n, Hkv, nb, G, D]
    return combine_blocks(partials, block_sums, sink_weights).to(q.dtype)  # [n, H, D]


def shared_key_attention(q: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor, first_block: torch.Tensor,
                         scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill: every query of a chunk over one row set. q [n, H, D]; rows [L, 2, Hkv, D] (L a
    multiple of KEY_BLOCK, column 0 at a block boundary of absolute positions); visible [n, L];
    first_block [n] the block of each query's first visible key. The same bits as
    `per_query_attention` over the query's own rows (with the same soft-cap and sinks). -> [n, H, D]
    in q's dtype."""
    n, num_blocks, num_kv_heads = q.shape[0], rows.shape[0] // KEY_BLOCK, rows.shape[2]
    heads = _heads(q, num_kv_heads)  # [n, Hkv, G, D]
    group = heads.shape[2]
    keys, values = _blocks(rows[:, 0]), _blocks(rows[:, 1])  # [Hkv, nb, B, D] each
    queries = heads.permute(1, 0, 2, 3).reshape(num_kv_heads, 1, n * group, -1)  # [Hkv, 1, n*G, D]
    queries = queries.expand(-1, num_blocks, -1, -1)  # [Hkv, nb, n*G, D]
    scores = capped(row_matmul(queries, keys.transpose(-1, -2)) * scale, softcap)  # [Hkv, nb, n*G, B]
    scores = scores.view(num_kv_heads, num_blocks, n, group, KEY_BLOCK).permute(2, 0, 1, 3, 4)  # [n, Hkv, nb, G, B]
    weights, block_sums, sink_weights = block_softmax(scores, visible.view(n, num_blocks, KEY_BLOCK), sinks)
    weights = weights.permute(1, 2, 0, 3, 4).reshape(num_kv_heads, num_blocks, n * group, -1)  # [Hkv, nb, n*G, B]
    partials = row_matmul(weights, values).view(num_kv_heads, num_blocks, n, group, -1)  # [Hkv, nb, n, G, D]
    partials = partials.permute(2, 0, 1, 3, 4)  # [n, Hkv, nb, G, D]
    partials, block_sums = _from_first_block(partials, first_block), _from_first_block(block_sums, first_block)
    return combine_blocks(partials, block_sums, sink_weights).to(q.dtype)  # [n, H, D]


def _from_first_block(x: torch.Tensor, first_block: torch.Tensor) -> torch.Tensor:
    """x [n, Hkv, nb, ...] -> the same with each query's blocks shifted to start at its first block
    (blocks past the end: zero)."""
    if not bool(first_block.any()):
        return x
    num_blocks = x.shape[2]
    index = first_block[:, None] + torch.arange(num_blocks, device=x.device)  # [n, nb]
    inside = index < num_blocks  # [n, nb]
    rows = torch.arange(x.shape[0], device=x.device)[:, None]  # [n, 1]
    shifted = x.movedim(2, 1)[rows, index.clamp(max=num_blocks - 1)]  # [n, nb, Hkv, ...]
    shifted = torch.where(inside.view(*inside.shape, *([1] * (shifted.dim() - 2))), shifted, 0.0)
    return shifted.movedim(1, 2)  # [n, Hkv, nb, ...]


def latent_block_attention(q: torch.Tensor, parts, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """DeepSeek-V4: each query over its own K = V latent rows, one softmax over every part and a
    per-head sink logit (which adds no value). q [n, H, D]; parts: (rows [n, L, D], visible [n, L])
    with L a multiple of KEY_BLOCK and a part's blocks in a fixed order of their own (hidden columns
    anywhere, trailing all-hidden blocks add exact zeros); sink [H]. Per (query, block) the scores
    and the weights times the rows are `row_matmul`s of H rows; an exact max over all parts and the
    sink, `exp`, per-block sums, a pairwise sum over each part's blocks, the parts added in order.
    A query that sees nothing and has a sink of -inf gets zeros. -> [n, H, D] in q's dtype."""
    heads, num_queries = q.float(), q.shape[0]
    sink = sink.float()[None, :]  # [1, H]
    scored, best = [], sink.expand(num_queries, -1)  # [n, H]
    for rows, visible in parts:
        num_blocks = rows.shape[1] // KEY_BLOCK
        hidden = ~visible.view(num_queries, num_blocks, 1, KEY_BLOCK)  # [n, nb, 1, B]
        blocks = rows.float().masked_fill(~visible[..., None], 0.0).view(num_queries, num_blocks, KEY_BLOCK, -1)
        queries = heads[:, None].expand(-1, num_blocks, -1, -1)  # [n, nb, H, D]
        scores = (row_matmul(queries, blocks.transpose(-1, -2)) * scale).masked_fill_(hidden, float("-inf"))
        scored.append((blocks, scores))  # [n, nb, B, D], [n, nb, H, B]
        best = torch.maximum(best, scores.amax(dim=(1, 3)))  # [n, H]
    numerator = heads.new_zeros(heads.shape)  # [n, H, D]
    denominator = (sink - best).exp()  # [n, H]
    for blocks, scores in scored:
        weights = (scores - best[:, None, :, None]).exp_()  # [n, nb, H, B]
        numerator = numerator + pairwise_sum(row_matmul(weights, blocks), dim=1)  # [n, H, D]
        denominator = denominator + pairwise_sum(weights.sum(dim=-1), dim=1)  # [n, H]
    return (numerator / denominator[..., None]).nan_to_num_(0.0).to(q.dtype)  # [n, H, D]


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """DeepSeek-V4's lightning indexer, I(p, w) = sum_h w_h * ReLU(q_h . K_w) * scale, with each
    (query, row) the same bits whatever shares the call. q [n, h, d]; keys [n, R, d] (each query's
    own rows) or [R, d] (shared); weights [n, h]. Per (query, block of KEY_BLOCK rows) one
    `row_matmul` of h rows, then a pairwise sum over the heads. -> [n, R] fp32."""
    num_queries, width = q.shape[0], keys.shape[-2]
    out = q.new_empty(num_queries, width, dtype=torch.float32)  # [n, R]
    for sub in query_slices(num_queries, width, DECODE_PAIR_BUDGET):
        own = keys[sub] if keys.dim() == 3 else keys[None].expand(sub.stop - sub.start, -1, -1)  # [n', R, d]
        blocks = pad_dim(own.float(), 1, KEY_BLOCK)  # [n', R', d]
        blocks = blocks.view(blocks.shape[0], -1, KEY_BLOCK, blocks.shape[-1]).transpose(-1, -2)  # [n', nb, d, B]
        queries = q[sub].float()[:, None].expand(-1, blocks.shape[1], -1, -1)  # [n', nb, h, d]
        dots = row_matmul(queries, blocks).relu_().mul_(scale)  # [n', nb, h, B]
        dots = dots * weights[sub].float()[:, None, :, None]  # [n', nb, h, B]
        out[sub] = pairwise_sum(dots, dim=2).flatten(1)[:, :width]  # [n', R]
    return out


def padded_width(width: int) -> int:
    """`width` keys rounded up to whole blocks (at least one)."""
    return max(1, -(-width // KEY_BLOCK)) * KEY_BLOCK


def query_slices(num_queries: int, width: int, budget: int) -> list[slice]:
    """Query sub-batches of at most `budget` query x key pairs (at least one query each); every
    query's result is its own, so the split changes no bits."""
    step = max(1, budget // max(1, width))
    return [slice(start, min(start + step, num_queries)) for start in range(0, num_queries, step)]
