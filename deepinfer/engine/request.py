"""Request: the engine's record of one generation, and the rules that depend on one request alone
(what it may compute this step, which drafts it verifies, when it stops). Pure Python."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from deepinfer.contracts.lora import LoRAAdapter
from deepinfer.contracts.multimodal import PictureInput
from deepinfer.contracts.pooling import PoolingParams
from deepinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again; its cache was freed and will be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed by a fault in its step, sampling or output processing

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Request:
    """`token_ids` = prompt + outputs; `num_computed_tokens` of them are in the KV cache.

    One counter drives prefill, chunked prefill, decode and recompute after preemption.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step (speculative)
    cache_salt: str | None = None  # isolates its prefix-cache keys (e.g. per tenant)
    num_cached_tokens: int | None = None  # prompt tokens its first admission found cached
    block_hashes: list[bytes] = field(default_factory=list)  # chained hash per full unit of token_ids
    snapshot_at: list[int] = field(default_factory=list)  # boundaries its prefill stops at for a snapshot
    # an embedding request (engine/pooling.py): computes its prompt, samples nothing, ends with a vector
    pooling_params: PoolingParams | None = None
    lora: LoRAAdapter | None = None  # its LoRA adapter (its content keys the request's prefix chain)
    priority: int = 0  # lower is served first under the priority policy (engine/request_queue.py)
    client_id: str | None = None  # whose request (fair share between clients); None: the anonymous client
    # its pictures, their placeholder runs in the prompt (their content keys the units holding them)
    pictures: tuple[PictureInput, ...] = ()
    whole_picture_runs: bool = False  # its model reads a run whole: no prefill chunk ends inside a run it begins

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def truncate_outputs(self, num_output_tokens: int) -> None:
        """Keep the first `num_output_tokens` outputs (a stop string ended the run earlier)."""
        del self.output_token_ids[num_output_tokens:]
        del self.token_ids[self.num_prompt_tokens + num_output_tokens:]
        self.block_hashes.clear()  # recomputed from the tokens if ever needed


def check_new_request(req: Request, max_len: int, max_cache_tokens: int, lora_enabled: bool) -> None:
    """ValueError if req is not new or could never run to its end: an empty prompt, no room for an
    output under `max_len`, more KV cache than `max_cache_tokens`, an adapter with LoRA off."""
    rid, num_prompt = req.request_id, req.num_prompt_tokens
    if req.is_finished or req.num_computed_tokens or req.output_token_ids:
        raise ValueError(f"request {rid!r} is not new: status {req.status.value}, "
                         f"{req.num_computed_tokens} computed, {req.num_output_tokens} outputs")
    if num_prompt == 0:
        raise ValueError(f"request {rid!r}: prompt_token_ids must not be empty")
    if req.lora is not None and not lora_enabled:
        raise ValueError(f"request {rid!r} names LoRA adapter {req.lora.name!r}, but LoRA is off "
                         f"(enable_lora=False)")
    pooling = req.pooling_params is not None  # an embedding computes its prompt and nothing after it
    if num_prompt > max_len or (num_prompt == max_len and not pooling):
        raise ValueError(f"request {rid!r}: prompt of {num_prompt} tokens leaves no room for "
                         f"an output token under max_model_len {max_len}")
    num_needed = num_prompt if pooling else min(num_prompt + req.sampling_params.max_tokens, max_len)
    if num_needed > max_cache_tokens:
        raise ValueError(f"request {rid!r}: prompt of {num_prompt} tokens + max_tokens "
                         f"{req.sampling_params.max_tokens} (capped by max_model_len {max_len}) "
                         f"needs {num_needed} tokens of KV cache, but the whole cache holds "
                         f"{max_cache_tokens} tokens")


# ---- one request's rules (the scheduler applies them; they read nothing but the request) --------


def length_limit(req: Request, max_model_len: int) -> int:
    """How long `req` may grow: the engine's max_model_len, or the request's own lower limit."""
    return max_model_len if req.max_model_len is None else min(max_model_len, req.max_model_len)


def chunk(req: Request, start: int, budget: int) -> int:
    """Tokens `req` computes this step from `start`: what is left, cut by the budget and at its next
    snapshot boundary."""
    end = min(req.num_tokens, start + budget)
    end = min([end] + [b for b in req.snapshot_at if b > start])
    return (_around_runs(req, start, end, budget) if req.whole_picture_runs else end) - start


def _around_runs(req: Request, start: int, end: int, budget: int) -> int:
    """`end` moved off a picture's run it would cut: back to the run's start when the chunk begins
    before the run, else (the chunk begins at or inside it) on to the run's end if the budget allows
    (`start`, nothing this step, if not)."""
    for p in req.pictures:
        if p.offset < end < p.end:
            if p.offset > start:
                return p.offset
            return p.end if p.end - start <= budget else start
    return end


def outside_runs(req: Request, boundaries: list[int]) -> list[int]:
    """The snapshot `boundaries` a request may stop its prefill at: for a model that reads runs
    whole, none inside a picture's run."""
    if not req.whole_picture_runs:
        return boundaries
    return [b for b in boundaries if not any(p.offset < b < p.end for p in req.pictures)]


def drafts_to_verify(req: Request, limit: int, budget: int) -> list[int]:
    """The drafts a decode step of `req` verifies: as many as max_tokens, the length `limit` and the
    budget leave room for (each accepted draft is one more output token)."""
    if not req.draft_token_ids or req.num_tokens - req.num_computed_tokens != 1:
        return []
    room = min(req.sampling_params.max_tokens - req.num_output_tokens, limit - req.num_tokens, budget) - 1
    return req.draft_token_ids[:max(0, room)]


def stop_of(req: Request, limit: int) -> tuple[RequestStatus, int | None] | None:
    """Whether `req`'s last output token ends it, and how: a stop token id (the reason), EOS
    (unless ignore_eos), max_tokens or the length `limit`; None while it goes on."""
    token_id, params = req.output_token_ids[-1], req.sampling_params
    if token_id in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED, token_id
    if not params.ignore_eos and token_id in req.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED, None
    if req.num_output_tokens >= params.max_tokens or req.num_tokens >= limit:
        return RequestStatus.FINISHED_LENGTH, None
    return None
