"""Per-request lists are bounded and cost O(n): stop, stop_token_ids, bad_words, logit_bias and
a structured-output choice each have a documented limit (a ValueError beyond it names the field,
its length and the limit); bad words are tokenized with a set for the dedupe and looked up by
prefix at each step, never scanned word by word."""

from __future__ import annotations

import re
import sys

import pytest

from deepinfer import SamplingParams
from deepinfer.model_executor.layers.logits_processors import banned_token_ids
from deepinfer.sampling_params import (
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from deepinfer.structured_output import MAX_CHOICE_CHARS, MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutputsParams

OVER = [  # (field, value over its limit, words the message must hold)
    ("stop", [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], f"stop has {MAX_STOP_STRINGS + 1} strings; the limit "
     f"is {MAX_STOP_STRINGS}"),
    ("stop", ["x" * (MAX_STOP_CHARS + 1)], f"the limit is {MAX_STOP_CHARS}"),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), f"stop_token_ids has {MAX_STOP_TOKEN_IDS + 1} ids"),
    ("bad_words", [f"w{i}" for i in range(MAX_BAD_WORDS + 1)], f"bad_words has {MAX_BAD_WORDS + 1} words; the "
     f"limit is {MAX_BAD_WORDS}"),
    ("bad_words", ["y" * 60_000, "z" * 6000], f"the limit is {MAX_BAD_WORDS_CHARS}"),
    ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"logit_bias has {MAX_LOGIT_BIAS + 1} entries"),
    ("structured_output", {"choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]},
     f"structured_output.choice has {MAX_CHOICES + 1} strings; the limit is {MAX_CHOICES}"),
    ("structured_output", {"choice": ["c" * 40_000, "d" * 40_000]}, f"the limit is {MAX_CHOICE_CHARS}"),
    ("structured_output", {"grammar": 'start: "' + "a" * MAX_SPEC_CHARS + '"'}, f"the limit is {MAX_SPEC_CHARS}"),
    ("structured_output", {"regex": "a" * (MAX_SPEC_CHARS + 1)}, "structured_output.regex has"),
]


def _python_calls(fn) -> int:
    """How many functions (Python's and builtins) `fn()` calls, generator resumptions included: the
    work it does, counted rather than timed (a timing fails on a busy machine)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("field,value,words", OVER, ids=[f"{c[0]}-{i}" for i, c in enumerate(OVER)])
def test_a_list_over_its_limit_is_refused_quickly_naming_it(field, value, words):
    """Refused by its length before any per-item or per-character work (tokenizing, compiling a
    grammar or regex): a few hundred calls, where walking the value would make thousands."""
    def build():
        with pytest.raises(ValueError, match=re.escape(words)):
            SamplingParams(max_tokens=4, **{field: value})

    assert _python_calls(build) < 1000


def test_lists_at_their_limits_are_accepted():
    params = SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)],
                            stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
                            bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS)],
                            logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)})
    assert len(params.bad_words) == MAX_BAD_WORDS and len(params.logit_bias) == MAX_LOGIT_BIAS
    assert len(StructuredOutputsParams(choice=[f"c{i}" for i in range(MAX_CHOICES)]).choice) == MAX_CHOICES


class _Id(int):
    """A token id that counts the comparisons made with it (a dedupe by list compares each new word
    with every kept one: quadratic; by set or dict it hashes, and compares only on a collision)."""

    comparisons = 0

    def __eq__(self, other):
        _Id.comparisons += 1
        return int(self) == int(other)

    __hash__ = int.__hash__


class _Tokenizer:
    """Each character one token (its code point, as an _Id); counts encode calls."""

    def __init__(self):
        self.calls = 0

    def encode(self, text, add_special_tokens=False):
        self.calls += 1
        return [_Id(ord(c)) for c in text]


def test_bad_words_are_tokenized_in_linear_time_without_duplicates():
    params = SamplingParams()
    params.bad_words = [f"word{i}" for i in range(40_000)] + ["word7", "word7"]  # past the limit: raw cost
    tokenizer = _Tokenizer()
    _Id.comparisons = 0
    params.set_bad_words_tokens(tokenizer)
    # counted, not timed: a list dedupe makes ~40_000**2 / 2 comparisons here (minutes); a set, a few per word
    assert _Id.comparisons <= 10 * len(params.bad_words), _Id.comparisons
    assert tokenizer.calls == 2 * len(params.bad_words)
    assert len(params._bad_words_token_ids) == 40_000 == len(set(params._bad_words_token_ids))
    assert params._bad_words_token_ids[7] == tuple(map(ord, "word7")) and params.bad_words_tokenized


class _CountingOutputs(list):
    """An output history that counts the slices taken of it."""

    slices = 0

    def __getitem__(self, key):
        if isinstance(key, slice):
            type(self).slices += 1
        return super().__getitem__(key)


def test_the_per_step_ban_lookup_does_not_scan_the_words():
    params = SamplingParams()
    params._bad_words_token_ids = tuple((i, i + 1, 7) for i in range(1000)) + ((3,), (5, 9))
    outputs = _CountingOutputs([1, 2, 42, 43])
    assert banned_token_ids(params, outputs) == {3, 7}  # (42, 43, 7) matches; (5, 9) does not
    _CountingOutputs.slices = 0
    assert banned_token_ids(params, outputs) == {3, 7}
    assert _CountingOutputs.slices <= 2  # one per distinct prefix length, not one per word (1002)
    assert banned_token_ids(params, [5]) == {3, 9}
    assert banned_token_ids(params, []) == {3}
