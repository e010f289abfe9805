"""Sampler: one row of logits per request that needs a token -> one SampleResult per row.

Each stage runs batched over the rows that need it; Python loops run over rows, never over
the vocabulary:

    raw logits [N, V] --fp32--+--> logsumexp               (reported logprobs: the model's own
                              |                              distribution, before any processing)
                              +--> penalties (repetition over prompt + output,
                                   presence / frequency over output)
                                     +--> greedy rows: argmax
                                     +--> random rows: / T -> top-k -> top-p -> min-p
                                          -> softmax p -> argmax(p / q), q ~ Exp(1) per token

`argmax(p / q)` with exponential noise is an exact draw from p (the exponential race). Every
sampled token of a random row consumes exactly one [V] noise vector from its request's own
generator (seeded requests) or from the engine generator (unseeded requests), so a seeded
request's tokens do not depend on what else is in the batch. Greedy rows draw nothing.

`SampleResult.logprob` is always filled (one batched logsumexp, cheap next to the argmax), also
when `SamplingParams.logprobs` is None. `top_logprobs` is None when logprobs is None, [] when it
is 0, and the top n (token id, logprob), best first, when it is n >= 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from deepinfer.engine.plan import SampleResult, ScheduledRequest
from deepinfer.sampling_params import SamplingParams

_MIN_NOISE = 1e-20  # floor for the exponential noise: p / 0 must never become nan or inf
_TOP_P_CANDIDATES = 256  # first window of best tokens searched for the top-p nucleus


class Sampler:
    """Picks the next token of each row; owns the random generators.

    Seeded requests each own a `torch.Generator` created on first use and advanced only by their
    own draws; unseeded requests share one engine generator seeded with `seed`. Call `release`
    for finished or aborted requests (not for preempted ones: their generator must continue).
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._engine_generators: dict[torch.device, torch.Generator] = {}
        self._request_generators: dict[str, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[ScheduledRequest]) -> list[SampleResult]:
        """logits [N, V] (any float dtype; computed in fp32), one row per entry of `rows`."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [N, V] with N = {len(rows)} rows, got {tuple(logits.shape)}")
        if not rows:
            return []
        params = [_params_of(row) for row in rows]
        logits = logits.float()  # [N, V]; the caller's tensor when already fp32: never written
        lse = torch.logsumexp(logits, dim=-1)  # [N]
        processed = _apply_penalties(logits, rows, params)  # [N, V]
        token_ids = self._choose(processed, rows, params)  # [N]
        token_logprobs = logits.gather(1, token_ids[:, None]).squeeze(1) - lse  # [N]
        top = _top_logprobs(logits, lse, params)
        return [SampleResult(token_id=t, logprob=lp, top_logprobs=top.get(i))
                for i, (t, lp) in enumerate(zip(token_ids.tolist(), token_logprobs.tolist(), strict=True))]

    def release(self, request_ids: Iterable[str]) -> None:
        """Drops the per-request state (generators) of finished or aborted requests."""
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)

    @property
    def num_request_generators(self) -> int:
        return len(self._request_generators)

    def _choose(self, logits: torch.Tensor, rows: Sequence[ScheduledRequest],
                params: list[SamplingParams]) -> torch.Tensor:
        """Greedy rows: argmax; random rows: a draw from the processed distribution. -> [N]."""
        random_idx = [i for i, p in enumerate(params) if not p.greedy]
        if not random_idx:
            return logits.argmax(dim=-1)  # [N]: the hot path, one batched op
        if len(random_idx) == len(rows):
            return self._sample(logits, rows, params)
        token_ids = logits.argmax(dim=-1)  # [N]; random rows overwritten below
        index = torch.tensor(random_idx, device=logits.device)  # [n]
        sampled = self._sample(logits.index_select(0, index), [rows[i] for i in random_idx],
                               [params[i] for i in random_idx])  # [n]
        return token_ids.index_copy_(0, index, sampled)

    def _sample(self, logits: torch.Tensor, rows: Sequence[ScheduledRequest],
                params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one exponential race per row. -> [n]."""
        temperature = _column(logits, [p.temperature for p in params])  # [n, 1]
        logits = logits / temperature  # [n, V]
        logits = _apply_top_k(logits, [p.top_k for p in params])  # [n, V]
        logits = _apply_top_p(logits, [p.top_p for p in params])  # [n, V]
        logits = _apply_min_p(logits, [p.min_p for p in params])  # [n, V]
        probs = logits.softmax(dim=-1)  # [n, V]
        noise = self._exponential_noise(rows, params, logits.shape, logits.device)  # [n, V]
        return probs.div_(noise).argmax(dim=-1)  # [n]

    def _exponential_noise(self, rows: Sequence[ScheduledRequest], params: list[SamplingParams],
                           shape: torch.Size, device: torch.device) -> torch.Tensor:
        """Exp(1) noise [n, V] as -log(U): one [V] draw per row from the generator that owns the
        row (uniform_ is several times faster than exponential_ on CPU)."""
        noise = torch.empty(shape, device=device)  # [n, V]
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        engine_generator = self._engine_generator(device) if unseeded else None
        if len(unseeded) == len(rows):
            noise.uniform_(generator=engine_generator)
        elif unseeded:
            noise[unseeded] = torch.empty(len(unseeded), shape[1], device=device).uniform_(
                generator=engine_generator)  # [u, V]
        for i, (row, p) in enumerate(zip(rows, params, strict=True)):
            if p.seed is not None:
                noise[i].uniform_(generator=self._request_generator(row.request_id, p.seed, device))
        return noise.log_().neg_().clamp_min_(_MIN_NOISE)  # [n, V]

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        generator = self._engine_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            self._engine_generators[device] = generator
        return generator

    def _request_generator(self, request_id: str, seed: int, device: torch.device) -> torch.Generator:
        generator = self._request_generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(seed)
            self._request_generators[request_id] = generator
        return generator


