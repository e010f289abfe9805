"""A chat answer's text as OpenAI's message: reasoning, content and tool calls, whole or streamed.

    text --ReasoningParser--> reasoning_content
                         \\--> content --ToolParser--> content, tool_calls

`ChatOutputPlan` is what one request asks for (which parsers, and whether the answer starts
inside the reasoning section); each choice of the answer gets its own `ChoiceStream`. A whole
answer goes through `parse` (a text that is not a well-formed call section is all content);
a streamed one through `ChoiceStream.feed`, whose pieces add up to the same message (see
`ToolCallStream` for the one way they may differ). `read` does either for a `CompletionOutput`: an
answer max_tokens cut keeps its complete calls (the call left unfinished at the end is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.outputs import CompletionOutput, ToolCall
from deepinfer.serving.chat.reasoning import ReasoningParser, ReasoningStream
from deepinfer.serving.chat.tool_parsers import ToolCallStream, ToolParser


@dataclass
class ParsedMessage:
    """A whole answer: each part None when absent."""

    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class MessageDelta:
    """One step's new pieces of a streamed answer."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class ChatOutputPlan:
    """How one request's answers are read: `tool_parser` when tool calls are parsed, `reasoning`
    with a reasoning parser (`inside`: the answer begins inside its section)."""

    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    inside: bool = False

    @property
    def parses(self) -> bool:
        return self.tool_parser is not None or self.reasoning is not None

    def parse(self, text: str, cut: bool = False) -> ParsedMessage:
        """`cut`: max_tokens ended the answer (its complete calls are kept, see `ToolParser.parse`)."""
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.split(text, self.inside)
        if self.tool_parser is None or content is None:
            return ParsedMessage(reasoning, content)
        parsed = self.tool_parser.parse(content, cut)
        return ParsedMessage(reasoning, parsed.content, parsed.tool_calls)

    def read(self, output: CompletionOutput) -> ParsedMessage:
        """A finished completion's message."""
        return self.parse(output.text, cut=is_cut(output))

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One choice of a streamed answer: `feed(delta_text, finished)` -> MessageDelta."""

    def __init__(self, plan: ChatOutputPlan):
        self._reasoning: ReasoningStream | None = None if plan.reasoning is None else \
            plan.reasoning.stream(plan.inside)
        self._tools = None if plan.tool_parser is None else ToolCallStream(plan.tool_parser)

    @property
    def num_calls(self) -> int:
        return 0 if self._tools is None else self._tools.num_calls

    def feed(self, delta: str, finished: bool = False, cut: bool = False) -> MessageDelta:
        """`cut`: max_tokens ended the answer (with `finished`)."""
        reasoning, content = ("", delta) if self._reasoning is None else self._reasoning.feed(delta, finished)
        if self._tools is None:
            return MessageDelta(reasoning, content)
        content, calls = self._tools.feed(content, final=finished, cut=cut)
        return MessageDelta(reasoning, content, calls)

    def read(self, output: CompletionOutput) -> MessageDelta:
        """One step's pieces of a streamed completion."""
        return self.feed(output.delta_text, output.finished, is_cut(output))


def is_cut(output: CompletionOutput) -> bool:
    """Whether max_tokens (or the context) ended the answer."""
    return output.finish_reason == "length"
