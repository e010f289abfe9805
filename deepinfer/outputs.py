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
class Logprob:
    """One token's log-probability under the raw model (as vLLM's `Logprob`): `rank` is its
    1-based rank in the distribution (1 = the most likely), `decoded_token` its text (None
    without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: {token id: Logprob} holding the position's own token and the top n
PositionLogprobs = dict[int, Logprob]


@dataclass
class FunctionCall:
    """The function a tool call names, and its arguments as JSON text (as OpenAI sends them)."""

    name: str
    arguments: str


@dataclass
class ToolCall:
    """One tool call parsed out of a chat answer (OpenAI's and vLLM's shape)."""

    id: str
    function: FunctionCall
    type: str = "function"


@dataclass
class CompletionOutput:
    index: int
    text: str = ""  # the whole output text so far (stop strings excluded)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None  # per output token: sampled + top-n {id: Logprob}
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string
    delta_text: str = ""  # text added by the latest step (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    # `LLM.chat(..., tools=...)` / a reasoning parser: what was parsed out of `text` (which stays whole)
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per sample (SamplingParams.n), index 0..n-1
    finished: bool = False
    # set when this request was refused (e.g. a ValueError) or failed by a fault while it ran
    # (a RequestFailedError; finish_reason "error")
    error: Exception | None = None
    num_preemptions: int = 0
    # prompt tokens found in the prefix cache (not recomputed) on admission; with n samples, those
    # of the first (the others share its prompt blocks)
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token (the first None) its own token + the top n
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""


@dataclass
class EmbeddingOutput:
    """One embedding (as vLLM's `EmbeddingOutput`): the pooled vector, cut to `dimensions` and
    normalised as the request asked; empty when the request did not finish normally."""

    embedding: list[float] = field(default_factory=list)


@dataclass
class EmbeddingRequestOutput:
    """The result of an embedding request (`LLM.embed`, /v1/embeddings): `outputs.embedding`.
    `finish_reason` is "stop" for a computed vector, "abort" or "error" otherwise (then `error`
    says why, for a fault)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    finish_reason: str = "stop"
    error: Exception | None = None
    num_cached_tokens: int = 0  # an embedding takes no prefix-cache hit: always 0
