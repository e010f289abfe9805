"""Draft-model drafts (speculative_model): a smaller model with the target's tokenizer, run after
each target step over its own cache at the target's addresses (`worker/draft_cache.py`), on the
chain loop (`spec_decode/chain.py`).

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
them are the kept ones) where they lie below `DraftRows.stable_end` (not in scratch blocks nor
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
from typing import Any, Protocol

import torch

from deepinfer.config import SpeculativeConfig
from deepinfer.contracts.drafting import DraftInputs
from deepinfer.contracts.plan import ScheduledRequest, is_decode
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.spec_decode.chain import Chain, ChainDrafter
from deepinfer.spec_decode.draft_length import DraftLength
from deepinfer.spec_decode.drafter import draft_budget


class DraftRows(Protocol):
    """What the drafter needs of the draft's cache (the worker's `DraftCache`): the draft model
    bound to it, the device, each request's units and scratch blocks, and pass metadata."""

    model: Any  # the draft model (a CachedModel), bound to the draft's groups
    device: Any

    def units_of(self, s: ScheduledRequest, scratch: list[int]) -> tuple[tuple[list[int], ...], tuple[int, ...]]:
        """(block tables, state slots) of the draft's groups for request s, each table followed by `scratch`."""

    def scratch(self, i: int) -> list[int]:
        """The scratch block ids of the i-th request of a step's drafting."""

    def stable_end(self, q: int) -> int:
        """Draft rows of positions below this stay at the request's addresses until its next step."""

    def metadata(self, scheduled: list[ScheduledRequest]) -> tuple[Any, list[tuple[ScheduledRequest, int]]]:
        """One pass's attention metadata over the draft's groups, on its device, and the packed order."""


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


class DraftModelDrafter(ChainDrafter):
    """Runs the draft model after each step (see the module docstring). With several ranks every
    rank runs its passes (its layers split like the target's); the drafts agree."""

    def __init__(self, config: SpeculativeConfig, rows: DraftRows, vocab_size: int, max_model_len: int,
                 lengths: DraftLength):
        self.k, self.rows, self.model = config.num_speculative_tokens, rows, rows.model
        self.lengths = lengths  # how many of the k drafts a request gets (draft_length.py)
        self.vocab_size = vocab_size  # drafts are ids of the target's vocabulary
        self.max_model_len = max_model_len  # no draft row past the last position a request may reach
        self.num_passes = 0  # draft forwards run (pass 0 and the chained ones), for tests and benchmarks
        self.num_tokens = 0  # token rows those forwards computed
        self._written: dict[str, _Written] = {}  # per request: the rows its last passes left

    def first_pass(self, inputs: DraftInputs, samples: dict) -> tuple[list[Chain], dict[str, list[int]]]:
        """Every request's kept tokens without a valid row and its new one as pass 0's spans, and per
        request that sampled and has room the list its drafts go to; what the passes will leave per
        request that sampled replaces what the last step's left."""
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
            cap = min(draft_budget(s, new, self.k), self.max_model_len - q) if s.do_sample else 0
            budget = self.lengths.budget(s, new, cap)
            collected = drafts.setdefault(s.request_id, []) if budget else []
            tables, slots = self.rows.units_of(s, self.rows.scratch(len(chains)))
            sched = ScheduledRequest(s.request_id, tokens, first, tables, slots,
                                     verify=is_decode(s) and len(tokens) > 1)
            chains.append(Chain(sched, budget, collected))
            if sampled:
                written[s.request_id] = _Written(q, new[-1].token_id, collected, self.rows.stable_end(q))
        self._written = written
        return chains, drafts

    def run_pass(self, step: int, chains: list[Chain], wanted: list[Chain]) -> list[tuple[int, Any]]:
        """One draft forward over every chain's span, packed; the argmax at the last row of each
        chain in `wanted` (no logits for the others)."""
        md, order = self.rows.metadata([c.sched for c in chains])
        starts = {id(s): start for s, start in order}
        ids = torch.tensor([t for s, _ in order for t in s.token_ids], device=self.rows.device)  # [T']
        with forward_context(md):
            hidden = self.model(ids, md.positions)  # [T', hidden]
        self.num_passes, self.num_tokens = self.num_passes + 1, self.num_tokens + ids.numel()
        if not wanted:
            return []
        rows = torch.tensor([starts[id(c.sched)] + c.sched.num_tokens - 1 for c in wanted],
                            device=self.rows.device)  # [r]
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [r, V']
        return [(token, None) for token in logits[:, :self.vocab_size].argmax(dim=-1).tolist()]  # [r]

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget what finished, aborted or preempted requests' passes left (a preempted one
        recomputes its rows from its first position)."""
        request_ids = list(request_ids)
        for request_id in request_ids:
            self._written.pop(request_id, None)
        self.lengths.release(request_ids)
