"""The plain-data contract between the scheduler (engine/) and the model runner (worker/).

No torch here: the scheduler builds a `StepPlan` from Python lists, the runner turns it into
tensors and answers with a `ModelOutput` of `SampleResult`s. With several tensor-parallel ranks,
rank 0 hands each follower the `StepPlan` and, mid-step, the `StepTokens` its sampling gave.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.contracts.lora import LoRAAdapter
from deepinfer.contracts.multimodal import PictureInput
from deepinfer.contracts.pooling import PoolingParams
from deepinfer.sampling_params import SamplingParams


@dataclass(frozen=True)
class CacheLoad:
    """Read one saved unit from the KV cache directory into the cache before the step's forward:
    a paged block (`group`: the paged group's index among paged groups, `unit`: the block id)
    or a snapshot (`group` -1, `unit`: the snapshot slot). `key` is the unit's hash (hex)."""

    group: int
    unit: int
    path: str
    key: str
    mtime_ns: int | None = None  # the file's recency after the read (deeper units: older)

    @property
    def is_snapshot(self) -> bool:
        return self.group < 0


@dataclass(frozen=True)
class CachePersist:
    """Write one cached unit (a block of paged group `group`, or snapshot slot `unit` when group
    is -1) to the KV cache directory. The worker copies its bytes before the step's forward.
    `mtime_ns` is the recency the file gets: of one prefix, deeper units look older, so the
    directory's LRU eviction drops a prefix's tail before its head."""

    group: int
    unit: int
    path: str
    key: str
    mtime_ns: int | None = None


@dataclass
class ScheduledRequest:
    """One request's share of a step: `token_ids` at positions start_pos .. start_pos+len-1.

    A prefill chunk, a decode token and a 1 + k verification step are all the same thing here.
    """

    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # num_computed_tokens before this step
    block_ids: tuple[list[int], ...]  # per paged cache group: the request's block table
    state_ids: tuple[int, ...] = ()  # per ring cache group: the request's state slot
    # Set when this step's last token yields the next token (the request is then fully computed).
    sampling_params: SamplingParams | None = None
    prompt_token_ids: list[int] = field(default_factory=list)  # for penalties (not copied)
    output_token_ids: list[int] = field(default_factory=list)  # for penalties (not copied)
    # A verification step: token_ids = [the last sampled token] + k drafts; its k+1 tokens are
    # stored, then read, in decode order (book §3.5.1), and every position is scored.
    verify: bool = False
    # prompt_logprobs: how many top logprobs to report per prompt token this chunk scores (None: no
    # prompt logits computed); set on the chunks of a request's first pass over its prompt
    prompt_logprobs: int | None = None
    # An embedding request (every chunk of its prompt): its final hidden rows are pooled, and the chunk
    # that completes the prompt returns the vector (`ModelOutput.pooled`); it never samples
    pooling: PoolingParams | None = None
    # Prefix caching: before the forward, read these saved units from disk into the request's
    # blocks (or a snapshot slot), then restore its rings, per-request state and partial pages
    # at start_pos from snapshot slot `restore_from`; after the step, copy them at the chunk's
    # end into snapshot slot `capture_to`.
    loads: list[CacheLoad] = field(default_factory=list)
    restore_from: int | None = None
    capture_to: int | None = None
    # LoRA: the request's adapter and the device slot the engine gave it (-1: none); the worker loads
    # the adapter into the slot before the forward when the slot holds other content
    lora: LoRAAdapter | None = None
    lora_slot: int = -1
    # Pictures: ALL of the request's pictures (a reference, on every step, decodes too); the worker
    # fills the rows of those whose placeholder run overlaps this chunk from their encoder output
    pictures: tuple[PictureInput, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        """The drafts a verification step checks (empty for any other step)."""
        return self.token_ids[1:] if self.verify else []

    @property
    def do_sample(self) -> bool:
        return self.sampling_params is not None


def is_decode(s: ScheduledRequest) -> bool:
    """Store-then-read steps: one new token, or a verification step's k+1 tokens."""
    return s.start_pos > 0 and (s.num_tokens == 1 or s.verify)


@dataclass
class StepPlan:
    """One engine step: the scheduled requests in scheduling order, and the requests the runner
    must forget (finished) or whose per-request state it keeps for a later recompute (preempted)."""

    scheduled: list[ScheduledRequest]
    finished_request_ids: list[str] = field(default_factory=list)  # runner drops per-request state
    preempted_request_ids: list[str] = field(default_factory=list)
    persist: list[CachePersist] = field(default_factory=list)  # units to save, before the forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampleResult:
    """The token sampled for one request this step, with its logprob under the raw model."""

    token_id: int
    logprob: float  # log-softmax of the sampled token under the unmodified model distribution
    top_logprobs: list[tuple[int, float]] | None = None  # top-n (token id, logprob), best first
    rank: int | None = None  # 1-based rank of token_id under the raw model (set when logprobs are asked)
    # prompt_logprobs requests, on the first token only: per prompt token (the first None) a
    # list of (token id, logprob, rank): the prompt's own token first, then the top n
    prompt_logprobs: list[list[tuple[int, float, int]] | None] | None = None


@dataclass
class ModelOutput:
    """What one step produced, per request id:

    samples: the tokens sampled this step, in order (only requests whose plan sampled): one for a
             plain step; for a verification step the accepted drafts, then the target model's
             next token (1 .. k+1 tokens);
    draft_token_ids: the drafts proposed for the request's next step (speculative decoding);
    errors:  a one-line message for each request the runner could not serve this step (its
             sampling failed alone); the engine fails those requests and keeps the others going;
    load_failures: the saved-cache files that could not be read for a request (missing,
             damaged, foreign): the request was left out of the step and starts over;
    pooled:  the embedding of each pooling request whose prompt this step completed (floats, as
             its `PoolingParams` ask: pooled, cut to `dimensions`, normalised or not).
    """

    samples: dict[str, list[SampleResult]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    load_failures: dict[str, list[str]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)

    def update(self, other: ModelOutput) -> None:
        self.samples.update(other.samples)
        self.draft_token_ids.update(other.draft_token_ids)
        self.errors.update(other.errors)
        self.load_failures.update(other.load_failures)
        self.pooled.update(other.pooled)


@dataclass(frozen=True)
class StepTokens:
    """Rank 0's second message of a step to the follower ranks (tensor parallelism), after its
    sampling and before its drafting passes: the token ids each request's samples hold (a
    verification step's accepted drafts and the target's token). Sent for a plan that verifies
    drafts, or for any plan when the drafter runs the model (MTP); the followers finish the step
    with them as rank 0 does (kept counts to `CachedModel.keep_verified`, then the MTP passes,
    whose collectives pair with rank 0's)."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, output: ModelOutput) -> StepTokens:
        return cls({rid: [r.token_id for r in results] for rid, results in output.samples.items()})

    def samples(self) -> dict[str, list[SampleResult]]:
        """The tokens as samples (logprobs are rank 0's: 0.0 here)."""
        return {rid: [SampleResult(t, 0.0) for t in ids] for rid, ids in self.token_ids.items()}


class FatalStepError(RuntimeError):
    """A fault of the step itself, not of one request (the device, the process, the engine's own
    state): no request can be blamed, so the engine does not try to isolate it and `step()` raises."""


# Exception class names (anywhere in the MRO) of faults no request is to blame for, recognised
# without importing torch: torch.OutOfMemoryError (a RuntimeError) and torch.AcceleratorError
# (a device error: the device context is broken for every request).
_FATAL_CLASS_NAMES = frozenset({"OutOfMemoryError", "AcceleratorError"})
_MAX_FAULT_TEXT = 200


def is_fatal_fault(exc: BaseException) -> bool:
    """True for a fault that must not be pinned on one request: anything that is not an
    `Exception` (KeyboardInterrupt, SystemExit), `FatalStepError`, `MemoryError`, and torch's
    out-of-memory and device errors."""
    if not isinstance(exc, Exception) or isinstance(exc, (FatalStepError, MemoryError)):
        return True
    return any(cls.__name__ in _FATAL_CLASS_NAMES for cls in type(exc).__mro__)


def describe_fault(stage: str, exc: BaseException) -> str:
    """A one-line message for a request failed by `exc` in `stage` (never a traceback: that is
    logged). E.g. "sampling failed: ValueError: bad seed"."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(text) > _MAX_FAULT_TEXT:
        text = text[:_MAX_FAULT_TEXT] + "..."
    return f"{stage} failed: {type(exc).__name__}" + (f": {text}" if text else "")