def _params_of(row: ScheduledRequest) -> SamplingParams:
    if row.sampling_params is None:
        raise ValueError(f"request {row.request_id!r} was given to the sampler without sampling_params")
    return row.sampling_params


def _column(like: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device)[:, None]  # [n, 1]


def _apply_penalties(logits: torch.Tensor, rows: Sequence[ScheduledRequest],
                     params: list[SamplingParams]) -> torch.Tensor:
    """Returns `logits` itself when no row asks for a penalty, else a penalized copy. [N, V].

    Repetition (HF / vLLM): over prompt + output tokens, positive logits are divided by the
    penalty and negative ones multiplied. Presence / frequency (OpenAI): over output tokens,
    subtract presence * [count > 0] + frequency * count.
    """
    penalized = [i for i, p in enumerate(params) if p.needs_penalties]
    if not penalized:
        return logits
    index = torch.tensor(penalized, device=logits.device)  # [n]
    sub = logits.index_select(0, index)  # [n, V]
    sub_rows = [rows[i] for i in penalized]
    sub_params = [params[i] for i in penalized]
    if any(p.repetition_penalty != 1.0 for p in sub_params):
        seen = _token_counts([r.prompt_token_ids + r.output_token_ids for r in sub_rows], sub) > 0
        penalty = _column(sub, [p.repetition_penalty for p in sub_params])  # [n, 1]
        repeated = torch.where(sub > 0, sub / penalty, sub * penalty)  # [n, V]
        sub = torch.where(seen, repeated, sub)  # [n, V]
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in sub_params):
        counts = _token_counts([r.output_token_ids for r in sub_rows], sub)  # [n, V]
        presence = _column(sub, [p.presence_penalty for p in sub_params])  # [n, 1]
        frequency = _column(sub, [p.frequency_penalty for p in sub_params])  # [n, 1]
        sub = sub - frequency * counts - presence * (counts > 0).float()  # [n, V]
    return logits.index_copy(0, index, sub)  # [N, V]


def _token_counts(token_lists: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """How often each vocabulary id occurs in each row's list. -> [n, V] fp32.

    Ids outside [0, V) (a tokenizer larger than the logits) are ignored.
    """
    num_rows, vocab_size = like.shape
    width = max(1, max(len(ids) for ids in token_lists))
    padded = [ids + [vocab_size] * (width - len(ids)) for ids in token_lists]
    ids = torch.tensor(padded, dtype=torch.long, device=like.device)  # [n, L]
    ids = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)  # [n, L]; V = discard column
    counts = torch.zeros(num_rows, vocab_size + 1, device=like.device)  # [n, V + 1]
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]  # [n, V]


