"""StructuredOutputsParams: constrain a request's output to a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a context-free grammar. Pure Python (no torch).

The grammar engine is llguidance. Each spec is turned into llguidance's grammar text here, at
construction, and checked (a bad schema, regex or grammar raises ValueError naming the field and
the value), so a bad request is refused when it is added, never in the middle of a batch. The
worker (`deepinfer.worker.structured`) compiles each distinct grammar text once against the
tokenizer and masks logits with it.

    StructuredOutputsParams(json={"type": "object", ...})   # a JSON schema (dict or JSON string)
    StructuredOutputsParams(json_object=True)               # any JSON object
    StructuredOutputsParams(regex=r"\\d{3}-\\d{4}")          # Rust `regex` syntax
    StructuredOutputsParams(choice=["yes", "no"])
    StructuredOutputsParams(grammar='start: "a"+')          # Lark, or llama.cpp GBNF (`root ::= ...`)

JSON is generated without free whitespace, with ", " and ": " separators (as `json.dumps`): a
small model given free whitespace may emit newlines until max_tokens. A schema may choose other
options through llguidance's "x-guidance" key.

Reported logprobs are those of the masked distribution (forbidden tokens: -inf), as in vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# defaults -> schema["x-guidance"] -> (no overrides)
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_SHOWN = 80


def grammar_engine():
    """llguidance, imported on first use: the engine runs without it (a GPU image may lack it)
    until a request asks for structured output, which then fails naming the fix."""
    try:
        import llguidance
    except ImportError as exc:
        raise ValueError("structured output needs llguidance, which is not installed: "
                         "pip install 'llguidance>=1.9,<1.10'") from exc
    return llguidance


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the kinds; validated on construction (ValueError names the field).

    `grammar_text` (derived) is llguidance's grammar for the spec; two specs with the same text
    share one compiled grammar in the worker."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    grammar_text: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self):
        set_kinds = [k for k in _KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if self.json_object is not False and self.json_object is not True:
            raise ValueError(f"structured_output.json_object must be true or false, got {_short(self.json_object)}")
        if len(set_kinds) != 1:
            raise ValueError(f"structured_output must set exactly one of {', '.join(_KINDS)}; "
                             f"got {', '.join(set_kinds) or 'none'}")
        kind = set_kinds[0]
        text = _grammar_of(kind, getattr(self, kind))
        error = grammar_engine().LLMatcher.validate_grammar(text)
        if error:
            raise ValueError(f"structured_output.{kind} is invalid: {_first_lines(error)}; "
                             f"got {_short(getattr(self, kind))}")
        object.__setattr__(self, "grammar_text", text)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object))

    @classmethod
    def from_value(cls, value) -> StructuredOutputsParams | None:
        """None, an instance, or a dict of its fields (as a JSON body sends it) -> an instance."""
        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_output must be a StructuredOutputsParams or a dict with one of "
                             f"{', '.join(_KINDS)}, got {_short(value)}")
        unknown = sorted(set(value) - set(_KINDS))
        if unknown:
            raise ValueError(f"structured_output has unknown field {unknown[0]!r}; known: {', '.join(_KINDS)}")
        return cls(**value)


def _grammar_of(kind: str, value) -> str:
    """llguidance's grammar text for one spec; ValueError for a value of the wrong type."""
    if kind == "json_object":
        return _json_grammar({"type": "object"})
    if kind == "json":
        return _json_grammar(_schema(value))
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or \
                not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"structured_output.choice must be a non-empty list of non-empty strings, "
                             f"got {_short(value)}")
        return grammar_engine().grammar_from("choice", list(value))
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_output.{kind} must be a non-empty string, got {_short(value)}")
    if kind == "regex":
        return grammar_engine().LLMatcher.grammar_from_regex(value)
    try:  # Lark as is; GBNF (`root ::= ...`) converted to Lark
        return grammar_engine().grammar_from("grammar", value)
    except ValueError as exc:
        raise ValueError(f"structured_output.grammar is invalid: {_first_lines(str(exc))}; got {_short(value)}") \
            from None


def _schema(value) -> dict:
    """A JSON schema given as a dict or a JSON string -> the dict."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_output.json is not valid JSON ({exc}); got {_short(value)}") from None
    if isinstance(value, bool):  # `true` and `false` are schemas too, but not useful ones here
        raise ValueError(f"structured_output.json must be a JSON schema object, got {_short(value)}")
    if not isinstance(value, dict):
        raise ValueError(f"structured_output.json must be a JSON schema object, got {_short(value)}")
    return value


def _json_grammar(schema: dict) -> str:
    try:
        return grammar_engine().LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"structured_output.json is invalid: {_first_lines(str(exc))}; got {_short(schema)}") \
            from None


def _first_lines(message: str, limit: int = 3) -> str:
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    return " / ".join(lines[:limit])


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else f"{text[:_MAX_SHOWN]}... ({len(text)} characters)"
