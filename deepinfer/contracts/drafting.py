"""What the step executor asks of a drafter, and what a model drafter's passes ask of the worker.

    Drafter        propose(inputs, samples) -> {request_id: drafts} after each step's sampling;
                   draft_probs (the proposal distribution q of drafts it handed out, None for
                   one-hot); release(ids); runs_model (its passes run a model, so every
                   tensor-parallel rank runs them). Implementations: `spec_decode/ngram.py`
                   (prompt lookup), `spec_decode/mtp.py` (DeepSeek's next-n module) and
                   `spec_decode/draft_model.py` (a smaller checkpoint), the last two over the one
                   chain loop of `spec_decode/chain.py`.
    DraftInputs    the step the drafter follows: every request's span and first packed row, and
                   the requests that sampled (the worker's `StepInputs` is one)
    PassMetadata   the worker's side of one drafting pass: the attention metadata of a list of
                   one-request spans over the drafter's cache groups, on the model's device, and
                   the spans in packed order (`worker/drafting.py` binds the addressing)

No torch here: tensors and metadata are typed `Any`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from deepinfer.contracts.plan import ScheduledRequest


class DraftInputs(Protocol):
    """One step's requests as the drafter sees them."""

    spans: list[tuple[ScheduledRequest, int]]  # every request and its first packed row, in packed order
    sample_rows: list[ScheduledRequest]  # the requests that sampled this step


class Drafter(Protocol):
    """Proposes up to k drafts per request after each step; the scheduler verifies them in the next."""

    runs_model: bool  # True: its passes run a model, so every tensor-parallel rank runs them

    def propose(self, inputs: DraftInputs, samples: dict) -> dict[str, list[int]]:
        """Drafts for each request that sampled this step (`samples`: request id -> its samples),
        no more than its max_tokens leaves room to verify."""

    def draft_probs(self, request_id: str, draft_token_ids: list[int]) -> Any:
        """The proposal distribution q [k, V] of the drafts handed to `request_id`; None: one-hot."""

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished, aborted or preempted requests."""


class PassMetadata(Protocol):
    """The worker's builder of one drafting pass's attention metadata (`worker/drafting.py`)."""

    def __call__(self, scheduled: list[ScheduledRequest]) -> tuple[Any, list[tuple[ScheduledRequest, int]]]:
        """(AttentionMetadata on the model's device, (span, first packed row) in packed order)."""
