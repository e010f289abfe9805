"""SamplingParams: how one request picks its tokens and when it stops. Pure Python.

Every bad value raises ValueError naming the field and the value, so one bad request can be
refused without touching the rest of a batch. The lists are bounded (MAX_STOP_STRINGS and
MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_BAD_WORDS and MAX_BAD_WORDS_CHARS, MAX_LOGIT_BIAS; a
structured-output choice in `structured_output`): beyond a limit the ValueError names the field,
its length and the limit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from deepinfer.structured_output import StructuredOutputsParams

# torch.Generator.manual_seed takes any 64-bit seed, signed or unsigned
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
INT64_MAX = 2**63 - 1  # token ids, top_k and counts stay within int64 (what a tensor holds)
MAX_SAMPLES = 128  # most sequences one prompt may fan out to (n, best_of), as in OpenAI's API
# Per-request lists: their length (and characters, where text is scanned) are bounded, so that no
# request costs the engine more than a fixed amount per step (see README, "Request limits").
MAX_STOP_STRINGS = 64  # stop strings (OpenAI allows 4)
MAX_STOP_CHARS = 4096  # characters of all stop strings together
MAX_STOP_TOKEN_IDS = 1024  # stop_token_ids
MAX_BAD_WORDS = 1024  # bad_words
MAX_BAD_WORDS_CHARS = 65_536  # characters of all bad words together
MAX_LOGIT_BIAS = 4096  # logit_bias entries


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 is off
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, not emitted
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: the sampled token's logprob + top n
    skip_special_tokens: bool = True  # special tokens are not shown in the text
    spaces_between_special_tokens: bool = True  # vLLM's; the tokenizer's decode takes it (fast ones ignore it)
    n: int = 1  # samples returned per prompt, [1, MAX_SAMPLES]
    best_of: int | None = None  # samples drawn (None: n); the n of highest cumulative logprob are returned
    min_tokens: int = 0  # EOS / stop_token_ids masked and stop strings unchecked until this many outputs
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    bad_words: list[str] = field(default_factory=list)  # never emitted whole (see set_bad_words_tokens)
    prompt_logprobs: int | None = None  # None: none; n >= 0: each prompt token's logprob + top n
    structured_output: StructuredOutputsParams | None = None  # a dict of its fields is accepted too
    # Filled by the engine when it admits the request (not user input; copied with the params):
    # the model's EOS ids (masked with stop_token_ids under min_tokens), each bad word's tokenizations
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    _bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    _bad_words_tokenized: tuple[str, ...] | None = field(default=None, repr=False)  # the words tokenized

    def __init__(self, **kwargs):
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        for key in kwargs:
            if key not in names:
                public = sorted(n for n in names if not n.startswith("_"))
                raise ValueError(f"unknown sampling field {key!r} (value {short_repr(kwargs[key])}); "
                                 f"known fields: {', '.join(public)}")
        for f in dataclasses.fields(SamplingParams):
            if f.name in kwargs:
                value = kwargs[f.name]
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = f.default
            setattr(self, f.name, value)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def all_stop_token_ids(self) -> list[int]:
        """The ids min_tokens masks: stop_token_ids, and the model's EOS unless ignore_eos."""
        return list(self.stop_token_ids) + ([] if self.ignore_eos else list(self._eos_token_ids))

    def set_eos_token_ids(self, ids) -> None:
        """The engine's EOS ids for this request (masked with stop_token_ids under min_tokens)."""
        self._eos_token_ids = tuple(sorted(int(t) for t in ids))

    def set_bad_words_tokens(self, tokenizer) -> None:
        """Tokenize `bad_words` as vLLM does: each word alone and after a space, keeping the
        spaced form only when it starts with another token and has as many tokens (a new word
        token rather than a space plus the word). O(len(bad_words)) encodes, duplicates dropped
        through a set. ValueError when there is no tokenizer. The server runs this in its
        tokenizer pool, the engine when the request is added (unless already done for these words)."""
        if not self.bad_words:
            self._bad_words_token_ids, self._bad_words_tokenized = (), ()
            return
        if tokenizer is None:
            raise ValueError(f"bad_words {short_repr(self.bad_words)} need a tokenizer, and this model has none")
        found: dict[tuple[int, ...], None] = {}  # insertion-ordered set
        for word in self.bad_words:
            plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            new_word = bool(plain) and bool(spaced) and spaced[0] != plain[0] and len(spaced) == len(plain)
            for ids in (plain, spaced) if new_word else (plain,):
                if ids:
                    found.setdefault(ids)
        self._bad_words_token_ids = tuple(found)
        self._bad_words_tokenized = tuple(self.bad_words)

    @property
    def bad_words_tokenized(self) -> bool:
        """`_bad_words_token_ids` is up to date with `bad_words` (set_bad_words_tokens ran for them)."""
        return not self.bad_words or self._bad_words_tokenized == tuple(self.bad_words)

    def first_banned_token_ids(self) -> set[int]:
        """The ids no first output token may be: the one-token bad words (min_tokens, the other
        first-token ban, cannot be combined with structured output)."""
        return {word[0] for word in self._bad_words_token_ids if len(word) == 1}

    def validate(self) -> SamplingParams:
        """Check every field again (fields can be changed after construction); returns self.
        Raises ValueError naming the field and the value."""
        self._validate()
        return self

    def _validate(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_list("stop", self.stop, MAX_STOP_STRINGS, "strings")
        _check_list("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS, "ids")
        _check_int("max_tokens", self.max_tokens, low=1, high=INT64_MAX)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {short_repr(self.top_p)}")
        _check_int("top_k", self.top_k, low=-1, high=INT64_MAX)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {short_repr(self.repetition_penalty)}")
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=SEED_MIN, high=SEED_MAX)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)
        self._validate_samples()
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {short_repr(self.stop)}")
        _check_chars("stop", self.stop, MAX_STOP_CHARS)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX
                   for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {INT64_MAX}], "
                             f"got {short_repr(self.stop_token_ids)}")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("spaces_between_special_tokens", self.spaces_between_special_tokens)
        self._validate_parity_fields()
        self.structured_output = StructuredOutputsParams.from_value(self.structured_output)
        if self.structured_output is not None and self.min_tokens:
            # the grammar decides where the answer ends: once complete it allows only EOS
            raise ValueError(f"min_tokens ({self.min_tokens}) cannot be combined with structured_output; "
                             f"use the grammar (e.g. minLength, minItems) to ask for a longer answer")
        self.temperature = float(self.temperature)
        if self.top_k == -1:
            self.top_k = 0

    def _validate_samples(self) -> None:
        """n in [1, MAX_SAMPLES]; best_of None (means n) or in [n, MAX_SAMPLES]."""
        _check_int("n", self.n, low=1, high=MAX_SAMPLES)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, low=1, high=MAX_SAMPLES)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {short_repr(self.best_of)}")

    @property
    def num_samples(self) -> int:
        """Sequences the engine runs for the prompt: best_of, or n when best_of is None."""
        return self.n if self.best_of is None else self.best_of

    def _validate_parity_fields(self) -> None:
        """min_tokens, include_stop_str_in_output, logit_bias, bad_words, prompt_logprobs."""
        _check_int("min_tokens", self.min_tokens, low=0, high=INT64_MAX)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {short_repr(self.min_tokens)}")
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        _check_list("bad_words", self.bad_words, MAX_BAD_WORDS, "words")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {short_repr(self.bad_words)}")
        _check_chars("bad_words", self.bad_words, MAX_BAD_WORDS_CHARS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=20)


