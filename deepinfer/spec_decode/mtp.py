"""MTP drafts: DeepSeek's next-n module, chained k times after each step over its own ring, on the
chain loop (`spec_decode/chain.py`).

The module at position t reads the main model's pre-head streams h_t and the embedding of token
t+1, and predicts token t+2 (`models/deepseek_v4/mtp.py`). After a step that computed positions
p .. p+n-1 of a request (the kept ones: a prefill chunk, a decode, or the last token and the
accepted drafts of a verification) and sampled token x at p+n:

    pass 0   positions p .. p+n-1, streams h_p .. h_{p+n-1}, next tokens t_{p+1} .. t_{p+n-1}, x
             -> rows stored at p .. p+n-1 of the request's "mtp" ring; the last output gives d_1
    pass j   position p+n-1+j, the previous pass's output streams (the chain's carry), next token
             d_j -> row stored at p+n-1+j; its output gives d_{j+1}           (j = 1 .. k-1)

Pass 0 also runs for prefill chunks that sample nothing (their next tokens are in the prompt), so
every computed position has its true row when a later pass-0 window reads it. Rows of passes
j >= 1 sit ahead of the request's position and are overwritten by the next step's pass 0 before
anything reads them; the ring keeps S >= W + k + 1, so they never clobber a row still in a
window. Drafts are the module's argmax (a one-hot proposal distribution q).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.config import SpeculativeConfig
from deepinfer.contracts.drafting import DraftInputs, PassMetadata
from deepinfer.contracts.model import DraftingModel
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.spec_decode.chain import Chain, ChainDrafter
from deepinfer.spec_decode.draft_length import DraftLength
from deepinfer.spec_decode.drafter import draft_budget


class MtpDrafter(ChainDrafter):
    """Runs the model's MTP module after each step (see the module docstring). With several
    ranks every rank runs it (its layers are split like the main ones); the drafts agree.
    `metadata` builds a pass's metadata over the model's "mtp" ring group."""

    def __init__(self, config: SpeculativeConfig, model: DraftingModel, metadata: PassMetadata,
                 lengths: DraftLength):
        caps = model.capabilities
        if not (caps.mtp_drafting and caps.drafting_streams) or model.mtp is None:
            raise ValueError("speculative_method='mtp' needs a model built with its MTP module")
        self.k, self.model, self.mtp, self.metadata = config.num_speculative_tokens, model, model.mtp, metadata
        self.lengths = lengths  # how many of the k drafts a request gets (draft_length.py)

    def first_pass(self, inputs: DraftInputs, samples: dict) -> tuple[list[Chain], dict[str, list[int]]]:
        """Every request's kept positions with the tokens after them (carrying their streams
        [n, N, hidden]), and per request that sampled and has room the list its drafts go to."""
        streams = self.model.last_streams  # [T, N, hidden]
        drafts: dict[str, list[int]] = {}
        chains = []
        for s, start in inputs.spans:
            new = samples.get(s.request_id)
            if s.do_sample and not new:
                continue  # its sampling failed: the request is failed, no drafts
            kept = len(new) if s.verify else s.num_tokens
            following = [new[-1].token_id] if s.do_sample else [_token_at(s, s.start_pos + s.num_tokens)]
            budget = self.lengths.budget(s, new, draft_budget(s, new, self.k)) if s.do_sample else 0
            collected = drafts.setdefault(s.request_id, []) if budget else []
            sched = ScheduledRequest(s.request_id, s.token_ids[1:kept] + following, s.start_pos, s.block_ids,
                                     s.state_ids)
            chains.append(Chain(sched, budget, collected, streams[start:start + kept]))
        return chains, drafts

    def run_pass(self, step: int, chains: list[Chain], wanted: list[Chain]) -> list[tuple[int, Any]]:
        """MTP layer `step % L` over every chain, packed; per wanted chain its argmax and its last
        output stream [1, N, hidden] (what its next pass reads)."""
        md, order = self.metadata([c.sched for c in chains])
        device = self.model.lm_head.weight.device
        by_sched = {id(c.sched): c for c in chains}
        packed = [by_sched[id(s)] for s, _ in order]
        prev = torch.cat([c.carry for c in packed])  # [T', N, hidden]
        ids = torch.tensor([t for c in packed for t in c.sched.token_ids], device=device)  # [T']
        embeds = F.embedding(ids, self.model.model.embed_tokens.weight)  # [T', hidden]
        layer = self.mtp.layer_for_step(step)
        with forward_context(md):
            out = layer.forward_cached(prev, embeds, md.positions, ids)  # [T', N, hidden]
        if not wanted:
            return []
        starts = {id(s): start for s, start in order}
        last = torch.stack([out[starts[id(c.sched)] + c.sched.num_tokens - 1] for c in wanted])  # [r, N, hidden]
        tokens = layer.logits(last, self.model.lm_head.weight).argmax(dim=-1).tolist()  # [r]
        return [(token, last[i:i + 1]) for i, token in enumerate(tokens)]


def _token_at(s: ScheduledRequest, pos: int) -> int:
    """The request's token at `pos` (prompt, then outputs)."""
    num_prompt = len(s.prompt_token_ids)
    return s.prompt_token_ids[pos] if pos < num_prompt else s.output_token_ids[pos - num_prompt]

    def release(self, request_ids: Iterable[str]) -> None:
        self.lengths.release(request_ids)
