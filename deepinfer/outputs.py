"""What the offline API and the server return. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field


class RequestFailedError(RuntimeError):
    """A request the engine ended because of a fault while it ran (its model step, its sampling
    or its output processing failed); the rest of the batch went on. The message says where and
    what (one line); the traceback is in the "deepinfer.engine" / "deepinfer.worker" log."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_id!r} failed: {message}")
        self.request_id = request_id


@dataclass
class CompletionOutput:
    index: int
    text: str = ""  # the whole output text so far (stop strings excluded)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # per output token: sampled + top-n {id: logprob}
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string
    delta_text: str = ""  # text added by the latest step (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # set when this request was refused (e.g. a ValueError) or failed by a fault while it ran
    # (a RequestFailedError; finish_reason "error")
    error: Exception | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not recomputed) on admission

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""
