"""The tool-call parser interface, and what every format shares.

A parser knows one wire format of tool calls in a model's output (Hermes' `<tool_call>` blocks,
Llama 3's bare JSON, Mistral's `[TOOL_CALLS]` list, DeepSeek V3's `<｜tool▁calls▁begin｜>`
section). It does three things with it:

- `scan(text, final)`: the text seen so far split into the content outside calls (without a
  trailing piece that may still become a marker) and the calls begun, each with its name once
  written whole and its arguments' JSON text so far. Scanning the whole text again at each step
  keeps one code path for whole answers and streams.
- `parse(text)`: a whole answer as OpenAI's `message`: the calls, or, when the text is not a
  well-formed call section, no calls and the whole text as content.
- `call_grammar(functions, parallel)`: the Lark grammar (llguidance) of a forced call in this format,
  with each function's arguments constrained by its JSON schema (`%json`).

A forced answer may end after every complete call, spelled as the chat template writes it, and
before its end of turn one or two blank characters are allowed (`END_BLANKS`): a model that
writes `\n` and then EOS after its call ends there. Between parallel calls comes only what the
template writes between them, and it commits to nothing: after `</tool_call>\n` the grammar
still allows EOS, so a newline the model likes to write is never read as "another call".

Markers that are one added token of the tokenizer (`special_ids`; special or not, as Qwen's
`<tool_call>` in a GGUF) are written `<[id]>` in grammars: llguidance lexes added tokens as
special tokens, which a string literal never matches. The server keeps special tokens in the
decoded text when a marker is one that decoding would drop.
"""

from __future__ import annotations

import abc
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from deepinfer.outputs import FunctionCall, ToolCall


@dataclass(frozen=True)
class FunctionSpec:
    """A function a request offers: its name and the JSON schema (an object) of its arguments."""

    name: str
    parameters: dict


@dataclass
class CallScan:
    """One call begun in the text: `name` once written whole, `arguments` its JSON text so far
    (whole once `done`)."""

    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class Scan:
    """`content`: the text outside calls that may be shown now; `calls` in order; `failed_at`: where
    the text stopped being a well-formed call section (None while it is one)."""

    content: str = ""
    calls: list[CallScan] = field(default_factory=list)
    failed_at: int | None = None


@dataclass
class ParsedToolCalls:
    """A whole answer: content (None when the calls are all there is) and the calls."""

    content: str | None
    tool_calls: list[ToolCall]


class ToolParser(abc.ABC):
    """One wire format of tool calls; see the module docstring."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # the format's fixed strings (special tokens in some checkpoints)

    def __init__(self, special_ids: Mapping[str, int] | None = None, chat_template: str = ""):
        self.special_ids = dict(special_ids or {})
        self.chat_template = chat_template

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        """Whether a chat template writes tool calls in this format (by default: it writes the first marker)."""
        return bool(cls.markers) and cls.markers[0] in chat_template

    @abc.abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """The text so far; `final`: nothing more will come (withhold nothing, accept what may end here)."""

    @abc.abstractmethod
    def call_grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        """Lark text: one call of any of `functions` (one or more, separated as the format does,
        when `parallel`), each function's arguments matching its schema."""

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def parse(self, text: str, cut: bool = False) -> ParsedToolCalls:
        """`cut`: max_tokens ended the answer. Its complete calls are kept and a call left unfinished
        at the end is dropped; an answer that is not a well-formed call section otherwise is all content."""
        scan = self.scan(text, final=True)
        complete = complete_calls(scan.calls)
        whole = scan.failed_at is None and len(complete) == len(scan.calls)
        if not complete or not (whole or cut):
            return ParsedToolCalls(text, [])
        tool_calls = [ToolCall(self.new_call_id(), FunctionCall(c.name, c.arguments)) for c in complete]
        return ParsedToolCalls(scan.content.strip() or None, tool_calls)

    # -- grammar pieces -------------------------------------------------------------------------

    def literal(self, text: str) -> str:
        """A fixed string in Lark: the special token's id when it is one, else the quoted text."""
        token_id = self.special_ids.get(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)

    @staticmethod
    def calls_rule(call_rule: str, separator: str, parallel: bool) -> str:
        """One call, or (`parallel`) one or more with `separator` (Lark; "" for none) between them."""
        if not parallel:
            return call_rule
        return f"{call_rule} ({separator} {call_rule})*" if separator else f"{call_rule}+"

    @classmethod
    def start_rule(cls, call_rule: str, separator: str, parallel: bool) -> str:
        """`start:` the calls, then the answer may end (after END_BLANKS); the END_BLANKS terminal too."""
        return f"start: {cls.calls_rule(call_rule, separator, parallel)} END_BLANKS?\n{END_BLANKS_RULE}"


# blank characters a forced answer may write before its end of turn (a model trained on
# `</tool_call><|im_end|>` may still put `\n` first); bounded, so they never run on
END_BLANKS_RULE = r"END_BLANKS: /[ \t\r\n]{1,2}/"


def complete_calls(calls: list[CallScan]) -> list[CallScan]:
    """The calls up to the first one that is not complete (its name and arguments written whole, the
    arguments a JSON object)."""
    complete = []
    for call in calls:
        if not (call.done and call.name and is_object(call.arguments)):
            break
        complete.append(call)
    return complete


def is_object(arguments: str) -> bool:
    """Whether `arguments` is the JSON text of an object."""
    try:
        return isinstance(json.loads(arguments), dict)
    except (ValueError, RecursionError):  # the model's text: RecursionError when it nests ~1000 deep
        return False
