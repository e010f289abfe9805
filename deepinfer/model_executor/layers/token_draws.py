"""Drawing one token per row from processed logits: the greedy pick, and the random rows' weights
and their draw.

    processed logits [N, V] --> greedy rows: `row_max` (first max on ties)
                            --> random rows: / T -> exp (`tempered_weights`) -> top-k, top-p, min-p
                                zero weights (`filtered_weights`) -> `inverse_cdf` at one uniform
                                per row, float64

Filters never write -inf into the logits: each gives a per-row logit threshold and the weights of
dropped tokens are zeroed once. Exponents are floored at `_MIN_LOG_WEIGHT` (`exp_relative`), so
a banned (-inf) token gets its weight of exactly 0 from `logits_processors.drop_banned`.

Off the CPU the sampler's calls here never make the host wait for the device
(`host_reads_are_free` says where a read is free): the top-k / top-p search decides every row in
one window pass, and the inverse CDF's guard against a zero-weight token is a `torch.where`.
With `invariant=True` the top-p mass is summed in fixed blocks (`sum_rows`:
`batch_invariant.row_sum`), so a row's draw depends on that row alone.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.layers.batch_invariant import row_sum
from deepinfer.model_executor.layers.logits_processors import drop_banned
from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata, device_tensor, fp32_column, row_subset

_NUCLEUS_WIDTH = 256  # first window of best tokens searched for the top-k / top-p cut
_CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF
_ARGMAX_BLOCK = 256  # tokens per block of the two-pass argmax (row_max)
_MIN_LOG_WEIGHT = -80.0  # exponent floor: e^-80 is still a normal fp32 (no slow denormals)


def filtered_weights(logits: torch.Tensor, metadata: SamplingMetadata, invariant: bool = False) -> torch.Tensor:
    """logits [R, V] of the random rows (in `metadata.random_rows` order) -> their sampling
    weights [R, V]: softmax at the row's temperature up to a per-row factor, with the tokens
    top-k, top-p and min-p drop set to 0.

    Filters do not write -inf into the logits: each gives a per-row logit threshold (drop below
    it) and the weights of dropped tokens are zeroed once (exp of -inf is slow on CPU).
    """
    weights, scaled, best = tempered_weights(logits, metadata.temperature)  # [R, V], [R, V], [R, 1]
    threshold = torch.maximum(
        _top_k_top_p_threshold(scaled, weights, metadata.top_k, metadata.top_p, invariant),
        best + metadata.min_p.log())  # [R, 1]; min-p 0: -inf
    if metadata.any_filter:
        weights.masked_fill_(scaled < threshold, 0.0)  # [R, V]; a no-op for a -inf threshold
    return drop_banned(weights, scaled, metadata)


def tempered_weights(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """logits [R, V], temperature [R, 1] -> (weights [R, V]: softmax at the temperature up to a
    per-row factor, the scaled logits [R, V], their row max [R, 1])."""
    scaled = logits / temperature  # [R, V]
    best = scaled.amax(dim=-1, keepdim=True)  # [R, 1]
    return exp_relative(scaled, best), scaled, best  # [R, V]


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> `logits.max(dim=-1)` (first index on ties, NaN wins), in two cheap passes:
    torch's max-with-index is a scalar loop on CPU (1.2 ms for [32, 49152]), amax is vectorized
    (0.05 ms). Block maxima, the first block holding the row's max, max-with-index inside it:

        row | b0 | b1 | b2 | ... | tail |   index = block * _ARGMAX_BLOCK + inner; a tail wins if greater
    """
    num_rows, vocab_size = logits.shape
    num_blocks = vocab_size // _ARGMAX_BLOCK
    if num_blocks < 2:
        return logits.max(dim=-1)
    head = logits[:, :num_blocks * _ARGMAX_BLOCK].unflatten(1, (num_blocks, _ARGMAX_BLOCK))  # [N, B, C]
    block_max = head.amax(dim=-1)  # [N, B]
    best = block_max.amax(dim=-1, keepdim=True)  # [N, 1]
    holds = (block_max == best) | block_max.isnan()  # [N, B]: NaN wins, as in torch.max
    block = holds.to(torch.uint8).argmax(dim=-1)  # [N]: the first such block
    values, inner = head[torch.arange(num_rows, device=logits.device), block].max(dim=-1)  # [N], [N]
    index = block * _ARGMAX_BLOCK + inner  # [N]
    if vocab_size == num_blocks * _ARGMAX_BLOCK:
        return values, index
    tail_values, tail_index = logits[:, num_blocks * _ARGMAX_BLOCK:].max(dim=-1)  # [N], [N]
    tail = (tail_values > values) | (tail_values.isnan() & ~values.isnan())  # [N]: strictly later wins
    return torch.where(tail, tail_values, values), torch.where(tail, tail_index + num_blocks * _ARGMAX_BLOCK, index)


