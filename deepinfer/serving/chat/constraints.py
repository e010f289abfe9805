"""The grammar of a chat answer: the request's structured output or a forced tool call, placed
after the reasoning section when a reasoning parser is on.

`ConstrainedOutput` is a StructuredOutputsParams (so the compiler, the worker and their limits
treat it as any other) whose grammar text is llguidance's grammar list

    [ {name: "reasoning", lark: <the section> @constrained},  {name: "constrained", ...the spec's grammar} ]

or the spec's own grammar when there is no section. A forced call is a spec of kind `grammar`
(Lark), so a refusal names `structured_output.grammar`; the server names `tool_choice` instead (diagnostics.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from deepinfer.serving.chat.reasoning import ReasoningParser
from deepinfer.structured_output import StructuredOutputsParams, grammar_engine, grammar_limits

CONSTRAINED = "constrained"


@dataclass(frozen=True)
class ConstrainedOutput(StructuredOutputsParams):
    """A structured output after an optional prefix grammar (Lark referring to `@constrained`).
    llguidance builds the `@constrained` part only when generation reaches it, so admission
    compiles it on its own too (`lazy_parts`): a spec is refused alike with and without a prefix."""

    prefix: str = ""
    constrained_text: str = field(default="", init=False, repr=False, compare=False)  # the spec's own grammar

    def __post_init__(self):
        super().__post_init__()
        if not self.prefix:
            return
        object.__setattr__(self, "constrained_text", self.grammar_text)
        text = after_prefix(self.prefix, self.grammar_text)
        error = grammar_engine().LLMatcher.validate_grammar(text, limits=grammar_limits())
        if error:
            raise ValueError(f"structured_output.{self.kind} is invalid after the reasoning section: "
                             f"{error.strip().splitlines()[0]}")
        object.__setattr__(self, "grammar_text", text)

    def lazy_parts(self) -> tuple[str, ...]:
        return (self.constrained_text,) if self.prefix else ()


def after_prefix(prefix: str, grammar_text: str) -> str:
    """llguidance's grammar list: `prefix` first, then `grammar_text`'s grammars, the first named
    CONSTRAINED (what the prefix's `@constrained` refers to)."""
    if grammar_text.lstrip().startswith("{"):
        grammars = json.loads(grammar_text)["grammars"]
    else:  # Lark text
        grammars = [{"lark_grammar": grammar_text}]
    first = {**grammars[0], "name": CONSTRAINED}
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": prefix}, first, *grammars[1:]]})


def constrained(spec: StructuredOutputsParams | None, reasoning: ReasoningParser | None,
                inside: bool) -> StructuredOutputsParams | None:
    """`spec` placed after the reasoning section (unchanged without a reasoning parser)."""
    if spec is None or reasoning is None:
        return spec
    return ConstrainedOutput(**spec.given(), prefix=reasoning.prefix_grammar(inside, CONSTRAINED))


def forced_call(grammar: str, reasoning: ReasoningParser | None, inside: bool) -> StructuredOutputsParams:
    """A forced call's Lark as a structured output, after the reasoning section when there is one."""
    prefix = reasoning.prefix_grammar(inside, CONSTRAINED) if reasoning is not None else ""
    return ConstrainedOutput(grammar=grammar, prefix=prefix)
