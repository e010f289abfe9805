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

Limits (README, "Request limits"): a choice holds at most MAX_CHOICES strings of MAX_CHOICE_CHARS
characters in all; a regex, a grammar or a schema (as JSON text) at most MAX_SPEC_CHARS characters;
a schema nests at most MAX_JSON_DEPTH deep (`deepinfer.json_bounds`, as a request body).
Every matcher runs under llguidance's resource limits (`grammar_limits`).

Before a request is admitted, `GrammarCompiler` compiles its grammar completely (a real matcher
against the model's tokenizer, then a short walk of PROBE_STEPS tokens through it), so that
llguidance's refusals (recursion without end, a self-referencing schema, a regex or a row that
passes its limits) are found there, within COMPILE_BUDGET_S, and never on the engine thread. The
compiled matcher travels with the spec (`StructuredOutputsParams.compiled`) to the worker, which
copies it per request. A grammar that fails later, while the request runs, raises
`StructuredOutputError`: that request alone ends (finish_reason "error").
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deepinfer.json_bounds import MAX_JSON_DEPTH, check_json_depth, parse_nested_json

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# defaults -> schema["x-guidance"] -> (no overrides)
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_SHOWN = 80
MAX_CHOICES = 1024  # strings in a choice
MAX_CHOICE_CHARS = 65_536  # characters of all choice strings together
MAX_SPEC_CHARS = 131_072  # characters of a regex, a grammar, or a JSON schema as JSON text
COMPILE_BUDGET_S = 5.0  # wall time a grammar may take to compile and walk before admission
PROBE_STEPS = 8  # tokens the admission walk takes through a compiled grammar
_MAX_COMPILED = 64  # distinct grammars a GrammarCompiler keeps compiled (LRU)


class StructuredOutputError(ValueError):
    """A request's grammar cannot be used or cannot go on (llguidance refused it, or no token is
    left to sample): the request's own doing, not the server's. The message is short (llguidance's
    first lines) and names the field or the request."""


def grammar_engine():
    """llguidance, imported on first use: the engine runs without it (a GPU image may lack it)
    until a request asks for structured output, which then fails naming the fix."""
    try:
        import llguidance
    except ImportError as exc:
        raise ValueError("structured output needs llguidance, which is not installed: "
                         "pip install 'llguidance>=1.9,<1.10'") from exc
    return llguidance


def grammar_limits():
    """llguidance's resource limits for every matcher: its defaults (a row of at most 2000 items,
    50k Earley items and 200k lexer fuel per mask, 1M fuel to build the lexer, 250k lexer states,
    grammars of 500k symbols), with short errors (no parser state dump in messages and logs)."""
    return grammar_engine().LLParserLimits(verbose_errors=False)


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
    # Set by GrammarCompiler.prepare before admission; never pickled (a matcher cannot be)
    compiled: CompiledGrammar | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        given = self.given()
        set_kinds = list(given)
        if self.json_object is not False and self.json_object is not True:
            raise ValueError(f"structured_output.json_object must be true or false, got {_short(self.json_object)}")
        if len(set_kinds) != 1:
            raise ValueError(f"structured_output must set exactly one of {', '.join(_KINDS)}; "
                             f"got {', '.join(set_kinds) or 'none'}")
        kind, value = next(iter(given.items()))
        text = _grammar_of(kind, value)
        error = grammar_engine().LLMatcher.validate_grammar(text, limits=grammar_limits())
        if error:
            raise ValueError(f"structured_output.{kind} is invalid: {_first_lines(error)}; "
                             f"got {_short(value)}")
        object.__setattr__(self, "grammar_text", text)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "compiled": None}

    def __setstate__(self, state: dict) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)

    def given(self) -> dict[str, object]:
        """The kinds this spec sets, in `_KINDS` order, with their values (json_object when true)."""
        values = {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object}
        return {k: v for k, v in values.items() if (v is not None if k != "json_object" else v)}

    @property
    def kind(self) -> str:
        return next(iter(self.given()))

    def lazy_parts(self) -> tuple[str, ...]:
        """Grammar texts inside `grammar_text` that llguidance builds only once generation reaches
        them (a sub-grammar after a prefix, e.g. the reasoning section's); admission
        (`GrammarCompiler.prepare`) compiles and checks each as a spec of its own first. A plain
        spec has none."""
        return ()

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
        _check_choice(value)
        return grammar_engine().grammar_from("choice", list(value))
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_output.{kind} must be a non-empty string, got {_short(value)}")
    if len(value) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_output.{kind} has {len(value)} characters; the limit is {MAX_SPEC_CHARS}")
    if kind == "regex":
        return grammar_engine().LLMatcher.grammar_from_regex(value)
    try:  # Lark as is; GBNF (`root ::= ...`) converted to Lark
        return grammar_engine().grammar_from("grammar", value)
    except ValueError as exc:
        raise ValueError(f"structured_output.grammar is invalid: {_first_lines(str(exc))}; got {_short(value)}") \
            from None


