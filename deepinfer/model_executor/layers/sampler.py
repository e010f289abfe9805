"""Sampler: one row of logits per request that needs a token -> one SampleResult per row.

The rows are described by a `SamplingMetadata` (request ids, parameters, token histories and the
tensors derived from them), which the worker builds; the sampler never sees the scheduler's plan.

Each stage runs batched over the rows that need it; Python loops run over rows, never over
the vocabulary:

    raw logits [N, V] --fp32--+--> logsumexp              (reported logprobs: the model's own
                              |                             distribution, before any processing)
                              +--> penalties (repetition over prompt + output,
                                   presence / frequency over output), then logit_bias and
                                   -inf bans for min_tokens / bad_words (`logits_processors`)
                                     +--> greedy rows: argmax (first max on ties)
                                     +--> random rows: / T -> exp -> top-k, top-p, min-p zero
                                          weights -> inverse CDF at u ~ U[0, 1), one per token

Every stage stays on the logits' device (`Sampler.draw`); the host reads the tokens, logprobs,
ranks and top logprobs back once, together (`sampled_tokens.read_samples`). Off the CPU, for rows
without penalties, bias or bans, no stage asks the device a question on the way (no `.item()`, no
data-dependent loop): such a step's only wait for the device is that read.

Every sampled token of a random row consumes exactly one uniform from its request's own
generator (seeded requests) or from the engine generator (unseeded requests), in row order, so a
seeded request's uniforms do not depend on what else is in the batch. Greedy rows draw nothing.
Generators live on the CPU whatever the logits' device: one [n] tensor of uniforms is copied over.

Its tokens are another matter: without DEEPINFER_BATCH_INVARIANT a seeded request repeats for the
same batch composition, but its logits and logprobs move in the last bits with the batch (the
model's matmuls; here a [1, V] sum is split across threads, a [17, V] one across rows), enough to
flip a draw now and then. With `batch_invariant=True` the two vocabulary sums (logsumexp, top-p
mass) go through `batch_invariant.row_sum`, and every stage depends on the row alone.

Fast paths share the general path's functions (same tokens, same draws): all-greedy without
penalties, bias or bans is one blocked argmax (`row_max`), and rows without top-k / top-p / min-p
skip the filters. A banned (-inf) token gets weight exactly 0 (`drop_banned`), never e^-80.

`SampleResult.logprob` is always filled (one batched logsumexp: the fast path's main cost), also
when `SamplingParams.logprobs` is None. `top_logprobs` is None when logprobs is None, [] when it
is 0, and the top n (token id, logprob), best first, when it is n >= 1; `rank` (the sampled
token's 1-based rank under the raw logits: 1 + the tokens scoring strictly higher) is set
whenever logprobs is not None.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from deepinfer.contracts.plan import SampleResult
from deepinfer.model_executor.layers.batch_invariant import row_sum
from deepinfer.model_executor.layers.logits_processors import apply_logits_processors, drop_banned
from deepinfer.model_executor.layers.sampled_tokens import DrawnTokens, read_samples, top_lists
from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata, device_tensor, fp32_column

_NUCLEUS_WIDTH = 256  # first window of best tokens searched for the top-k / top-p cut
_CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF
_ARGMAX_BLOCK = 256  # tokens per block of the two-pass argmax (row_max)
_MIN_LOG_WEIGHT = -80.0  # exponent floor: e^-80 is still a normal fp32 (no slow denormals)


@dataclass
class GeneratorStates:
    """Saved generator states: the engine generator's, and each request's own (None: it had none)."""

    engine_state: torch.Tensor
    request_states: dict[str, torch.Tensor | None]


class Sampler:
    """Picks the next token of each row; owns the random generators.

    Seeded requests each own a `torch.Generator` created on first use and advanced only by their
    own draws; unseeded requests share one engine generator seeded with `seed`. Call `release`
    for finished or aborted requests (not for preempted ones: their generator must continue).
    `batch_invariant`: sum over the vocabulary in fixed blocks (bit-identical rows in any batch).
    """

    def __init__(self, seed: int = 0, batch_invariant: bool = False):
        self.seed = seed
        self.batch_invariant = batch_invariant
        self._engine_generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> list[SampleResult]:
        """logits [N, V] (any float dtype; computed in fp32), one row per row of `metadata`,
        whose tensors are on the logits' device -> one SampleResult per row, read back from the
        device at once (`draw`, then `read_samples`).

        The caller's tensor is never written.
        """
        drawn = self.draw(logits, metadata)
        return read_samples(drawn, metadata) if metadata.num_rows else []

    def draw(self, logits: torch.Tensor, metadata: SamplingMetadata) -> DrawnTokens:
        """`__call__` without the read: the tokens, logprobs, ranks and top logprobs stay on the
        logits' device. Rows without penalties, logit_bias or bans (greedy, or temperature with
        top-k / top-p / min-p, seeded or not) never make the host wait for the device."""
        if logits.dim() != 2 or logits.shape[0] != metadata.num_rows:
            raise ValueError(f"logits must be [N, V] with N = {metadata.num_rows} rows, got {tuple(logits.shape)}")
        logits = logits.float()  # [N, V]; the caller's tensor when already fp32
        lse = logsumexp(logits, self.batch_invariant)  # [N]
        if metadata.all_greedy and not metadata.penalty_rows and not metadata.processor_rows:  # fast path
            best, token_ids = row_max(logits)  # [N], [N]
            token_logprobs = best - lse  # [N]: the chosen token's logit is the row's max
        else:
            token_ids = self._choose(logits, metadata)  # [N]
            token_logprobs = logits.gather(1, token_ids[:, None]).squeeze(1) - lse  # [N]
        top_ids, top_values = top_logprob_tensors(logits, lse, metadata)  # [n, k] each, or None
        ranks = token_ranks(logits, token_ids, metadata.logprob_rows)  # [n] or None
        return DrawnTokens(token_ids, token_logprobs, ranks, top_ids, top_values)

    def release(self, request_ids: Iterable[str]) -> None:
        """Drops the per-request state (generators) of finished or aborted requests."""
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)

    @property
    def num_request_generators(self) -> int:
        return len(self._request_generators)

    def save_generators(self, request_ids: Iterable[str]) -> GeneratorStates:
        """The generator states a batch of these requests starts from (for a retry)."""
        states = {rid: g.get_state() if (g := self._request_generators.get(rid)) is not None else None
                  for rid in request_ids}
        return GeneratorStates(self._engine_generator.get_state(), states)

    def restore_generators(self, saved: GeneratorStates) -> None:
        """Rewind to `saved`: a retried row draws what it would have drawn; a generator the
        failed attempt created is dropped, to be created again from its seed."""
        self._engine_generator.set_state(saved.engine_state)
        for request_id, state in saved.request_states.items():
            if state is None:
                self._request_generators.pop(request_id, None)
            else:
                self._request_generators[request_id].set_state(state)

    def _choose(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [N, V] -> [N]: greedy rows their argmax (first max on ties), random rows a draw
        from the processed distribution (penalties first, when a row has any)."""
        processed = process_logits(logits, metadata)  # [N, V]; `logits` itself without processing
        if metadata.all_greedy:
            return row_max(processed)[1]  # [N]
        if metadata.all_random:
            return self._sample(processed, metadata)  # [N]
        token_ids = torch.empty(metadata.num_rows, dtype=torch.long, device=logits.device)  # [N]
        greedy_index = _index(metadata.greedy_rows, logits)  # [G]
        token_ids[greedy_index] = row_max(processed.index_select(0, greedy_index))[1]  # [G]
        random_index = _index(metadata.random_rows, logits)  # [R]
        token_ids[random_index] = self._sample(processed.index_select(0, random_index), metadata)  # [R]
        return token_ids

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [R, V] of the random rows: temperature, top-k / top-p, min-p (skipped when no
        row filters: it would mask nothing), then the inverse CDF at one uniform per row. -> [R]."""
        if metadata.any_filter:
            weights = filtered_weights(logits, metadata, self.batch_invariant)  # [R, V]
        else:
            weights = drop_banned(tempered_weights(logits, metadata.temperature)[0], logits, metadata)  # [R, V]
        uniforms = self._uniforms(metadata).to(weights.device, non_blocking=True)  # [R] float64
        return inverse_cdf(weights, uniforms)  # [R]

    def uniform(self, request_id: str, seed: int | None) -> float:
        """One U[0, 1) draw for one request: from its own generator when it has a seed (created
        on first use), else from the engine generator."""
        generator = self._engine_generator if seed is None else self._generator(request_id, seed)
        return torch.empty(1, dtype=torch.float64).uniform_(generator=generator).item()

    def _uniforms(self, metadata: SamplingMetadata) -> torch.Tensor:
        """One U[0, 1) float64 per random row, from the row's own generator or the engine's. -> [R] (CPU)."""
        uniforms = torch.empty(len(metadata.random_rows), dtype=torch.float64)  # [R]
        unseeded = metadata.unseeded_draws
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64,
                                            generator=self._engine_generator)  # [u]
        for j in metadata.seeded_draws:  # one draw from each seeded row's own generator
            uniforms[j:j + 1].uniform_(generator=self._request_generator(metadata, metadata.random_rows[j]))  # [1]
        return uniforms

    def _request_generator(self, metadata: SamplingMetadata, row: int) -> torch.Generator:
        """The generator of the (seeded) request of logits row `row`, created on first use."""
        return self._generator(metadata.request_ids[row], metadata.params[row].seed)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        generator = self._request_generators.get(request_id)
        if generator is None:
            generator = torch.Generator().manual_seed(seed)
            self._request_generators[request_id] = generator
        return generator


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
    return _exp_relative(scaled, best), scaled, best  # [R, V]


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


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return device_tensor(rows, torch.long, like.device)  # [n]


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Penalties, then logit_bias, min_tokens and bad_words (`logits_processors`). [N, V]:
    `logits` itself when no row asks for any, else a processed copy."""
    penalized = apply_penalties(logits, metadata)  # [N, V]
    return apply_logits_processors(penalized, metadata, owned=penalized is not logits)  # [N, V]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Returns `logits` itself when no row asks for a penalty, else a penalized copy. [N, V].

    Repetition (HF / vLLM): over prompt + output tokens, positive logits are divided by the
    penalty and negative ones multiplied. Presence / frequency (OpenAI): over output tokens,
    subtract presence * [count > 0] + frequency * count. Only the history's entries are touched
    (gather / scatter over [P, L] ids), never the whole vocabulary.
    """
    rows = metadata.penalty_rows
    if not rows:
        return logits
    sub, index = _subset(logits, rows)
    sub = sub.clone() if index is None else sub  # [P, V], ours to write
    if metadata.repetition_penalty is not None:
        ids, valid = _history_ids([metadata.prompt_token_ids[i] + metadata.output_token_ids[i]
                                   for i in rows], sub)  # [P, L], [P, L]
        penalty = torch.where(valid[:, :1] > 0, metadata.repetition_penalty, 1.0)  # [P, 1]; 1: empty history
        seen = sub.gather(1, ids)  # [P, L]
        sub.scatter_(1, ids, torch.where(seen > 0, seen / penalty, seen * penalty))  # [P, V]
    if metadata.frequency_penalty is not None:
        ids, valid = _history_ids([metadata.output_token_ids[i] for i in rows], sub)  # [P, L]
        sub.scatter_add_(1, ids, -metadata.frequency_penalty * valid)  # once per occurrence (padding adds 0)
        presence = metadata.presence_penalty  # [P, 1]
        sub.scatter_(1, ids, sub.gather(1, ids) - presence * valid[:, :1])  # once per distinct id
    return sub if index is None else logits.index_copy(0, index, sub)  # [N, V]


def _history_ids(token_lists: list[list[int]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids padded to one length -> (ids [n, L] long, valid [n, L] fp32 0 / 1).

    Padding repeats the row's last id, so every entry of a non-empty row names a token of its
    history and a scatter of per-token values writes equal values for duplicates. An empty row
    has one entry, id 0 with valid 0, and the callers leave it unchanged (factor 1 or 0 added).
    Ids outside [0, V) (a tokenizer larger than the logits) are dropped.
    """
    vocab_size = like.shape[1]
    width = max(1, max(len(ids) for ids in token_lists))
    padded = [ids + [ids[-1] if ids else 0] * (width - len(ids)) for ids in token_lists]
    ids = torch.tensor(padded, dtype=torch.long, device=like.device)  # [n, L]
    if bool(((ids < 0) | (ids >= vocab_size)).any()):
        return _history_ids([[t for t in row if 0 <= t < vocab_size] for row in token_lists], like)
    lengths = torch.tensor([len(row) for row in token_lists], device=like.device)  # [n]
    valid = torch.arange(width, device=like.device) < lengths[:, None]  # [n, L]
    return ids, valid.float()


