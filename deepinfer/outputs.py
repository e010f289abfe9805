"""What the offline API and the server return. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    error: Exception | None = None  # set when this request was refused (e.g. a ValueError)
    num_preemptions: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""
