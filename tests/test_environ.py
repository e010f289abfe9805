"""DEEPINFER_* knobs: defaults, overrides, rejected values, read-once caching."""

import dataclasses

import pytest

from deepinfer.environ import Environ, describe_environ, get_environ, read_environ

DEFAULTS = {
    "use_nextn_decode": 5,
    "max_backtracking_tokens": 0,
    "prefill_store_extra_state": False,
    "prefill_store_extra_size": 128,
    "yoco_prefill_truncation": False,
    "yoco_prefill_keep_tokens": 0,
    "batch_invariant": None,  # auto: the engine decides (on for the CPU with its C++ kernels)
    "allow_long_max_model_len": False,
}


def test_defaults_when_nothing_is_set():
    env = read_environ({})
    assert dataclasses.asdict(env) == DEFAULTS
    assert env == Environ()


def test_unrelated_and_empty_variables_keep_defaults():
    env = read_environ({"PATH": "/bin", "DEEPINFER_USE_NEXTN_DECODE": "", "DEEPINFER_BATCH_INVARIANT": "  "})
    assert env == Environ()


@pytest.mark.parametrize(("variable", "text", "field", "value"), [
    ("DEEPINFER_USE_NEXTN_DECODE", "3", "use_nextn_decode", 3),
    ("DEEPINFER_USE_NEXTN_DECODE", " 0 ", "use_nextn_decode", 0),
    ("DEEPINFER_MAX_BACKTRACKING_TOKENS", "16", "max_backtracking_tokens", 16),
    ("DEEPINFER_PREFILL_STORE_EXTRA_STATE", "1", "prefill_store_extra_state", True),
    ("DEEPINFER_PREFILL_STORE_EXTRA_SIZE", "64", "prefill_store_extra_size", 64),
    ("DEEPINFER_YOCO_PREFILL_TRUNCATION", "on", "yoco_prefill_truncation", True),
    ("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "+12", "yoco_prefill_keep_tokens", 12),
    ("DEEPINFER_BATCH_INVARIANT", "TRUE", "batch_invariant", True),
])
def test_overrides(variable, text, field, value):
    env = read_environ({variable: text})
    assert getattr(env, field) == value
    others = {k: v for k, v in dataclasses.asdict(env).items() if k != field}
    assert others == {k: v for k, v in DEFAULTS.items() if k != field}


@pytest.mark.parametrize(("word", "value"), [
    ("1", True), ("true", True), ("Yes", True), ("ON", True),
    ("0", False), ("False", False), ("no", False), ("off", False),
])
def test_boolean_words(word, value):
    assert read_environ({"DEEPINFER_BATCH_INVARIANT": word}).batch_invariant is value


@pytest.mark.parametrize(("variable", "text"), [
    ("DEEPINFER_USE_NEXTN_DECODE", "five"),
    ("DEEPINFER_USE_NEXTN_DECODE", "-1"),
    ("DEEPINFER_USE_NEXTN_DECODE", "2.5"),
    ("DEEPINFER_MAX_BACKTRACKING_TOKENS", "-3"),
    ("DEEPINFER_PREFILL_STORE_EXTRA_SIZE", "1e3"),
    ("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "-7"),
    ("DEEPINFER_PREFILL_STORE_EXTRA_STATE", "2"),
    ("DEEPINFER_YOCO_PREFILL_TRUNCATION", "enabled"),
    ("DEEPINFER_BATCH_INVARIANT", "y"),
])
def test_bad_values_name_variable_and_value(variable, text):
    with pytest.raises(ValueError) as info:
        read_environ({variable: text})
    assert variable in str(info.value)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(("field", "value"), [
    ("use_nextn_decode", -1), ("yoco_prefill_keep_tokens", -2), ("max_backtracking_tokens", 1.5),
    ("batch_invariant", 1), ("prefill_store_extra_size", True),
])
def test_direct_construction_is_validated(field, value):
    with pytest.raises(ValueError, match="DEEPINFER_"):
        Environ(**{field: value})


def test_environ_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Environ().use_nextn_decode = 3


def test_get_environ_reads_once(monkeypatch):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    get_environ.cache_clear()
    try:
        first = get_environ()
        monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "9")
        assert get_environ() is first and first.use_nextn_decode == 2
        get_environ.cache_clear()
        assert get_environ().use_nextn_decode == 9
    finally:
        get_environ.cache_clear()


def test_describe_names_every_variable_with_default():
    lines = describe_environ(Environ())
    assert len(lines) == len(DEFAULTS)
    assert lines[0].startswith("DEEPINFER_USE_NEXTN_DECODE=5 (default 5): ")
    assert any(line.startswith("DEEPINFER_BATCH_INVARIANT=auto (default auto): ") for line in lines)
    assert any(line.startswith("DEEPINFER_BATCH_INVARIANT=False (default auto): ")
               for line in describe_environ(Environ(batch_invariant=False)))