def _subset(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows a step applies to: the tensor itself when all rows, else a copy + its index."""
    if len(rows) == logits.shape[0]:
        return logits, None
    index = _index(rows, logits)  # [n]
    return logits.index_select(0, index), index  # [n, V]


def _exp_relative(logits: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """exp(logits - best) [n, V], with exponents floored at `_MIN_LOG_WEIGHT`.

    exp of very negative or -inf inputs (denormal or zero results) runs 10-100x slower on CPU; a
    floored token keeps a weight of e^-80 instead of less, which no fp32 sum can notice.
    """
    return (logits - best).clamp_min_(_MIN_LOG_WEIGHT).exp_()  # [n, V]


def _sum_rows(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """x [n, V] -> [n]: torch's sum, or the batch-invariant blocked one."""
    return row_sum(x) if invariant else x.sum(dim=-1)


def logsumexp(logits: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """log(sum(exp(logits))) per row [N], through `_exp_relative` (fast for any logit range)."""
    best = logits.amax(dim=-1, keepdim=True)  # [N, 1]
    return _sum_rows(_exp_relative(logits, best), invariant).log_() + best[:, 0]  # [N]


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
    sub_logits, index = _subset(logits, rows)  # [r, V]
    sub_weights, _ = _subset(weights, rows)  # [r, V]
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
    row_mass = _sum_rows(weights, invariant)[:, None]  # [n, 1]: for rows without top-k
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


def top_logprobs(logits: torch.Tensor, lse: torch.Tensor,
                 metadata: SamplingMetadata) -> dict[int, list[tuple[int, float]]]:
    """Row -> its top-n (token id, raw logprob), best first, for rows with logprobs set
    (an empty list for logprobs = 0)."""
    ids, values = top_logprob_tensors(logits, lse, metadata)
    if ids is None:
        return {i: [] for i in metadata.logprob_rows}
    return top_lists(metadata, ids.tolist(), values.tolist())


def top_logprob_tensors(logits: torch.Tensor, lse: torch.Tensor,
                        metadata: SamplingMetadata) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(ids [n, k], raw logprobs [n, k]) of the k = `num_top_logprobs` best tokens of each row of
    `logprob_rows`, best first, on the logits' device; (None, None) when k = 0."""
    if metadata.num_top_logprobs == 0:
        return None, None
    index = _index(metadata.logprob_rows, logits)  # [n]
    values, ids = logits.index_select(0, index).topk(metadata.num_top_logprobs, dim=-1)  # [n, k], [n, k]
    return ids, values - lse.index_select(0, index)[:, None]  # [n, k], [n, k]


def token_ranks(logits: torch.Tensor, token_ids: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """[n] the 1-based rank of each row's token under `logits` (1 + how many tokens score strictly
    higher), for `rows` only (the rows that report logprobs; None when there are none).
    logits [N, V], token_ids [N]."""
    if not rows:
        return None
    index = _index(rows, logits)  # [n]
    sub = logits.index_select(0, index)  # [n, V]
    chosen = sub.gather(1, token_ids.index_select(0, index)[:, None])  # [n, 1]
    return (sub > chosen).sum(dim=-1) + 1  # [n]