def host_reads_are_free(t: torch.Tensor) -> bool:
    """Whether the host may read a value of `t` at no cost (a CPU tensor); elsewhere it would wait
    for the device, so the sampler's device paths never do."""
    return t.device.type == "cpu"


def exp_relative(logits: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """exp(logits - best) [n, V], with exponents floored at `_MIN_LOG_WEIGHT`.

    exp of very negative or -inf inputs (denormal or zero results) runs 10-100x slower on CPU; a
    floored token keeps a weight of e^-80 instead of less, which no fp32 sum can notice.
    """
    return (logits - best).clamp_min_(_MIN_LOG_WEIGHT).exp_()  # [n, V]


def sum_rows(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """x [n, V] -> [n]: torch's sum, or the batch-invariant blocked one."""
    return row_sum(x) if invariant else x.sum(dim=-1)


def _top_k_top_p_threshold(logits: torch.Tensor, weights: torch.Tensor, top_k: list[int],
                           top_p: list[float], invariant: bool = False) -> torch.Tensor:
    """Per row, the logit below which top-k (k = 0 or >= V: off) and then top-p (p = 1: off)
    drop tokens; -inf for rows without either. -> [n, 1].

    Top-k keeps the k best tokens, top-p the smallest best-first set of those whose renormalized
    mass reaches p. At least the best token stays; tokens tied with the last kept one stay too.
    """
    num_rows, vocab_size = logits.shape
    threshold = torch.full((num_rows, 1), float("-inf"), device=logits.device)  # [n, 1]
    rows = [i for i in range(num_rows) if 0 < top_k[i] < vocab_size or top_p[i] < 1.0]
    if not rows:
        return threshold
    sub_logits, index = row_subset(logits, rows)  # [r, V]
    sub_weights, _ = row_subset(weights, rows)  # [r, V]
    ks = [top_k[i] if 0 < top_k[i] < vocab_size else vocab_size for i in rows]
    ps = fp32_column([top_p[i] for i in rows], logits.device)  # [r, 1]
    found = _nucleus_threshold(sub_logits, sub_weights, device_tensor(ks, torch.long, logits.device)[:, None], ps,
                               invariant, max(ks))  # [r, 1]
    return found if index is None else threshold.index_copy_(0, index, found)  # [n, 1]


def _nucleus_threshold(logits: torch.Tensor, weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       invariant: bool = False, max_k: int | None = None, one_pass: bool | None = None) -> torch.Tensor:
    """logits, weights [n, V]; top_k [n, 1] (V: off), top_p [n, 1] -> [n, 1]: last kept logit.
    `max_k`: top_k's largest value, when the caller knows it on the host; `one_pass`: decide every
    row in one window (default: off the CPU).

    Sorting the vocabulary is slow and the kept set is usually small: search the best
    `_NUCLEUS_WIDTH` tokens (or the largest k, when smaller) first and widen (x8) only for rows
    not decided inside the window. Masses are prefix sums of the row's own weights, so a row's
    answer depends on that row alone, never on the window width or on the rest of the batch.
    Which rows are decided is known only on the device: off the CPU, where asking would make the
    host wait, one pass over a window every row fits in (the largest k, else the vocabulary) decides all.
    """
    num_rows, vocab_size = logits.shape
    row_mass = sum_rows(weights, invariant)[:, None]  # [n, 1]: for rows without top-k
    max_k = int(top_k.max()) if max_k is None else max_k
    width = min(max_k, _NUCLEUS_WIDTH, vocab_size)  # all rows top-k <= 256: max k
    if one_pass is None:
        one_pass = not host_reads_are_free(logits)
    if one_pass:
        width = width if max_k <= width else vocab_size
        return _window_pass(logits, weights, top_k, top_p, row_mass, width)[0]  # [n, 1]
    threshold = torch.empty(num_rows, 1, device=logits.device)  # [n, 1]
    pending = torch.arange(num_rows, device=logits.device)  # [m]
    while pending.numel():
        everyone = pending.numel() == num_rows
        found, done = _window_pass(*(t if everyone else t.index_select(0, pending)
                                     for t in (logits, weights, top_k, top_p, row_mass)), width)  # [m, 1], [m]
        threshold[pending[done]] = found[done]  # [d, 1]
        pending = pending[~done]  # [m']
        width = min(width * 8, vocab_size)
    return threshold


def _window_pass(logits: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
                 row_mass: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One search over the best `width` tokens of rows logits, weights [m, V] (k, p, row_mass
    [m, 1]) -> (last kept logit [m, 1], which rows the window decides [m])."""
    vocab_size = logits.shape[1]
    values, ids = logits.topk(width, dim=-1)  # [m, w], [m, w]
    in_top_k = torch.arange(width, device=logits.device) < k  # [m, w]
    mass = weights.gather(1, ids).masked_fill_(~in_top_k, 0.0)  # [m, w], best first
    cumulative = mass.cumsum(dim=-1)  # [m, w]
    k_inside = k <= width  # [m, 1]: the top-k cut lies in the window
    total = torch.where(k_inside, cumulative.gather(1, (k - 1).clamp_max(width - 1)), row_mass)  # [m, 1]
    keep = in_top_k & ((cumulative - mass < p * total) | (p >= 1.0))  # [m, w]
    done = k_inside | ((k >= vocab_size) & (cumulative[:, -1:] >= p * total))  # [m, 1]
    num_keep = keep.sum(dim=-1, keepdim=True).clamp_min_(1)  # [m, 1]
    return values.gather(1, num_keep - 1), done[:, 0] | (width == vocab_size)  # [m, 1], [m]


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [n, V] (unnormalized weights >= 0; 0 for filtered tokens), uniforms [n] float64 in
    [0, 1) -> token ids [n].

    Two short scans instead of one long one: pick a block of `_CDF_BLOCK` tokens by its mass, then
    the token inside it (float64 prefix sums). `searchsorted(right=True)` returns the first entry
    whose prefix sum exceeds the target, so a zero-mass block or token is never picked.
    """
    num_rows, vocab_size = probs.shape
    padding = (-vocab_size) % _CDF_BLOCK
    padded = torch.nn.functional.pad(probs, (0, padding)) if padding else probs  # [n, V']
    blocks = padded.view(num_rows, -1, _CDF_BLOCK)  # [n, B, C]
    block_mass = blocks.sum(dim=-1).double()  # [n, B]
    block_cdf = block_mass.cumsum(dim=-1)  # [n, B]
    target = uniforms[:, None] * block_cdf[:, -1:]  # [n, 1]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_max_(blocks.shape[1] - 1)  # [n, 1]
    start = block_cdf.gather(1, block) - block_mass.gather(1, block)  # [n, 1]
    fraction = ((target - start) / block_mass.gather(1, block)).clamp_(0.0, 1.0)  # [n, 1]
    rows = torch.arange(num_rows, device=probs.device)  # [n]
    inner_cdf = blocks[rows, block[:, 0]].double().cumsum(dim=-1)  # [n, C]
    inner = torch.searchsorted(inner_cdf, fraction * inner_cdf[:, -1:], right=True)  # [n, 1]
    token_ids = (block * _CDF_BLOCK + inner.clamp_max_(_CDF_BLOCK - 1))[:, 0]  # [n]
    return _never_filtered(probs, token_ids)


def _never_filtered(probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Rounding at a block edge (odds ~1e-16) could land on a p = 0 token: take the best instead."""
    zero = probs.gather(1, token_ids[:, None])[:, 0] == 0  # [n]
    if host_reads_are_free(probs) and not bool(zero.any()):  # skip the argmax; off the CPU, never wait to ask
        return token_ids
    return torch.where(zero, probs.argmax(dim=-1), token_ids)  # [n]
