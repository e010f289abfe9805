"""Prompt logprobs: each prompt token's log-probability under the model, from the logits of the
position before it, gathered over a request's prefill chunks.

A chunk of a request that asks for them (`ScheduledRequest.prompt_logprobs`, set by the
scheduler on its first pass over the prompt) scores the prompt tokens after each of its rows:

    prompt     t0    t1    t2    t3    t4          (L = 5)
    chunk A    p0    p1                            rows score t1, t2
    chunk B                p2    p3    p4          rows p2, p3 score t3, t4; p4's logits
                                                   predict the first output (sampled as usual)
    entries    None  t1    t2    t3    t4

Entries go into a per-request list; the chunk that completes the prompt (it samples the first
output token) hands the list over on that token's `SampleResult`. A chunk starting at position 0
(a recompute after preemption) starts the list afresh. The scheduler never gives such a request
a prefix-cache hit, so every prompt position is computed here.
"""

from __future__ import annotations

import torch

from deepinfer.contracts.plan import ModelOutput, ScheduledRequest
from deepinfer.model_executor.layers.sampler import logsumexp

_MAX_ROWS = 256  # logits rows computed at once ([rows, V] fp32 stays small)

Entry = list[tuple[int, float, int]]  # (token id, logprob, rank): the prompt's token, then the top n


class PromptLogprobs:
    """Per request: the prompt logprobs gathered so far (see the module)."""

    def __init__(self):
        self._entries: dict[str, list[Entry | None]] = {}

    def collect(self, spans: list, hidden: torch.Tensor, compute_logits) -> None:
        """spans: (ScheduledRequest, first packed row) of the step; hidden [T, H]; compute_logits
        maps hidden rows [n, H] to logits [n, V]. Scores the prompt tokens each chunk reaches."""
        for s, start in spans:
            if s.prompt_logprobs is None or s.verify:
                continue
            num_prompt = len(s.prompt_token_ids)
            entries = self._entries.get(s.request_id)
            if entries is None or s.start_pos == 0:
                entries = self._entries[s.request_id] = [None] * num_prompt
            num_rows = min(s.num_tokens, num_prompt - 1 - s.start_pos)  # rows whose next token is a prompt token
            for first in range(0, max(0, num_rows), _MAX_ROWS):
                count = min(_MAX_ROWS, num_rows - first)
                logits = compute_logits(hidden[start + first:start + first + count]).float()  # [n, V]
                position = s.start_pos + first + 1  # prompt index of the first token scored
                targets = s.prompt_token_ids[position:position + count]
                entries[position:position + count] = score_rows(logits, targets, s.prompt_logprobs)

    def attach(self, scheduled: list[ScheduledRequest], output: ModelOutput) -> None:
        """Hand each completed prompt's entries to its first output token's SampleResult."""
        for s in scheduled:
            if s.prompt_logprobs is None or not s.do_sample or s.request_id not in self._entries:
                continue
            entries = self._entries.pop(s.request_id)
            samples = output.samples.get(s.request_id)
            if samples:
                samples[0].prompt_logprobs = entries

    def release(self, request_ids) -> None:
        for request_id in request_ids:
            self._entries.pop(request_id, None)


def score_rows(logits: torch.Tensor, targets: list[int], num_top: int) -> list[Entry]:
    """logits [n, V] -> per row: (target, its logprob, its 1-based rank), then the top num_top
    (id, logprob, rank 1..num_top), best first."""
    lse = logsumexp(logits)[:, None]  # [n, 1]
    target = torch.tensor(targets, dtype=torch.long, device=logits.device)[:, None]  # [n, 1]
    chosen = logits.gather(1, target)  # [n, 1]
    ranks = ((logits > chosen).sum(dim=-1) + 1).tolist()  # [n]
    chosen_lp = (chosen - lse)[:, 0].tolist()  # [n]
    top_ids, top_lps = [[] for _ in targets], [[] for _ in targets]
    if num_top:
        values, ids = logits.topk(num_top, dim=-1)  # [n, k], [n, k]
        top_ids, top_lps = ids.tolist(), (values - lse).tolist()
    return [[(t, lp, r)] + [(i, v, k) for k, (i, v) in enumerate(zip(row_ids, row_lps, strict=True), start=1)]
            for t, lp, r, row_ids, row_lps in zip(targets, chosen_lp, ranks, top_ids, top_lps, strict=True)]
