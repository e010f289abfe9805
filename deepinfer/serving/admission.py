"""Admission: cheap bounds on a text before it is tokenized, each client's seats, and the priority a
client may ask for.

Prompt bounds. A text whose tokens cannot fit the context is refused before it is tokenized, by
a character bound: no token covers more than `max_chars_per_token` characters (the longest
string in the vocabulary, the added tokens included), so a text of more than max_model_len times
that many characters has more than max_model_len tokens. The bound holds only while the
tokenizer's normalizer cannot shorten text much: none, Unicode normal forms (which may join up to
UNICODE_SHRINK characters into one: the bound is widened by that factor), lowercasing, prepending,
or replacing one character by one; any other normalizer (stripping, collapsing whitespace) gets no
character bound, and its texts are counted in tokens only.

Client seats. A client is its tenant (the hash of the API key it presents) when the server checks
keys, else its peer address (a header a client chooses, such as X-Forwarded-For, is not trusted:
behind a proxy every client is the proxy; behind a data-parallel front end, the client the front end
names beside the cluster secret, `tenancy.forwarded_client`). `ClientSeats` counts each client's work in flight: one
seat per request from its start until its answer (a stream included) is sent, and one more per
input an embeddings request has in the engine beyond its first. A new request of a client whose
seats are all taken is a 429 (`queue_full`), before its body is read; an embeddings window only
grows while its client has seats free. So one client can hold at most its `limit` of the engine's
queue, and other clients keep getting in.

Priority. `priority` (lower is served first) is the client's to choose only within
`--priority-range MIN:MAX`; by default MIN is 0, so a client may lower its own requests'
precedence but never raise it above another client's. An operator key may send any priority.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from deepinfer.serving.errors import ServingError, bad_request, too_busy
from deepinfer.serving.tenancy import Credentials, Tenant, forwarded_client

UNICODE_SHRINK = 4  # NFC/NFKC join at most 3 code points into one (Hangul syllables); with margin
_UNICODE_FORMS = frozenset({"NFC", "NFKC", "NFD", "NFKD"})
_LENGTH_KEEPING = frozenset({"Prepend", "Lowercase", "Replace"})


class PromptBounds:
    """The input limits every route applies: a character bound before tokenizing, a token bound after."""

    def __init__(self, tokenizer, max_model_len: int):
        self.max_model_len = max_model_len
        per_token = max_chars_per_token(tokenizer)
        self.max_chars = None if per_token is None else max_model_len * per_token

    def check_text(self, text: str, path) -> None:
        """A 400 (context_length_exceeded) naming `path` (e.g. ("input", 3)) for a text too long to fit
        in tokens."""
        if self.max_chars is not None and len(text) > self.max_chars:
            raise bad_request(f"has {len(text)} characters, more than the {self.max_chars} that this model's "
                              f"maximum context length of {self.max_model_len} tokens can hold; shorten it",
                              path, code="context_length_exceeded")

    def check_tokens(self, num_tokens: int, path) -> None:
        """A 400 (context_length_exceeded) naming `path` for more than max_model_len tokens."""
        if num_tokens > self.max_model_len:
            raise bad_request(f"has {num_tokens} tokens, but this model's maximum context length is "
                              f"{self.max_model_len} tokens; shorten it", path, code="context_length_exceeded")


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


def client_key(headers, peer: str | None, credentials: Credentials, secret: str | None = None) -> str:
    """Whom a request's seats count for: the client a data-parallel front end names (believed beside
    this replica's cluster `secret` only), else the tenant of an accepted key it presents, else its peer
    address (a made-up key names nobody, so it buys no share). `headers(name)` gives a header's values."""
    forwarded = forwarded_client(headers, secret)
    if forwarded is not None:
        return forwarded
    if credentials.checked:
        try:
            return credentials.tenant(headers, x_api_key=True).id
        except ServingError:  # no key, a wrong one, or one sent twice: the key check answers it
            pass
    return f"addr:{peer or 'unknown'}"


class ClientSeats:
    """Each client's seats in flight (module docstring), counted on the event loop."""

    def __init__(self, limit: int, retry_after_s: int = 1):
        if limit < 1:
            raise ValueError(f"max_requests_per_client must be at least 1, got {limit}")
        self.limit, self.retry_after_s = limit, retry_after_s
        self.in_flight: Counter[str] = Counter()

    def take(self, client: str) -> None:
        """A seat for a new request; a 429 when the client has none left."""
        if self.in_flight[client] >= self.limit:
            raise too_busy(f"too many requests from this client: {self.in_flight[client]} are in flight (limit "
                           f"{self.limit} per client); retry later", self.retry_after_s)
        self.in_flight[client] += 1

    def try_take(self, client: str) -> bool:
        """One more seat for work of a request the client already has in flight, if one is free."""
        if self.in_flight[client] >= self.limit:
            return False
        self.in_flight[client] += 1
        return True

    def give_back(self, client: str) -> None:
        self.in_flight[client] -= 1
        if self.in_flight[client] <= 0:
            del self.in_flight[client]


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class PriorityRange:
    """The priorities a client may send (`--priority-range MIN:MAX`; default 0: only lower its own)."""

    low: int = 0
    high: int = INT64_MAX

    @classmethod
    def parse(cls, text: str) -> PriorityRange:
        """"MIN:MAX", either side may be empty (":5", "-10:"); ValueError naming the flag."""
        low, sep, high = text.partition(":")
        try:
            bounds = cls(int(low) if low.strip() else INT64_MIN, int(high) if high.strip() else INT64_MAX)
        except ValueError:
            bounds = None
        if not sep or bounds is None or not INT64_MIN <= bounds.low <= bounds.high <= INT64_MAX:
            raise ValueError(f"--priority-range must be MIN:MAX with MIN <= MAX, 64-bit integers (either may be "
                             f"empty), got {text[:60]!r}")
        return bounds

    def check(self, priority: int, tenant: Tenant, path="priority") -> None:
        """A 400 naming `priority` outside the range (an operator key may send any)."""
        if tenant.admin or self.low <= priority <= self.high:
            return
        shown = f"{self.low}..{self.high}" if self.high != INT64_MAX else f"{self.low} or more"
        raise bad_request(f"{priority} is outside the range this server allows clients ({shown}; lower is "
                          f"served first)", path, code="priority_out_of_range")
