"""Verification of drafts: which of a request's k drafts the target model accepts, and its next token.

A verification step scores k + 1 positions of one request: row i holds the target's logits after
the last sampled token and drafts 1..i. Row i's target distribution p_i is the request's own
sampling distribution (penalties, logit_bias, min_tokens and bad_words over the outputs *including
drafts 1..i*, temperature, top-k, top-p, min-p), so each row is what plain decoding would sample
from, had drafts 1..i been its outputs:

    greedy    accept draft i+1 while it equals argmax p_i; then emit argmax p_j at the first
              mismatch j (or at row k when all k held): accepted drafts + 1 token.
    sampled   exact speculative sampling, draft by draft, with q_i the proposer's distribution:
              accept x with probability min(1, p_i(x) / q_i(x)); on rejection sample from
              normalize(max(0, p_i - q_i)) and stop; if all k held, sample the bonus from p_k.
              A one-hot q (n-gram drafts, greedy MTP drafts) makes this: accept with probability
              p_i(x), else sample from p_i with x removed.

Every accepted or emitted token is distributed as plain decoding's would be (Leviathan et al.,
2023). Each sampled request draws its uniforms in order from its own generator (seeded) or the
engine's, so the draws of a seeded request depend on its own acceptances, never on the batch.
Reported logprobs are the target's raw ones (before any processing), as for plain sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.contracts.plan import SampleResult
from deepinfer.model_executor.layers.penalties import process_logits
from deepinfer.model_executor.layers.sampler import Sampler, logsumexp, top_logprobs
from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata
from deepinfer.model_executor.layers.token_draws import filtered_weights, inverse_cdf
from deepinfer.sampling_params import SamplingParams


@dataclass
class VerifyRow:
    """One request's verification: its k drafts, and q [k, V] the proposer's distribution over
    each draft's position (None: one-hot at the draft)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # before this step
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.draft_token_ids) + 1


class RejectionSampler:
    """Turns each request's k + 1 rows of target logits into its accepted tokens (see the module).
    Uses the engine's `Sampler` for its generators and its processing stages."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, rows: list[VerifyRow]) -> list[list[SampleResult]]:
        """logits [M, V], M = sum of rows' k + 1, in row order -> per row its tokens (1 .. k+1)."""
        if logits.dim() != 2 or logits.shape[0] != sum(r.num_rows for r in rows):
            raise ValueError(f"logits must be [M, V] with M = {sum(r.num_rows for r in rows)}, "
                             f"got {tuple(logits.shape)}")
        logits = logits.float()  # [M, V]
        metadata = _expanded_metadata(rows, logits.device)
        lse = logsumexp(logits, self.sampler.batch_invariant)  # [M]
        processed = process_logits(logits, metadata)  # [M, V]
        greedy = processed.argmax(dim=-1).tolist() if metadata.greedy_rows else []  # [M]
        probs = self._probs(processed, metadata)  # logits row -> p [V]
        top = top_logprobs(logits, lse, metadata)
        results, first = [], 0
        for row in rows:
            accept = _accept_greedy if row.params.greedy else self._accept_sampled
            tokens = accept(row, first, greedy if row.params.greedy else probs)
            results.append([SampleResult(t, float(logits[first + i, t] - lse[first + i]), top.get(first + i),
                                         _rank(logits[first + i], t) if row.params.logprobs is not None else None)
                            for i, t in enumerate(tokens)])
            first += row.num_rows
        return results

    def _probs(self, processed: torch.Tensor, metadata: SamplingMetadata) -> dict[int, torch.Tensor]:
        """Logits row -> the normalized target distribution [V] of each sampled request's row."""
        if not metadata.random_rows:
            return {}
        index = torch.tensor(metadata.random_rows, device=processed.device)  # [R]
        weights = filtered_weights(processed.index_select(0, index), metadata, self.sampler.batch_invariant)
        weights = weights / weights.sum(dim=-1, keepdim=True)  # [R, V]
        return dict(zip(metadata.random_rows, weights.unbind(0), strict=True))

    def _accept_sampled(self, row: VerifyRow, first: int, probs: dict[int, torch.Tensor]) -> list[int]:
        """Exact speculative sampling over the row's drafts; returns accepted drafts + 1 token."""
        draw = lambda: self.sampler.uniform(row.request_id, row.params.seed)  # noqa: E731
        for i, x in enumerate(row.draft_token_ids):
            p = probs[first + i]  # [V]
            q = None if row.draft_probs is None else row.draft_probs[i]  # [V]
            q_x = 1.0 if q is None else float(q[x])
            if draw() * q_x < float(p[x]):
                continue
            residual = p.clone() if q is None else (p - q).clamp_min_(0.0)  # [V]
            if q is None:
                residual[x] = 0.0
            if not float(residual.sum()) > 0.0:
                residual = p  # p <= q everywhere means p == q: nothing is left to correct
            return row.draft_token_ids[:i] + [_draw_from(residual, draw())]
        return row.draft_token_ids + [_draw_from(probs[first + row.num_rows - 1], draw())]


def _accept_greedy(row: VerifyRow, first: int, argmax: list[int]) -> list[int]:
    """Drafts while each equals the target's argmax, then the target's token at the first miss."""
    for i, x in enumerate(row.draft_token_ids):
        if argmax[first + i] != x:
            return row.draft_token_ids[:i] + [argmax[first + i]]
    return row.draft_token_ids + [argmax[first + row.num_rows - 1]]


def _rank(logits: torch.Tensor, token_id: int) -> int:
    """1-based rank of token_id under one row of raw logits [V]."""
    return int((logits > logits[token_id]).sum()) + 1


def _draw_from(weights: torch.Tensor, u: float) -> int:
    """A token from unnormalized weights [V] at uniform u."""
    return int(inverse_cdf(weights[None], torch.tensor([u], dtype=torch.float64, device=weights.device))[0])


def _expanded_metadata(rows: list[VerifyRow], device) -> SamplingMetadata:
    """One metadata row per verified position; row i of a request sees drafts 1..i as outputs."""
    ids, params, prompts, outputs = [], [], [], []
    for row in rows:
        for i in range(row.num_rows):
            ids.append(row.request_id)
            params.append(row.params)
            prompts.append(row.prompt_token_ids)
            outputs.append(row.output_token_ids + row.draft_token_ids[:i] if i else row.output_token_ids)
    return SamplingMetadata.from_rows(ids, params, prompts, outputs, device)
