"""The DEEPINFER_* knobs (book §3.4.3), typed and read once. Pure Python (no torch).

    env = read_environ({"DEEPINFER_USE_NEXTN_DECODE": "3"})   # an explicit mapping (tests)
    env = get_environ()                                        # os.environ, read on first use

Every knob is a field of the frozen `Environ`; its metadata names the variable and carries a
one-line description, so `describe_environ()` and the parser below share one table.

Accepted values: counts are decimal integers >= 0; switches are 1/0, true/false, yes/no or
on/off (any case). An empty value counts as unset. Anything else raises ValueError naming the
variable and the value. A switch whose default is None ("auto") keeps None while unset: the
engine decides (DEEPINFER_BATCH_INVARIANT: on for the CPU path with its C++ kernels,
`layers/batch_invariant.resolve_batch_invariant`).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})
_COUNT_RE = re.compile(r"^[+-]?[0-9]+$")


def _knob(variable: str, default: int | bool | None, doc: str, switch: bool | None = None):
    """A dataclass field bound to one environment variable; a switch unless its default is an int
    (a default of None needs `switch=True`: an auto switch, None while unset)."""
    switch = isinstance(default, bool) if switch is None else switch
    return field(default=default, metadata={"variable": variable, "doc": doc, "switch": switch})


def _shown(value) -> str:
    return "auto" if value is None else str(value)


@dataclass(frozen=True)
class Environ:
    """The engine's environment knobs. Build it with `read_environ`; fields are validated."""

    use_nextn_decode: int = _knob(
        "DEEPINFER_USE_NEXTN_DECODE", 5, "Most draft tokens one verification step may carry.")
    max_backtracking_tokens: int = _knob(
        "DEEPINFER_MAX_BACKTRACKING_TOKENS", 0,
        "Explicit ring allowance beyond the window; the ring keeps max(this, nextn + 1).")
    prefill_store_extra_state: bool = _knob(
        "DEEPINFER_PREFILL_STORE_EXTRA_STATE", False,
        "Give the kv-store ring extra rows for prefill state (see prefill_store_extra_size).")
    prefill_store_extra_size: int = _knob(
        "DEEPINFER_PREFILL_STORE_EXTRA_SIZE", 128, "Extra kv-store rows when the extra state is on.")
    yoco_prefill_truncation: bool = _knob(
        "DEEPINFER_YOCO_PREFILL_TRUNCATION", False,
        "Truncate YOCO prefill; only counted when the prefill extra state is on.")
    yoco_prefill_keep_tokens: int = _knob(
        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", 0, "Tokens YOCO truncation keeps (added to the kv-store ring).")
    batch_invariant: bool | None = _knob(
        "DEEPINFER_BATCH_INVARIANT", None,
        "Results independent of batch composition, chunking and prefix-cache hits; "
        "auto: on for the CPU with its C++ kernels (fp32 Llama family, Gemma 3), off elsewhere.", switch=True)
    allow_long_max_model_len: bool = _knob(
        "DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN", False,
        "Accept a max_model_len beyond the model's context (outputs past it may be garbage).")

    def __post_init__(self):
        values = asdict(self)
        for f in fields(self):
            value = values[f.name]
            if f.metadata["switch"]:
                if not isinstance(value, bool) and not (value is None and f.default is None):
                    raise ValueError(f"{f.metadata['variable']}={value!r}: expected a boolean")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{f.metadata['variable']}={value!r}: expected an integer >= 0")


def _parse_bool(variable: str, text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(f"{variable}={text!r}: expected one of 1/0, true/false, yes/no, on/off")


def _parse_count(variable: str, text: str) -> int:
    if not _COUNT_RE.match(text.strip()):
        raise ValueError(f"{variable}={text!r}: expected an integer >= 0")
    value = int(text)
    if value < 0:
        raise ValueError(f"{variable}={text!r}: must be >= 0 (it counts tokens)")
    return value


def read_environ(env: Mapping[str, str] = os.environ) -> Environ:
    """Parse the DEEPINFER_* variables of `env` into an `Environ`; unset ones keep their default."""
    values = {}
    for f in fields(Environ):
        variable = f.metadata["variable"]
        text = env.get(variable)
        if text is None or not text.strip():
            continue
        parse = _parse_bool if f.metadata["switch"] else _parse_count
        values[f.name] = parse(variable, text)
    return Environ(**values)


@functools.cache
def get_environ() -> Environ:
    """The process environment, read once. `get_environ.cache_clear()` forces a re-read."""
    return read_environ(os.environ)


def describe_environ(env: Environ | None = None) -> list[str]:
    """One line per knob: `VARIABLE=value (default D): description`."""
    env = get_environ() if env is None else env
    lines, values = [], asdict(env)
    for f in fields(Environ):
        value = values[f.name]
        lines.append(f"{f.metadata['variable']}={_shown(value)} (default {_shown(f.default)}): {f.metadata['doc']}")
    return lines
