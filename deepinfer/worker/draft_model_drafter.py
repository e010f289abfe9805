"""Draft-model drafts (speculative_model): a smaller model with the target's tokenizer, run after
each target step over its own cache at the target's addresses (`worker/draft_cache.py`).

After a step that computed positions p .. p+n-1 of a request and kept them (a prefill chunk, a
decode token, or a verification's last token and accepted drafts: kept = 1 + a of 1 + k'), and
sampled token x at position q = p + kept:

    pass 0   tokens t_p .. t_{p+kept-1}, x at positions p .. q         (x only when it sampled)
             -> the draft's rows of p .. q; its output at q gives d_1
    pass j   token d_j at position q + j -> row q + j; its output gives d_{j+1}     (j = 1 .. k'-1)

Every position the target keeps gets its draft row in the same step, prefill chunks that sample
nothing included, so a block the prefix cache keeps holds both models' rows. Rows from x on sit
past what the target computed; positions past the request's block table go to its scratch blocks.
The next step's pass 0 starts at the first kept position without a valid row: rows of x and of
the accepted drafts d_1 .. d_{k'-1} chained last step hold (their tokens and everything before
them are the kept ones) where they lie below `DraftCache.stable_end` (not in scratch blocks nor
in blocks the scheduler frees when it trims rejected positions), so after a verification that
accepted a drafts pass 0 is y alone (a < k'), or d_k' and y; anything else (a preemption, a
re-run, an unknown request) starts at the span's own first position. A pass packs every
request's span (decodes first, as the target's steps); a span of a decode or a verification runs
as the target's verification spans do (store, then read).

Drafts are the draft's argmax at every temperature (a one-hot proposal q: `draft_probs` is None),
so the rejection sampler keeps the target's distribution exactly; with temperature > 0 a draft is
accepted with the target's probability of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from deepinfer.config import SpeculativeConfig
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.worker.draft_cache import DraftCache, scratch_blocks_per_request
from deepinfer.worker.drafters import draft_budget
from deepinfer.worker.input_batch import build_group_metadata, is_decode


@dataclass(frozen=True)
class _Written:
    """What a request's last passes left: the rows of its new token `token` at position q and of
    its drafts d_1 .. d_{n-1} at q + 1 .., valid below `limit`."""

    q: int
    token: int
    drafts: list[int]  # filled by the chain of the step that wrote them
    limit: int

    def first_missing(self, s: ScheduledRequest, kept: int) -> int:
        """The first position of span s (kept tokens) without a valid draft row."""
        if s.start_pos != self.q or s.token_ids[0] != self.token or s.token_ids[1:kept] != self.drafts[:kept - 1]:
            return s.start_pos
        accepted = kept - 1
        return min(self.q + 1 + min(accepted, max(len(self.drafts) - 1, 0)), self.limit, s.start_pos + kept)


@dataclass
class _Chain:
    """One request's drafting: its next pass (a one-request schedule over the draft's groups),
    how many drafts it wants and the drafts so far."""

    sched: ScheduledRequest
    budget: int
    drafts: list[int]

    @property
    def last_pos(self) -> int:
        return self.sched.start_pos + self.sched.num_tokens - 1


class DraftModelDrafter:
    """Runs the draft model after each step (see the module docstring). With several ranks every
    rank runs its passes (its layers split like the target's); the drafts agree."""

    runs_model = True

    def __init__(self, config: SpeculativeConfig, cache: DraftCache, vocab_size: int, max_model_len: int):
        self.k, self.cache, self.model = config.num_speculative_tokens, cache, cache.model
        self.vocab_size = vocab_size  # drafts are ids of the target's vocabulary
        self.max_model_len = max_model_len  # no draft row past the last position a request may reach
        self.per_request = scratch_blocks_per_request(cache.plan, self.k)
        self.num_passes = 0  # draft forwards run (pass 0 and the chained ones), for tests and benchmarks
        self.num_tokens = 0  # token rows those forwards computed
        self._written: dict[str, _Written] = {}  # per request: the rows its last passes left

    def propose(self, inputs, samples: dict) -> dict[str, list[int]]:
        chains, drafts, written = self._first_pass(inputs, samples)
        step = 0
        while chains:
            wanted = [c for c in chains if c.budget > step]
            tokens = self._run(chains, wanted)
            chains = []
            for c, token in zip(wanted, tokens, strict=True):
                c.drafts.append(token)
                if c.budget > step + 1:
                    nxt = ScheduledRequest(c.sched.request_id, [token], c.last_pos + 1, c.sched.block_ids,
                                           c.sched.state_ids)
                    chains.append(_Chain(nxt, c.budget, c.drafts))
            step += 1
        self._written = written
        return drafts

    def _first_pass(self, inputs, samples: dict) -> tuple[list[_Chain], dict[str, list[int]], dict[str, _Written]]:
        """Every request's kept tokens without a valid row and its new one as pass 0's spans, per
        request that sampled and has room the list its chain's drafts go to, and what the passes
        will leave per request that sampled."""
        drafts: dict[str, list[int]] = {}
        chains, written = [], {}
        for s, _ in inputs.spans:
            new = samples.get(s.request_id)
            if s.pooling is not None or (s.do_sample and not new):
                continue  # an embedding never decodes; a failed sampling fails the request
            kept = len(new) if s.verify else s.num_tokens
            q = s.start_pos + kept  # the new token's position
            last = self._written.get(s.request_id)
            first = last.first_missing(s, kept) if last is not None else s.start_pos
            sampled = s.do_sample and q < self.max_model_len
            tokens = s.token_ids[first - s.start_pos:kept] + ([new[-1].token_id] if sampled else [])
            if not tokens:
                continue
            budget = min(draft_budget(s, new, self.k), self.max_model_len - q) if s.do_sample else 0
            collected = drafts.setdefault(s.request_id, []) if budget else []
            tables, slots = self.cache.units_of(s, self.cache.scratch(len(chains), self.per_request))
            sched = ScheduledRequest(s.request_id, tokens, first, tables, slots,
                                     verify=is_decode(s) and len(tokens) > 1)
            chains.append(_Chain(sched, budget, collected))
            if sampled:
                written[s.request_id] = _Written(q, new[-1].token_id, collected, self.cache.stable_end(q))
        return chains, drafts, written

    def _run(self, chains: list[_Chain], wanted: list[_Chain]) -> list[int]:
        """One draft forward over every chain's span, packed; the argmax at the last row of each
        chain in `wanted` (no logits for the others)."""
        md, order = build_group_metadata([c.sched for c in chains], self.cache.addressing)
        device = self.cache.device
        if device.type != "cpu":
            md = md.to(device)
        starts = {id(s): start for s, start in order}
        ids = torch.tensor([t for s, _ in order for t in s.token_ids], device=device)  # [T']
        with forward_context(md):
            hidden = self.model(ids, md.positions)  # [T', hidden]
        self.num_passes, self.num_tokens = self.num_passes + 1, self.num_tokens + ids.numel()
        if not wanted:
            return []
        rows = torch.tensor([starts[id(c.sched)] + c.sched.num_tokens - 1 for c in wanted], device=device)  # [r]
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [r, V']
        return logits[:, :self.vocab_size].argmax(dim=-1).tolist()  # [r]

    def draft_probs(self, request_id: str, draft_token_ids: list[int]):
        return None  # argmax drafts: one-hot q

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget what finished, aborted or preempted requests' passes left (a preempted one
        recomputes its rows from its first position)."""
        for request_id in request_ids:
            self._written.pop(request_id, None)
