"""MTP drafts: DeepSeek-V4's next-n module, chained k times after each step, over its own ring.

The module at position t reads the main model's pre-head streams h_t and the embedding of token
t+1, and predicts token t+2 (`models/deepseek_v4/mtp.py`). After a step that computed positions
p .. p+n-1 of a request (the kept ones: a prefill chunk, a decode, or the last token and the
accepted drafts of a verification) and sampled token x at p+n:

    pass 0   positions p .. p+n-1, streams h_p .. h_{p+n-1}, next tokens t_{p+1} .. t_{p+n-1}, x
             -> rows stored at p .. p+n-1 of the request's "mtp" ring; the last output gives d_1
    pass j   position p+n-1+j, the previous pass's output streams, next token d_j
             -> row stored at p+n-1+j; its output gives d_{j+1}           (j = 1 .. k-1)

Pass 0 also runs for prefill chunks that sample nothing (their next tokens are in the prompt), so
every computed position has its true row when a later pass-0 window reads it. Rows of passes
j >= 1 sit ahead of the request's position and are overwritten by the next step's pass 0 before
anything reads them; the ring keeps S >= W + k + 1, so they never clobber a row still in a
window. Drafts are the module's argmax (a one-hot proposal distribution q).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.config import SpeculativeConfig
from deepinfer.contracts.model import DraftingModel
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.worker.drafters import draft_budget
from deepinfer.worker.input_batch import build_group_metadata


@dataclass
class _Chain:
    """One request's drafting: its pass input (a one-request schedule on the "mtp" ring), the
    streams it reads [n, N, hidden], how many drafts it wants, and the drafts so far."""

    sched: ScheduledRequest
    prev: torch.Tensor
    budget: int
    drafts: list[int]

    @property
    def last_pos(self) -> int:
        return self.sched.start_pos + self.sched.num_tokens - 1


class MtpDrafter:
    """Runs the model's MTP module after each step (see the module docstring). With several
    ranks every rank runs it (its layers are split like the main ones); the drafts agree."""

    runs_model = True

    def __init__(self, config: SpeculativeConfig, model: DraftingModel, groups, addressing):
        caps = model.capabilities
        if not (caps.mtp_drafting and caps.drafting_streams) or model.mtp is None:
            raise ValueError("speculative_method='mtp' needs a model built with its MTP module")
        self.k, self.model, self.mtp = config.num_speculative_tokens, model, model.mtp
        self.addressing = [a for a in addressing if a.group.name == "mtp"]
        if len(self.addressing) != 1:
            names = [g.name for g in groups]
            raise ValueError(f"the MTP module needs one 'mtp' ring group, the model declared {names}")

    def propose(self, inputs, samples: dict) -> dict[str, list[int]]:
        chains, drafts = self._first_pass_inputs(inputs, samples)
        step = 0
        while chains:
            outs = self._run(step, chains)  # per chain [n, N, hidden]
            drafting = [(c, out) for c, out in zip(chains, outs, strict=True) if c.budget > step]
            if not drafting:
                break
            last = torch.stack([out[-1] for _, out in drafting])  # [r, N, hidden]
            layer = self.mtp.layer_for_step(step)
            tokens = layer.logits(last, self.model.lm_head.weight).argmax(dim=-1).tolist()  # [r]
            chains = []
            for (c, out), token in zip(drafting, tokens, strict=True):
                c.drafts.append(token)
                if c.budget > step + 1:
                    nxt = ScheduledRequest(c.sched.request_id, [token], c.last_pos + 1, c.sched.block_ids,
                                           c.sched.state_ids)
                    chains.append(_Chain(nxt, out[-1:], c.budget, c.drafts))
            step += 1
        return drafts

    def _first_pass_inputs(self, inputs, samples: dict) -> tuple[list[_Chain], dict[str, list[int]]]:
        """Every request's kept positions with the tokens after them, and per request that
        sampled and has room the list its chain's drafts will be appended to."""
        streams = self.model.last_streams  # [T, N, hidden]
        drafts: dict[str, list[int]] = {}
        chains = []
        for s, start in inputs.spans:
            new = samples.get(s.request_id)
            if s.do_sample and not new:
                continue  # its sampling failed: the request is failed, no drafts
            kept = len(new) if s.verify else s.num_tokens
            following = [new[-1].token_id] if s.do_sample else [_token_at(s, s.start_pos + s.num_tokens)]
            budget = draft_budget(s, new, self.k) if s.do_sample else 0
            collected = drafts.setdefault(s.request_id, []) if budget else []
            sched = ScheduledRequest(s.request_id, s.token_ids[1:kept] + following, s.start_pos, s.block_ids,
                                     s.state_ids)
            chains.append(_Chain(sched, streams[start:start + kept], budget, collected))
        return chains, drafts

    def _run(self, step: int, chains: list[_Chain]) -> list[torch.Tensor]:
        """One pass of MTP layer `step % L` over every chain, packed; per chain its output [n, N, hidden]."""
        md, order = build_group_metadata([c.sched for c in chains], self.addressing)
        device = self.model.lm_head.weight.device
        if device.type != "cpu":
            md = md.to(device)
        by_sched = {id(c.sched): c for c in chains}
        packed = [by_sched[id(s)] for s, _ in order]
        prev = torch.cat([c.prev for c in packed])  # [T', N, hidden]
        ids = torch.tensor([t for c in packed for t in c.sched.token_ids], device=device)  # [T']
        embeds = F.embedding(ids, self.model.model.embed_tokens.weight)  # [T', hidden]
        with forward_context(md):
            out = self.mtp.layer_for_step(step).forward_cached(prev, embeds, md.positions, ids)  # [T', N, hidden]
        starts = {id(s): start for s, start in order}
        return [out[starts[id(c.sched)]:starts[id(c.sched)] + c.sched.num_tokens] for c in chains]

    def draft_probs(self, request_id: str, draft_token_ids: list[int]):
        return None  # argmax drafts: one-hot q

    def release(self, request_ids: Iterable[str]) -> None:
        pass


def _token_at(s: ScheduledRequest, pos: int) -> int:
    """The request's token at `pos` (prompt, then outputs)."""
    num_prompt = len(s.prompt_token_ids)
    return s.prompt_token_ids[pos] if pos < num_prompt else s.output_token_ids[pos - num_prompt]
