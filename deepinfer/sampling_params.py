"""SamplingParams: how one request picks its tokens and when it stops. Pure Python.

Every bad value raises ValueError naming the field and the value, so one bad request can be
refused without touching the rest of a batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


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
                raise ValueError(f"unknown sampling field {key!r} (value {kwargs[key]!r}); "
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

    def _validate(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)
        _check_int("n", self.n, low=1, high=1)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.temperature = float(self.temperature)
        if self.top_k == -1:
            self.top_k = 0


def _check_int(name, value, low=None, high=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _check_range(name, value, low, high)


def _check_number(name, value, low=None, high=None):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    _check_range(name, value, low, high)


def _check_range(name, value, low, high):
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