def _checked_logit_bias(bias) -> dict[int, float]:
    """{token id: bias}: ids are ints >= 0 (or strings of them, as JSON sends), biases finite
    numbers in [-100, 100]. The upper bound on ids (the vocabulary) is checked by the sampler."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {short_repr(bias)}")
    _check_list("logit_bias", bias, MAX_LOGIT_BIAS, "entries")
    checked = {}
    for key, value in bias.items():
        token_id = key
        if isinstance(key, str) and key.strip().isdecimal() and len(key) <= 20:  # int() refuses 4300+ digits
            token_id = int(key)
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= INT64_MAX:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {short_repr(key)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {short_repr(value)} "
                             f"for token id {token_id}")
        checked[token_id] = float(value)
    return checked


def check_token_ids_in_vocab(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the first logit_bias id outside [0, vocab_size)."""
    for token_id in params.logit_bias:
        if token_id >= vocab_size:
            raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})")


# generation_config.json field -> SamplingParams field
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(generation_config: dict | None) -> dict:
    """The SamplingParams fields a checkpoint's generation config suggests (temperature, top_p,
    top_k, min_p, repetition_penalty, max_new_tokens -> max_tokens); `do_sample: false` means
    greedy, as in transformers. {} for a checkpoint without one (GGUF files never have one)."""
    config = generation_config or {}
    named = {ours: config[theirs] for theirs, ours in GENERATION_FIELDS.items() if config.get(theirs) is not None}
    if config.get("do_sample") is False:
        named["temperature"] = 0.0  # transformers ignores temperature and top_p then
    return named


# What a request's unset sampling fields take when the checkpoint's generation config names none of
# them (GGUF files never carry one): mild randomness and a light repetition penalty, so that a small
# model neither loops (as greedy decoding makes it) nor rambles (as temperature 1 does).
FALLBACK_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.05}


def model_sampling_defaults(generation_config: dict | None) -> dict:
    """The one set of sampling defaults every entry point uses (the server, `LLM.generate` and `chat`,
    the CLI and the chat page): the generation config's fields (`generation_defaults`), else
    FALLBACK_SAMPLING. max_tokens comes only from the config's max_new_tokens."""
    config = generation_config or {}
    named = generation_defaults(config)
    if named.keys() - {"max_tokens"} or "do_sample" in config:
        return named
    return {**FALLBACK_SAMPLING, **named}


_MAX_SHOWN = 80  # characters of a value shown in an error message


def short_repr(value) -> str:
    """repr(value) for an error message, cut short: a client may send a 5000-digit number (whose
    repr Python even refuses past sys.get_int_max_str_digits)."""
    try:
        text = repr(value)
    except ValueError:
        return f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else \
            f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= _MAX_SHOWN else f"{text[:_MAX_SHOWN]}... ({len(text)} characters)"


def _check_list(name: str, values, limit: int, what: str) -> None:
    """ValueError naming the field, its length and the limit when `values` is longer than `limit`."""
    if len(values) > limit:
        raise ValueError(f"{name} has {len(values)} {what}; the limit is {limit}")


def _check_chars(name: str, strings: list[str], limit: int) -> None:
    """ValueError when the strings hold more than `limit` characters together."""
    total = sum(len(s) for s in strings)
    if total > limit:
        raise ValueError(f"{name} has {total} characters in all; the limit is {limit}")


def _check_int(name, value, low=None, high=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {short_repr(value)}")
    _check_range(name, value, low, high)


def _check_number(name, value, low=None, high=None):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _is_finite(value):
        raise ValueError(f"{name} must be a finite number, got {short_repr(value)}")
    _check_range(name, value, low, high)


def _is_finite(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int too large for a float
        return False


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {short_repr(value)}")


def _check_range(name, value, low, high):
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {short_repr(value)}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {short_repr(value)}")