def _check_choice(value) -> None:
    """A non-empty list of non-empty strings within MAX_CHOICES and MAX_CHOICE_CHARS."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"structured_output.choice must be a non-empty list of non-empty strings, "
                         f"got {_short(value)}")
    if len(value) > MAX_CHOICES:
        raise ValueError(f"structured_output.choice has {len(value)} strings; the limit is {MAX_CHOICES}")
    if not all(isinstance(c, str) and c for c in value):
        raise ValueError(f"structured_output.choice must be a non-empty list of non-empty strings, "
                         f"got {_short(value)}")
    total = sum(len(c) for c in value)
    if total > MAX_CHOICE_CHARS:
        raise ValueError(f"structured_output.choice has {total} characters in all; the limit is "
                         f"{MAX_CHOICE_CHARS}")


def _schema(value) -> dict:
    """A JSON schema given as a dict or a JSON string (read under the request body's bounds) -> the dict."""
    if isinstance(value, str):
        value = parse_nested_json(value, "structured_output.json")
    if isinstance(value, bool):  # `true` and `false` are schemas too, but not useful ones here
        raise ValueError(f"structured_output.json must be a JSON schema object, got {_short(value)}")
    if not isinstance(value, dict):
        raise ValueError(f"structured_output.json must be a JSON schema object, got {_short(value)}")
    try:
        text = json.dumps(value)
    except RecursionError:  # a dict nested ~1000 deep (LLM's callers; a server's bodies are bounded)
        raise ValueError(f"structured_output.json nests arrays and objects about a thousand deep; the limit "
                         f"is {MAX_JSON_DEPTH}") from None
    check_json_depth(text, "structured_output.json")
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_output.json has {len(text)} characters as JSON; the limit is {MAX_SPEC_CHARS}")
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


def first_lines(message: str, limit: int = 2, max_chars: int = 300) -> str:
    """llguidance's message shortened for a client or a log line: its first lines (without
    markup such as `<non-verbose/>` or a state dump), bounded."""
    text = _first_lines("\n".join(line for line in (message or "").splitlines()
                                  if not line.lstrip().startswith("<")), limit)
    return text if len(text) <= max_chars else text[:max_chars] + "..."


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar's llguidance matcher at its start (copy it per request with `deep_copy`), the
    vocabulary and EOS ids it was compiled for, and its first mask (bit t: token t allowed)."""

    matcher: Any
    vocab_size: int
    eos_token_ids: frozenset[int]
    first_allowed: int

    def fits(self, vocab_size: int, eos_token_ids: Iterable[int]) -> bool:
        return vocab_size == self.vocab_size and frozenset(eos_token_ids) == self.eos_token_ids


class GrammarCompiler:
    """Compiles StructuredOutputsParams against one tokenizer, completely: an llguidance matcher
    under `grammar_limits()`, its first mask, then a walk of PROBE_STEPS tokens (the first allowed
    token that is neither EOS nor banned, each step), all within `budget_s`. Refusals raise
    StructuredOutputError naming `structured_output.<kind>` and llguidance's reason.

    Thread-safe: the tokenizer's llguidance view is built once, under a lock (about half a second
    for 49k tokens); compiled grammars are kept by grammar text (LRU), so a grammar sent again is
    not compiled again. Pure Python apart from llguidance (no torch)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int], budget_s: float = COMPILE_BUDGET_S):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.budget_s = budget_s
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._compiled: OrderedDict[str, CompiledGrammar | str] = OrderedDict()  # text -> grammar or refusal

    def prepare(self, spec: StructuredOutputsParams, banned_first: Iterable[int] = ()) -> CompiledGrammar:
        """Compile `spec` (unless it carries a fitting compiled grammar) and attach the result;
        StructuredOutputError when llguidance refuses it or when every first token it allows is
        in `banned_first` (e.g. the one-token bad_words)."""
        compiled = spec.compiled
        banned = token_bits(banned_first, self.vocab_size)
        if compiled is None or not compiled.fits(self.vocab_size, self.eos_token_ids):
            for text in spec.lazy_parts():  # refused (or not) exactly as when sent on its own
                _check_first_token(self.compile_text(text, spec.kind), banned, spec.kind)
            compiled = self.compile(spec)
            object.__setattr__(spec, "compiled", compiled)
        _check_first_token(compiled, banned, spec.kind)
        return compiled

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `spec` (see `compile_text`)."""
        return self.compile_text(spec.grammar_text, spec.kind)

    def compile_text(self, text: str, kind: str) -> CompiledGrammar:
        """The compiled grammar text of a spec of `kind` (refusals name `structured_output.<kind>`);
        a text seen before (compiled or refused) is answered from the LRU."""
        with self._lock:
            known = self._compiled.get(text)
            if known is not None:
                self._compiled.move_to_end(text)
        if known is None:
            try:
                known = self._compile(text, f"structured_output.{kind}")
            except StructuredOutputError as exc:
                known = str(exc)
            with self._lock:
                self._compiled[text] = known
                if len(self._compiled) > _MAX_COMPILED:
                    self._compiled.popitem(last=False)
        if isinstance(known, str):
            raise StructuredOutputError(known)
        return known

    def _compile(self, text: str, field_name: str) -> CompiledGrammar:
        ll_tokenizer = self.ll_tokenizer()
        start = time.monotonic()
        matcher = grammar_engine().LLMatcher(ll_tokenizer, text, log_level=0, limits=grammar_limits())
        first = self._first_mask(matcher, field_name)
        self._walk(matcher.deep_copy(), field_name, start)
        return CompiledGrammar(matcher, self.vocab_size, self.eos_token_ids, first)

    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (every token's bytes), built once."""
        with self._lock:
            if self._ll_tokenizer is None:
                if self.tokenizer is None:
                    raise ValueError("structured_output needs the model's tokenizer, and this model has none")
                grammar_engine()
                import llguidance.hf  # imports transformers: only when structured output is used

                eos = sorted(self.eos_token_ids) or None
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=eos)
            return self._ll_tokenizer

    def _first_mask(self, matcher, field_name: str) -> int:
        """The matcher's next-token mask as an int (bit t: token t allowed); refusals raise."""
        mask = matcher.compute_bitmask() if not matcher.is_error() else b""
        if matcher.is_error():
            raise StructuredOutputError(f"{field_name} cannot be used: {first_lines(matcher.get_error())}")
        allowed = int.from_bytes(mask, "little") & ((1 << self.vocab_size) - 1)
        if allowed == 0:
            raise StructuredOutputError(f"{field_name} allows no token")
        return allowed

    def _walk(self, matcher, field_name: str, start: float) -> None:
        """Take up to PROBE_STEPS tokens through the grammar (each step the lowest allowed id
        that is not EOS); llguidance's refusals on the way, or the budget running out, raise."""
        eos = token_bits(self.eos_token_ids, self.vocab_size)
        for _ in range(PROBE_STEPS):
            if matcher.is_stopped():
                break
            candidates = self._first_mask(matcher, field_name) & ~eos
            if candidates == 0:  # only EOS: the grammar is complete
                break
            token = (candidates & -candidates).bit_length() - 1
            if not matcher.consume_token(token) or matcher.is_error():
                raise StructuredOutputError(f"{field_name} cannot be used: {first_lines(matcher.get_error())}")
            self._check_budget(field_name, start)
        self._check_budget(field_name, start)

    def _check_budget(self, field_name: str, start: float) -> None:
        elapsed = time.monotonic() - start
        if elapsed > self.budget_s:
            raise StructuredOutputError(f"{field_name} took {elapsed:.1f} s to compile; the limit is "
                                        f"{self.budget_s:g} s")


def _check_first_token(compiled: CompiledGrammar, banned: int, kind: str) -> None:
    """StructuredOutputError when every first token `compiled` allows is in `banned` (token bits)."""
    if compiled.first_allowed & ~banned == 0:
        raise StructuredOutputError(f"structured_output.{kind} allows no first token that bad_words does not ban")


def token_bits(token_ids: Iterable[int], vocab_size: int) -> int:
    """Token ids -> an int with bit t set for each id t in [0, vocab_size)."""
    bits = bytearray((vocab_size + 7) // 8)
    for t in token_ids:
        if 0 <= t < vocab_size:
            bits[t >> 3] |= 1 << (t & 7)
    return int.from_bytes(bits, "little")


def structured_output_failure(error: BaseException | str | None) -> str | None:
    """The reason a request failed, when a StructuredOutputError ended it (the engine's one-line
    fault message names the exception's type: "sampling failed: StructuredOutputError: ..."),
    else None."""
    marker = f"{StructuredOutputError.__name__}: "
    text = str(error or "")
    return text.split(marker, 1)[1] if marker in text else None
