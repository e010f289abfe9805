"""Reasoning parsers: a `<think>…</think>` section of the answer goes to `reasoning_content`.

    deepseek_r1   the answer starts inside the section (R1's templates open it in the prompt, or
                  the model writes `<think>` first); no `</think>` at all: everything is reasoning
    qwen3         the section exists only when the answer starts with `<think>` (or the prompt
                  ends with it); otherwise everything is content (thinking turned off)

Either way a prompt that ends with `<think>` opens the section and one that ends with `</think>`
(a template that turned thinking off) closes it. Whitespace right after `</think>` is dropped
from the content.

`ReasoningStream` splits a streamed answer as it comes, holding back a tail that may still
become a marker; a whole answer goes through the same stream at once, so both agree.
`prefix_grammar` is the Lark that lets a structured output or a forced tool call begin only
after the section: free text up to `</think>` (a lazy lexeme), a little whitespace, then the
constrained part (`@name`, a grammar of its own).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from deepinfer.serving.chat.tool_parsers import special_token_ids

REASONING_PARSER_CHOICES = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningParser:
    """One reasoning format; `special_ids`: its markers that are special tokens, by id."""

    name: str
    starts_inside: bool  # without a marker in the prompt, the answer begins inside the section
    special_ids: Mapping[str, int] | None = None
    START: ClassVar[str] = "<think>"
    END: ClassVar[str] = "</think>"
    markers: ClassVar[tuple[str, ...]] = (START, END)

    def inside_at_start(self, prompt_text: str | None) -> bool:
        """Whether the answer to a prompt rendered as `prompt_text` begins inside the section."""
        tail = (prompt_text or "").rstrip()
        if tail.endswith(self.START):
            return True
        if tail.endswith(self.END):
            return False
        return self.starts_inside

    def stream(self, inside: bool) -> ReasoningStream:
        return ReasoningStream(self, inside)

    def split(self, text: str, inside: bool) -> tuple[str | None, str | None]:
        """A whole answer: (reasoning, content), None for a part that is absent."""
        stream = self.stream(inside)
        reasoning, content = stream.feed(text, final=True)
        return (reasoning if stream.saw_reasoning else None), (content if stream.saw_content else None)

    def prefix_grammar(self, inside: bool, constrained: str) -> str:
        """Lark: the reasoning section (required when `inside`, else optional), then `@constrained`."""
        end, start = self._literal(self.END), self._literal(self.START)
        lazy = "" if end.startswith("<[") else "[lazy]"  # free text cannot produce a special token
        return "\n".join([
            "%llguidance {}",
            f"start: think{'' if inside else '?'} @{constrained}",
            f"think: {start}{'?' if inside else ''} think_end GAP?",
            f"think_end{lazy}: REASONING_TEXT {end}",
            "REASONING_TEXT: /(.|\\n)*/",
            "GAP: /[ \\t\\n]{1,4}/"])

    def _literal(self, text: str) -> str:
        token_id = (self.special_ids or {}).get(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def make_reasoning_parser(name: str | None, tokenizer=None) -> ReasoningParser | None:
    """The parser `--reasoning-parser NAME` names (None: none), its markers' special token ids read
    from `tokenizer`; ValueError naming the flag for an unknown name."""
    if name is None:
        return None
    if name not in REASONING_PARSER_CHOICES:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSER_CHOICES)}, got {name!r}")
    special_ids = special_token_ids(tokenizer, ReasoningParser.markers)
    return ReasoningParser(name, starts_inside=name == "deepseek_r1", special_ids=special_ids)


class ReasoningStream:
    """One answer's text split into (reasoning delta, content delta), step by step.

    States: "open" (inside, a leading `<think>` may still come and is dropped), "reasoning",
    "start" (outside, a leading `<think>` opens the section), "gap" (after `</think>`: whitespace
    dropped), "content"."""

    def __init__(self, parser: ReasoningParser, inside: bool):
        self.parser = parser
        self.state = "open" if inside else "start"
        self.pending = ""  # text not yet given to either side
        self.saw_reasoning = inside
        self.saw_content = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.pending += delta
        reasoning, content = "", ""
        while True:
            before = (self.state, self.pending)
            r, c = self._step(final)
            reasoning, content = reasoning + r, content + c
            if (self.state, self.pending) == before:
                return reasoning, content

    def _step(self, final: bool) -> tuple[str, str]:
        if self.state in ("open", "start"):
            return self._leading(final)
        if self.state == "reasoning":
            return self._reasoning(final)
        if self.state == "gap":
            stripped = self.pending.lstrip()
            self.pending = stripped
            if stripped:
                self.state = "content"
            return "", ""
        text, self.pending = self.pending, ""
        self.saw_content = self.saw_content or bool(text)
        return "", text

    def _leading(self, final: bool) -> tuple[str, str]:
        """Before the first visible character: is there a `<think>`?"""
        start, head = self.parser.START, self.pending.lstrip()
        if head.startswith(start):
            self.pending, self.state, self.saw_reasoning = head[len(start):], "reasoning", True
        elif head and start.startswith(head) and not final or not head and not final:
            return "", ""  # undecided
        else:
            self.state = "reasoning" if self.state == "open" else "content"
        return "", ""

    def _reasoning(self, final: bool) -> tuple[str, str]:
        end = self.parser.END
        at = self.pending.find(end)
        if at >= 0:
            text, self.pending, self.state = self.pending[:at], self.pending[at + len(end):], "gap"
            return text, ""
        keep = 0 if final else _partial_suffix(self.pending, end)
        text, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return text, ""


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` are a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
