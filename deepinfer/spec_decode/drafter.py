"""The drafters' shared rule and the drafter that runs no model.

    draft_budget  how many drafts a request may take after this step: k, fewer when max_tokens
                  leaves less room to verify (`draft_length.py` picks how many of them pay)
    NgramDrafter  prompt lookup over the request's prompt and outputs (any model; `ngram.py`)

The model drafters (`mtp.py`, `draft_model.py`) run the chain loop of `chain.py`; all three are
`Drafter`s (contracts/drafting.py), built by the worker (`worker/drafting.py`).
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer.config import SpeculativeConfig
from deepinfer.contracts.drafting import DraftInputs
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.spec_decode.draft_length import DraftLength
from deepinfer.spec_decode.ngram import NgramProposer


def draft_budget(s: ScheduledRequest, samples: list, k: int) -> int:
    """Drafts worth proposing for request s after this step's samples: k, fewer when max_tokens
    leaves less room (the verification step also yields one token of its own)."""
    params = s.sampling_params
    left = params.max_tokens - len(s.output_token_ids) - len(samples)
    return max(0, min(k, left - 1))


class NgramDrafter:
    """Prompt lookup: drafts from the request's own history (prompt + outputs + this step's)."""

    runs_model = False  # rank 0 alone drafts

    def __init__(self, config: SpeculativeConfig, lengths: DraftLength):
        self.k, self.lengths = config.num_speculative_tokens, lengths
        self.proposer = NgramProposer(self.k, config.prompt_lookup_max, config.prompt_lookup_min)

    def propose(self, inputs: DraftInputs, samples: dict) -> dict[str, list[int]]:
        drafts = {}
        for s in inputs.sample_rows:
            new = samples.get(s.request_id)
            budget = self.lengths.budget(s, new, draft_budget(s, new, self.k)) if new else 0
            if budget:
                history = s.prompt_token_ids + s.output_token_ids + [r.token_id for r in new]
                drafts[s.request_id] = self.proposer.propose(history, budget)
        return drafts

    def draft_probs(self, request_id: str, draft_token_ids: list[int]):
        return None  # one-hot at each draft

    def release(self, request_ids: Iterable[str]) -> None:
        self.lengths.release(request_ids)
