"""The server's unset sampling fields take the checkpoint's generation config (as vLLM's
`--generation-config auto`), else the one fallback every entry point uses; a request's own values win."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepinfer.sampling_params import SamplingParams, generation_defaults
from deepinfer.serving.context import sampling_defaults
from deepinfer.serving.prepare import sampling_params as _sampling_params
from deepinfer.serving.protocol import ChatCompletionRequest, CompletionRequest


def _source(config):
    return SimpleNamespace(generation_config=config, path="/models/x")


def _state(config):
    return SimpleNamespace(max_model_len=256, vocab_size=1000, sampling_defaults=sampling_defaults(_source(config)))


def test_generation_defaults_reads_the_fields_and_do_sample():
    assert generation_defaults(None) == {} and generation_defaults({"bos_token_id": 1}) == {}
    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64, "repetition_penalty": 1.1}
    assert generation_defaults(config) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64,
                                           "repetition_penalty": 1.1}
    assert generation_defaults({"do_sample": False, "temperature": 0.6})["temperature"] == 0.0


def test_unset_fields_take_the_checkpoints_values_and_the_request_wins():
    state = _state({"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 8})
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = _sampling_params(state, chat, 10, "messages")
    assert (params.temperature, params.top_p) == (0.6, 0.95)
    assert params.max_tokens == 256 - 10  # max_new_tokens is not a server default: unset runs to the context
    own = _sampling_params(state, CompletionRequest(prompt="hi", temperature=0.0, top_p=0.5), 10, "prompt")
    assert (own.temperature, own.top_p, own.max_tokens) == (0.0, 0.5, 16)


def test_without_a_generation_config_the_one_fallback_holds():
    """The server used OpenAI's temperature 1.0 where `deepinfer chat` used 0.7: now every entry point
    takes FALLBACK_SAMPLING (see tests/test_defaults.py)."""
    params = _sampling_params(_state({}), CompletionRequest(prompt="hi"), 3, "prompt")
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.7, 0.9, 1.05)
    assert SamplingParams().temperature == 1.0  # a SamplingParams built by hand keeps its own defaults


def test_a_bad_generation_config_stops_the_start_naming_the_file_and_field():
    with pytest.raises(ValueError, match=r"generation config of '/models/x': top_p must be in \(0, 1\]"):
        sampling_defaults(_source({"top_p": 3.0}))
