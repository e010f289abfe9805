"""Incremental detokenization (multi-byte characters, leading spaces) and stop strings."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopChecker,
    find_stop,
    partial_stop_len,
)

MULTILINGUAL = [
    "héllo wörld, naïve café — déjà vu",
    "日本語のテキストと中文字符，还有한국어 문장。",
    "emoji 😀👍🏽🎉 family 👨‍👩‍👧‍👦 flag 🇫🇷 done",
    "Ελληνικά и русский текст, עברית, العربية",
    "math ∑∫√∞ ≠ ≤ and symbols ©®™ ½ ¾",
    "  leading spaces\n\ttabs\n\nnew lines  ",
]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    """The default model's tokenizer (byte-level BPE, 49152 ids): read from its GGUF file once per session
    (conftest's tokenizer_dir, which saves it as plain HF files), not again here (~8 s)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tokenizer) == 49152, len(tokenizer)
    return tokenizer


def _stream(tokenizer, prompt_ids, output_ids, chunk_sizes=(1,), skip_special_tokens=True):
    """Feeds output ids in chunks; -> (deltas of add_tokens, the flush delta, the detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas, start, i = [], 0, 0
    while start < len(output_ids):
        size = chunk_sizes[i % len(chunk_sizes)]
        deltas.append(detok.add_tokens(output_ids[start:start + size]))
        start, i = start + size, i + 1
    return deltas, detok.flush(), detok


@pytest.mark.subprocess
def test_detokenizer_module_does_not_import_torch():
    code = "import sys, deepinfer.engine.detokenizer; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_multibyte_text_streams_without_replacement_chars(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Translate:", add_special_tokens=False)
    deltas, tail, detok = _stream(tokenizer, prompt, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert tail == ""
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text


def test_split_emoji_is_held_until_complete(tokenizer):
    ids = tokenizer.encode(" 🎉!", add_special_tokens=False)
    assert len(ids) >= 3  # the emoji's four bytes span several tokens
    deltas, _, _ = _stream(tokenizer, [], ids)
    assert deltas[0] == "" and " 🎉" in deltas  # nothing until the character is complete


def test_cut_off_character_is_flushed_as_in_a_full_decode(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # max_tokens cut the emoji
    deltas, tail, detok = _stream(tokenizer, [], ids)
    assert REPLACEMENT_CHAR not in "".join(deltas)
    assert tail.endswith(REPLACEMENT_CHAR)
    assert detok.text == tokenizer.decode(ids)


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [tokenizer.eos_token_id]
    for skip in (True, False):
        deltas, tail, _ = _stream(tokenizer, [1], ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 49151), max_size=8),
       output=st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 400)), max_size=40),
       chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4), skip=st.booleans())
def test_deltas_sum_to_a_full_decode_for_random_ids(tokenizer, prompt, output, chunks, skip):
    deltas, tail, detok = _stream(tokenizer, prompt, output, chunks, skip_special_tokens=skip)
    assert "".join(deltas) + tail == detok.text == tokenizer.decode(output, skip_special_tokens=skip)
    assert detok.output_token_ids == output


@settings(max_examples=150, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40),
       chunks=st.lists(st.integers(1, 3), min_size=1, max_size=3))
def test_valid_text_never_streams_replacement_chars(tokenizer, text, chunks):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, tail, _ = _stream(tokenizer, [], ids, chunks)
    assert "".join(deltas) + tail == tokenizer.decode(ids)
    if tokenizer.decode(ids) == text and REPLACEMENT_CHAR not in text:  # the text round-trips
        assert all(REPLACEMENT_CHAR not in d for d in deltas + [tail])


_VALID_CHARS = st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters=REPLACEMENT_CHAR)

# A SentencePiece-style tokenizer: "▁" marks a word start, bytes fall back to <0xNN> tokens, and
# a full decode strips the first token's leading space.
_PIECES = ["▁Hello", "▁world", "Hello", "▁The", "▁Paris", ",", "!", "▁", "ing", "▁caf", "é"]
_SP_VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)},
             **{piece: 259 + i for i, piece in enumerate(_PIECES)}}


def _sp_ids(words: list[str]) -> list[int]:
    """Known pieces as themselves, anything else as its UTF-8 bytes (byte fallback)."""
    ids = []
    for word in words:
        ids += [_SP_VOCAB[word]] if word in _SP_VOCAB else [3 + b for b in word.encode()]
    return ids


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(_SP_VOCAB, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_sentencepiece_leading_spaces(sentencepiece_tokenizer):
    ids = _sp_ids(["▁The", "▁Paris", ",", "▁Hello", "ing", "!"])
    deltas, _, _ = _stream(sentencepiece_tokenizer, [], ids)
    assert deltas == ["The", " Paris", ",", " Hello", "ing", "!"]
    deltas, _, _ = _stream(sentencepiece_tokenizer, _sp_ids(["<s>", "▁The"]), ids[1:])
    assert deltas == [" Paris", ",", " Hello", "ing", "!"]  # in context the first keeps its space


def test_sentencepiece_byte_fallback_characters(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    ids = _sp_ids(["▁caf", "é 日本 😀", "!"])
    deltas, tail, _ = _stream(tok, _sp_ids(["<s>", "▁The"]), ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas) and tail == ""
    assert "".join(deltas) == " café 日本 😀!" == " " + tok.decode(ids)
    deltas, _, _ = _stream(tok, _sp_ids(["<s>"]), ids)  # the prompt decodes to "": as a full decode
    assert "".join(deltas) == "café 日本 😀!" == tok.decode(ids)


@settings(max_examples=200, deadline=None)
@given(words=st.lists(st.one_of(st.sampled_from(_PIECES), _VALID_CHARS), max_size=12),
       prompt=st.lists(st.sampled_from(_PIECES + ["<s>"]), max_size=4),
       chunks=st.lists(st.integers(1, 3), min_size=1, max_size=3))
def test_sentencepiece_deltas_match_the_decode_in_context(sentencepiece_tokenizer, words, prompt, chunks):
    tok = sentencepiece_tokenizer
    ids, prompt_ids = _sp_ids(words), _sp_ids(prompt)
    deltas, tail, _ = _stream(tok, prompt_ids, ids, chunks)
    assert all(REPLACEMENT_CHAR not in d for d in deltas) and tail == ""
    prompt_text = tok.decode(prompt_ids, skip_special_tokens=True)
    assert "".join(deltas) == tok.decode(prompt_ids + ids, skip_special_tokens=True)[len(prompt_text):]


# ----------------------------------------------------------------------------- stop strings


def _run_stops(stop, deltas, finished=True):
    checker = StopChecker(stop)
    emitted = []
    for delta in deltas:
        text, matched = checker.step(delta)
        emitted.append(text)
        if matched is not None:
            return "".join(emitted), matched, emitted
    if finished:
        emitted.append(checker.flush())
    return "".join(emitted), None, emitted


def test_stop_string_spanning_deltas_is_not_emitted():
    text, matched, emitted = _run_stops(["STOP"], ["Hel", "lo S", "TO", "P and more"])
    assert (text, matched) == ("Hello ", "STOP")
    assert emitted == ["Hel", "lo ", "", ""]  # "S" and "STO" were held back


def test_stop_at_the_very_start():
    assert _run_stops(["<end>"], ["<end>rest"])[:2] == ("", "<end>")
    assert _run_stops(["<end>"], ["<", "en", "d>"])[:2] == ("", "<end>")


def test_several_stop_strings_earliest_wins():
    assert _run_stops(["world", "lo"], ["hello world"])[:2] == ("hel", "lo")
    assert _run_stops(["b", "abc"], ["xabc"])[:2] == ("xa", "b")  # "b" completes first
    assert _run_stops(["abc", "bc"], ["xabc"])[:2] == ("x", "abc")  # same end: the longer one


def test_holdback_is_released_when_it_cannot_be_a_stop():
    text, matched, emitted = _run_stops(["STOP"], ["go ST", "ART now"])
    assert matched is None and text == "go START now"
    assert emitted == ["go ", "START now", ""]
    _, _, emitted = _run_stops(["STOP"], ["end ST"], finished=True)  # finished for another reason
    assert emitted == ["end ", "ST"]


def test_no_stop_strings_passes_text_through():
    checker = StopChecker([])
    assert checker.step("anything") == ("anything", None)
    assert checker.flush() == "" and checker.text == "anything"


def test_after_a_stop_nothing_more_is_emitted():
    checker = StopChecker(["."])
    assert checker.step("One. Two") == ("One", ".")
    assert checker.step(" three") == ("", ".")
    assert checker.flush() == "" and checker.text == "One" and checker.stopped


def test_bad_stop_strings_are_refused():
    with pytest.raises(ValueError, match="stop strings"):
        StopChecker(["ok", ""])


def test_partial_stop_len():
    assert partial_stop_len("abc ST", ["STOP"]) == 2
    assert partial_stop_len("abc S", ["STOP", "xy"]) == 1
    assert partial_stop_len("abc", ["STOP"]) == 0
    assert partial_stop_len("aaa", ["aaab"]) == 3


def _reference_stop(text: str, stop: list[str]) -> tuple[str, str | None]:
    """Character by character: the first position where some stop string has just completed."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop if text[:end].endswith(s)]
        if done:
            first = max(done, key=len)
            return text[:end - len(first)], first
    return text, None


@settings(max_examples=400, deadline=None)
@given(text=st.text("abcST ", max_size=30), stop=st.lists(st.text("abcST", min_size=1, max_size=4),
                                                          min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_checker_matches_a_character_by_character_reference(text, stop, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    emitted_text, matched, _ = _run_stops(stop, deltas)
    assert (emitted_text, matched) == _reference_stop(text, stop)
    checker, received, num_emitted = StopChecker(stop), 0, 0
    for delta in deltas:
        out, hit = checker.step(delta)
        received, num_emitted = received + len(delta), num_emitted + len(out)
        if hit is None:  # never more than len(longest stop) - 1 characters held back
            assert received - num_emitted <= max(map(len, stop)) - 1


def test_find_stop():
    assert find_stop("hello world", ["o w", "wor"]) == (4, "o w")
    assert find_stop("hello", ["x"]) is None
    assert find_stop("abab", ["ab"], start=1) == (2, "ab")


def test_stop_spanning_real_tokens(tokenizer):
    ids = tokenizer.encode("The answer is 42.\n\nUser: next question", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    checker = StopChecker(["\n\nUser:", "###"])
    out, matched = [], None
    for token_id in ids:
        text, matched = checker.step(detok.add_tokens([token_id]))
        out.append(text)
        if matched:
            break
    assert ("".join(out), matched) == ("The answer is 42.", "\n\nUser:")


def test_random_streams_with_real_tokens_and_stops(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        text = rng.choice(MULTILINGUAL)
        stop = [text[i:i + rng.randint(1, 3)] for i in (rng.randrange(len(text)) for _ in range(2))]
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok, checker = IncrementalDetokenizer(tokenizer, []), StopChecker(stop)
        out, matched = [], None
        for token_id in ids:
            piece, matched = checker.step(detok.add_tokens([token_id]))
            out.append(piece)
            if matched:
                break
        if matched is None:
            out.append(checker.step(detok.flush())[0] + checker.flush())
        assert ("".join(out), matched) == _reference_stop(text, stop)
