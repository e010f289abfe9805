"""SamplingParams: how one request picks its tokens and when it stops. Pure Python.

Every bad value raises ValueError naming the field and the value, so one bad request can be
refused without touching the rest of a batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# torch.Generator.manual_seed takes any 64-bit seed, signed or unsigned
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
INT64_MAX = 2**63 - 1  # token ids, top_k and counts stay within int64 (what a tensor holds)


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
    skip_special_tokens: bool = True
    n: int = 1

    def __init__(self, **kwargs):
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        for key in kwargs:
            if key not in names:
                raise ValueError(f"unknown sampling field {key!r} (value {short_repr(kwargs[key])}); "
                                 f"known fields: {', '.join(sorted(names))}")
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
        _check_int("n", self.n, low=1, high=1)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {short_repr(self.stop)}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX
                   for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {INT64_MAX}], "
                             f"got {short_repr(self.stop_token_ids)}")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        self.temperature = float(self.temperature)
        if self.top_k == -1:
            self.top_k = 0


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
