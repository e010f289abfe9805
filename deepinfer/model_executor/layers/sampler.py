"""Sampler: one row of logits per request that needs a token -> one SampleResult per row.

The rows are described by a `SamplingMetadata` (request ids, parameters, token histories and the
tensors derived from them), which the worker builds; the sampler never sees the scheduler's plan.

Each stage runs batched over the rows that need it; Python loops run over rows, never over
the vocabulary:

    raw logits [N, V] --fp32--+--> logsumexp              (reported logprobs: the model's own
                              |                             distribution, before any processing)
                              +--> penalties (repetition over prompt + output,
                                   presence / frequency over output), then logit_bias and
                                   -inf bans for min_tokens / bad_words (`penalties`)
                                     +--> greedy rows: argmax (first max on ties)
                                     +--> random rows: / T -> exp -> top-k, top-p, min-p zero
                                          weights -> inverse CDF at u ~ U[0, 1), one per token
                                          (`token_draws`)

This module holds the `Sampler` (the stages' order, the random generators) and the reported
logprobs; the processing stages live in `penalties.py` and the drawing ones in `token_draws.py`.

Every stage stays on the logits' device (`Sampler.draw`); the host reads the tokens, logprobs,
ranks and top logprobs back once, together (`sampled_tokens.read_samples`). Off the CPU, for rows
without penalties, bias or bans, no stage asks the device a question on the way (no `.item()`, no
data-dependent loop): such a step's only wait for the device is that read.

Every sampled token of a random row consumes exactly one uniform from its request's own
generator (seeded requests) or from the engine generator (unseeded requests), in row order, so a
seeded request's uniforms do not depend on what else is in the batch. Greedy rows draw nothing.
Generators live on the CPU whatever the logits' device: one [n] tensor of uniforms is copied over.

Its tokens are another matter: with the batch-invariant mode off a seeded request repeats for the
same batch composition, but its logits and logprobs move in the last bits with the batch (the
model's matmuls; here a [1, V] sum is split across threads, a [17, V] one across rows), enough to
flip a draw now and then. With `batch_invariant=True` (the runner's resolved DEEPINFER_BATCH_INVARIANT:
on by default on the CPU) the two vocabulary sums (logsumexp, top-p mass) go through
`batch_invariant.row_sum`, and every stage depends on the row alone.

Fast paths share the general path's functions (same tokens, same draws): all-greedy without
penalties, bias or bans is one blocked argmax (`token_draws.row_max`), and rows without top-k /
top-p / min-p skip the filters. A banned (-inf) token gets weight exactly 0 (`drop_banned`), never
e^-80.

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
from deepinfer.model_executor.layers.logits_processors import drop_banned
from deepinfer.model_executor.layers.penalties import process_logits
from deepinfer.model_executor.layers.sampled_tokens import DrawnTokens, read_samples, top_lists
from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata, row_index
from deepinfer.model_executor.layers.token_draws import (
    exp_relative,
    filtered_weights,
    inverse_cdf,
    row_max,
    sum_rows,
    tempered_weights,
)


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
        greedy_index = row_index(metadata.greedy_rows, logits)  # [G]
        token_ids[greedy_index] = row_max(processed.index_select(0, greedy_index))[1]  # [G]
        random_index = row_index(metadata.random_rows, logits)  # [R]
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


def logsumexp(logits: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """log(sum(exp(logits))) per row [N], through `exp_relative` (fast for any logit range)."""
    best = logits.amax(dim=-1, keepdim=True)  # [N, 1]
    return sum_rows(exp_relative(logits, best), invariant).log_() + best[:, 0]  # [N]


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
    index = row_index(metadata.logprob_rows, logits)  # [n]
    values, ids = logits.index_select(0, index).topk(metadata.num_top_logprobs, dim=-1)  # [n, k], [n, k]
    return ids, values - lse.index_select(0, index)[:, None]  # [n, k], [n, k]


def token_ranks(logits: torch.Tensor, token_ids: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """[n] the 1-based rank of each row's token under `logits` (1 + how many tokens score strictly
    higher), for `rows` only (the rows that report logprobs; None when there are none).
    logits [N, V], token_ids [N]."""
    if not rows:
        return None
    index = row_index(rows, logits)  # [n]
    sub = logits.index_select(0, index)  # [n, V]
    chosen = sub.gather(1, token_ids.index_select(0, index)[:, None])  # [n, 1]
    return (sub > chosen).sum(dim=-1) + 1  # [n]
