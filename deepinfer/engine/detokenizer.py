"""Tokens -> text, incrementally, and stop strings. Pure Python (no torch).

Incremental decoding keeps a small window of token ids and decodes it twice per step:

    token ids   ... | prefix_offset ......... read_offset ......... end |
    prefix_text       decode(window[:read])   (already emitted)
    new_text          decode(window)           delta = new_text[len(prefix_text):]

Decoding a few earlier tokens together with the new ones gives SentencePiece / BPE tokens their
leading space exactly as a full decode would. When `new_text` ends in U+FFFD the last UTF-8
character is still incomplete (its bytes are split across tokens): nothing is emitted until it
completes. The window starts at the end of the prompt, so the first output token is decoded in
context too (a SentencePiece "▁Paris" after a prompt yields " Paris", as in vLLM).

Invariant (tested): the deltas of `add_tokens` plus `flush` sum to
`tokenizer.decode(output_token_ids, skip_special_tokens=...)` for byte-level BPE tokenizers;
for SentencePiece-style tokenizers, whose full decode drops the first token's leading space, the
sum keeps it (it equals the prompt + output decode minus the prompt decode). A byte-fallback
decoder turns every byte of an invalid UTF-8 run into U+FFFD, so for such garbage runs (never
for valid text) its U+FFFD count can differ from a full decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
NUM_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output token


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...,
               spaces_between_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """One request's output text, grown token by token.

    `add_tokens` returns the new text delta (possibly empty while a multi-byte character is
    incomplete); `flush` returns whatever is still held back once the request has finished (a
    character cut off by max_tokens then shows as U+FFFD, as in a full decode). `text` is the sum
    of all deltas so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        context = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends inside a character: decode the output on its own
        self._window = context  # token ids from prefix_offset on
        self._read_offset = len(context)  # index in _window of the first token not yet emitted
        self._prefix_text = self._decode(context)
        self._pieces: list[str] = []
        self.output_token_ids: list[int] = []

    @property
    def text(self) -> str:
        """The output text emitted so far (the sum of all deltas)."""
        return joined(self._pieces)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Appends output tokens; returns the text they complete (may be '')."""
        self.output_token_ids.extend(token_ids)
        self._window.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Releases held-back text at the end of the request (U+FFFD for a cut-off character)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        new_text = self._decode(self._window)
        if len(new_text) <= len(self._prefix_text) and not final:
            return ""  # e.g. a skipped special token: nothing to show yet
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # a character split across tokens: wait for its remaining bytes
        delta = new_text[len(self._prefix_text):]
        self._window = self._window[self._read_offset:]  # the new prefix: the tokens just emitted
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        if delta:
            self._pieces.append(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                      spaces_between_special_tokens=self.spaces_between_special_tokens)


class NoTextDetokenizer:
    """For a model that ships no tokenizer (token ids in, token ids out): the text stays empty."""

    text = ""

    def __init__(self):
        self.output_token_ids: list[int] = []

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        self.output_token_ids.extend(token_ids)
        return ""

    def flush(self) -> str:
        return ""


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The stop string occurrence in `text[start:]` that ends first -> (its index, the string).

    Ending first is what a token-by-token stream sees first, so the answer does not depend on
    how the text was cut into deltas; among occurrences ending at the same place the longest
    (earliest starting) wins. None when no stop string occurs.
    """
    best: tuple[int, int, str] | None = None  # (end, index, stop string)
    for s in stop:
        index = text.find(s, start)
        if index >= 0 and (best is None or (index + len(s), index) < best[:2]):
            best = (index + len(s), index, s)
    return None if best is None else (best[1], best[2])


def joined(pieces: list[str]) -> str:
    """The text of `pieces`, which are joined in place into one (reading it again costs nothing)."""
    if len(pieces) > 1:
        pieces[:] = ["".join(pieces)]
    return pieces[0] if pieces else ""


def partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string: the
    characters a stream must hold back because the next delta may complete a stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class StopChecker:
    """Streams one request's text through its stop strings.

    `step(delta)` returns (text to emit, matched stop string or None). The stop string and all
    text after it are never emitted; a tail that may be the start of a stop string (at most
    len(longest stop) - 1 characters) is held back until the next delta decides it, or until
    `flush()` at the end of a request that finished for another reason. Usage per step:

        delta = detokenizer.add_tokens(new_ids)      # at the end also: + detokenizer.flush()
        emit, stop = checker.step(delta)
        if stop is None and request finished: emit += checker.flush()
    """

    def __init__(self, stop: Sequence[str]):
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.stop = tuple(stop)
        self.stop_reason: str | None = None  # the stop string that matched
        self._held = ""  # text received but not emitted: a possible start of a stop string
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return joined(self._pieces)

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def step(self, delta: str) -> tuple[str, str | None]:
        """Takes the next text delta; -> (text to emit now, the stop string if one matched)."""
        if self.stopped:
            return "", self.stop_reason
        # The held tail holds no complete stop string (it would have matched), so every match in
        # `pending` ends inside the new delta.
        pending = self._held + delta
        hit = find_stop(pending, self.stop)
        if hit is not None:
            index, self.stop_reason = hit
            self._held = ""
            return self._emit(pending[:index]), self.stop_reason
        keep = partial_stop_len(pending, self.stop)
        self._held = pending[len(pending) - keep:]
        return self._emit(pending[:len(pending) - keep]), None

    def flush(self) -> str:
        """Releases the held-back tail (the request finished without a stop string)."""
        held, self._held = self._held, ""
        return self._emit(held)

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text
