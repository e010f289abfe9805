"""Admission by work: cheap bounds on a text before it is tokenized, and each client's share.

Prompt bounds. A text whose tokens cannot fit the context is refused before it is tokenized, by
a character bound: no token covers more than `max_chars_per_token` characters (the longest
string in the vocabulary, the added tokens included), so a text of more than max_model_len times
that many characters has more than max_model_len tokens. The bound holds only while the
tokenizer's normalizer cannot shorten text much: none, Unicode normal forms (which may join up to
UNICODE_SHRINK characters into one: the bound is widened by that factor), lowercasing, prepending,
or replacing one character by one; any other normalizer (stripping, collapsing whitespace) gets no
character bound, and its texts are counted in tokens only.

Client shares. A client is its peer address (the server has one API key at most, shared by all
its clients, so a key tells no client from another; a header a client chooses, such as
X-Forwarded-For, is not trusted: behind a proxy every client is the proxy). `ClientShares` counts
each client's admitted requests in flight (from the start of the request until its answer, a
stream included, is sent) and answers a 429 (`queue_full`) to the client that already has
`limit` of them, before its body is read; other clients keep getting in. One request's own work
is bounded where it is done (an embeddings request runs at most a window of its inputs at a time).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

from deepinfer.entrypoints.openai.errors import APIError, bad_request

UNICODE_SHRINK = 4  # NFC/NFKC join at most 3 code points into one (Hangul syllables); with margin
_UNICODE_FORMS = frozenset({"NFC", "NFKC", "NFD", "NFKD"})
_LENGTH_KEEPING = frozenset({"Prepend", "Lowercase", "Replace"})
ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
                            "/tokenize", "/detokenize", "/v1/messages", "/v1/messages/count_tokens",
                            "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score", "/infill",
                            "/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show"})


class PromptBounds:
    """The input limits every route applies: a character bound before tokenizing, a token bound after."""

    def __init__(self, tokenizer, max_model_len: int):
        self.max_model_len = max_model_len
        per_token = max_chars_per_token(tokenizer)
        self.max_chars = None if per_token is None else max_model_len * per_token

    def check_text(self, text: str, param: str, name: str | None = None) -> None:
        """A 400 (context_length_exceeded) naming `param` (the message `name`, e.g. `input[3]`) for a
        text too long to fit in tokens."""
        if self.max_chars is not None and len(text) > self.max_chars:
            raise bad_request(f"{name or param} has {len(text)} characters, more than the {self.max_chars} that "
                              f"this model's maximum context length of {self.max_model_len} tokens can hold; "
                              f"shorten it", param, code="context_length_exceeded")

    def check_tokens(self, num_tokens: int, param: str) -> None:
        """A 400 (context_length_exceeded) naming `param` for more than max_model_len tokens."""
        if num_tokens > self.max_model_len:
            raise bad_request(f"{param} has {num_tokens} tokens, but this model's maximum context length is "
                              f"{self.max_model_len} tokens; shorten it", param, code="context_length_exceeded")


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of text one token can stand for; None when the tokenizer's normalizer
    may shorten text (or there is no tokenizer), so no character bound is sound."""
    if tokenizer is None:
        return None
    factor = _normalizer_factor(_normalizer_spec(tokenizer))
    if factor is None:
        return None
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
    return max(1, longest) * factor


def _normalizer_spec(tokenizer) -> dict | None | bool:
    """The backend normalizer's JSON (None: no normalizer); False when it cannot be read (no
    `tokenizers` backend)."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return False
    backend = tokenizer.backend_tokenizer
    try:
        return json.loads(backend.to_str()).get("normalizer")
    except (ValueError, AttributeError):
        return False


def _normalizer_factor(spec) -> int | None:
    """How many times shorter a normalizer may make a text (1: never shorter); None: unbounded."""
    if spec is None:
        return 1
    if not isinstance(spec, dict):
        return None
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            inner = _normalizer_factor(part)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind in _UNICODE_FORMS:
        return UNICODE_SHRINK
    if kind == "Replace" and not _replaces_one_char(spec):
        return None
    return 1 if kind in _LENGTH_KEEPING else None


def _replaces_one_char(spec: dict) -> bool:
    pattern = spec.get("pattern", {})
    return len(pattern.get("String", "")) == 1 and len(spec.get("content", "")) >= 1


def client_key(scope: dict) -> str:
    """Who sent the request: its peer address."""
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:unknown"


class ClientShares:
    """ASGI middleware: at most `limit` admitted requests in flight per client (module docstring)."""

    def __init__(self, app, limit: int, retry_after_s: int = 1,
                 accepting: Callable[[], bool] = lambda: True):
        if limit < 1:
            raise ValueError(f"max_requests_per_client must be at least 1, got {limit}")
        self.app, self.limit, self.retry_after_s = app, limit, retry_after_s
        self.accepting = accepting  # False: shutting down (the route's 503 goes before any 429)
        self.in_flight: Counter[str] = Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in ADMITTED_PATHS:
            return await self.app(scope, receive, send)
        client = client_key(scope)
        if self.in_flight[client] >= self.limit and self.accepting():
            return await self._refuse(client, scope, receive, send)
        self.in_flight[client] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[client] -= 1
            if self.in_flight[client] <= 0:
                del self.in_flight[client]

    async def _refuse(self, client: str, scope, receive, send) -> None:
        error = APIError(429, f"too many requests from this client: {self.in_flight[client]} are in flight "
                         f"(limit {self.limit} per client); retry later", "rate_limit_error", code="queue_full",
                         headers={"Retry-After": str(self.retry_after_s)})
        await error.response()(scope, receive, send)