def _rows_where(values: list, active) -> list[int]:
    return [i for i, v in enumerate(values) if active(v)]


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keeps each row's k largest logits (ties at the k-th value survive); k = 0 or >= V: off."""
    vocab_size = logits.shape[1]
    active = _rows_where(top_k, lambda k: 0 < k < vocab_size)
    if not active:
        return logits
    index = torch.tensor(active, device=logits.device)  # [n]
    sub = logits.index_select(0, index)  # [n, V]
    ks = torch.tensor([top_k[i] for i in active], device=logits.device)  # [n]
    values = sub.topk(int(ks.max()), dim=-1).values  # [n, k_max], descending
    threshold = values.gather(1, (ks - 1)[:, None])  # [n, 1]
    sub = sub.masked_fill(sub < threshold, float("-inf"))  # [n, V]
    return logits.index_copy(0, index, sub)  # [N, V]


def _apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keeps the smallest best-first set of tokens whose mass reaches p (always at least the best
    token; tokens tied with the last kept one also stay)."""
    active = _rows_where(top_p, lambda p: p < 1.0)
    if not active:
        return logits
    index = torch.tensor(active, device=logits.device)  # [n]
    sub = logits.index_select(0, index)  # [n, V]
    probs = sub.softmax(dim=-1)  # [n, V]
    threshold = _top_p_threshold(probs, _column(sub, [top_p[i] for i in active]))  # [n, 1]
    sub = sub.masked_fill(probs < threshold, float("-inf"))  # [n, V]
    return logits.index_copy(0, index, sub)  # [N, V]


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [n, V], top_p [n, 1] -> [n, 1]: the probability of each row's last kept token.

    A full sort of the vocabulary is slow, and the nucleus is usually small: look at the best
    `_TOP_P_CANDIDATES` tokens and widen (x8) only for rows whose candidates hold less than p.
    Which width resolves a row depends on that row alone, so results do not depend on the batch.
    """
    num_rows, vocab_size = probs.shape
    threshold = torch.empty(num_rows, 1, device=probs.device)  # [n, 1]
    pending = torch.arange(num_rows, device=probs.device)  # [m]
    width = min(_TOP_P_CANDIDATES, vocab_size)
    while pending.numel():
        values = probs.index_select(0, pending).topk(width, dim=-1).values  # [m, w], best first
        cumulative = values.cumsum(dim=-1)  # [m, w]
        row_top_p = top_p.index_select(0, pending)  # [m, 1]
        num_keep = ((cumulative - values) < row_top_p).sum(dim=-1, keepdim=True)  # [m, 1], >= 1
        if width == vocab_size:
            done = torch.ones(pending.numel(), dtype=torch.bool, device=probs.device)  # [m]
        else:
            done = cumulative[:, -1] >= row_top_p[:, 0]  # [m]: the nucleus ends inside the window
        threshold[pending[done]] = values.gather(1, num_keep - 1)[done]  # [d, 1]
        pending = pending[~done]  # [m']
        width = min(width * 8, vocab_size)
    return threshold


def _apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drops tokens with p < min_p * p_max (in log space: logit < max_logit + log(min_p))."""
    active = _rows_where(min_p, lambda p: p > 0.0)
    if not active:
        return logits
    index = torch.tensor(active, device=logits.device)  # [n]
    sub = logits.index_select(0, index)  # [n, V]
    log_min_p = _column(sub, [min_p[i] for i in active]).log()  # [n, 1]
    threshold = sub.max(dim=-1, keepdim=True).values + log_min_p  # [n, 1]
    sub = sub.masked_fill(sub < threshold, float("-inf"))  # [n, V]
    return logits.index_copy(0, index, sub)  # [N, V]


def _top_logprobs(logits: torch.Tensor, lse: torch.Tensor,
                  params: list[SamplingParams]) -> dict[int, list[tuple[int, float]]]:
    """Row index -> the row's top-n (token id, raw logprob), best first, for rows with logprobs set
    (an empty list for logprobs = 0)."""
    active = [i for i, p in enumerate(params) if p.logprobs is not None]
    num_top = max((params[i].logprobs for i in active), default=0)
    if num_top == 0:
        return {i: [] for i in active}
    index = torch.tensor(active, device=logits.device)  # [n]
    values, ids = logits.index_select(0, index).topk(num_top, dim=-1)  # [n, k], [n, k]
    values = values - lse.index_select(0, index)[:, None]  # [n, k]
    top: dict[int, list[tuple[int, float]]] = {}
    for row, row_ids, row_values in zip(active, ids.tolist(), values.tolist(), strict=True):
        n = params[row].logprobs
        top[row] = list(zip(row_ids[:n], row_values[:n], strict=True))
    return top
