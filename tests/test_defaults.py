"""One set of sampling defaults and checks everywhere: the server, `LLM.generate` / `chat` / `stream`,
the CLI's generate and chat (and so the chat page, which leaves unset fields to the server) take the
checkpoint's generation config, else FALLBACK_SAMPLING; `--threads` on every subcommand."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM
from deepinfer.entrypoints import cli
from deepinfer.entrypoints.engine_args import MODEL_DEFAULT_FLAGS, sampling_params
from deepinfer.sampling_params import FALLBACK_SAMPLING, SamplingParams, model_sampling_defaults
from deepinfer.serving.context import sampling_defaults

CONFIGS = [{}, {"bos_token_id": 1}, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 30},
           {"do_sample": False}]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), num_blocks=64, max_model_len=64)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}


@pytest.mark.parametrize("config", CONFIGS)
def test_server_llm_and_cli_share_one_set_of_defaults(llm, config, monkeypatch):
    monkeypatch.setattr(llm.engine.source, "generation_config", config)
    expected = SamplingParams(**model_sampling_defaults(config))
    server = SamplingParams(**sampling_defaults(llm.engine.source))
    for args in (["chat"], ["generate", "x"]):
        cli_params = sampling_params(cli.build_parser().parse_args(args), llm.get_default_sampling_params())
        assert _fields(cli_params) == _fields(expected), args
    assert _fields(server) == _fields(llm.get_default_sampling_params()) == _fields(expected)
    if not config.keys() - {"bos_token_id"}:
        assert {k: getattr(expected, k) for k in FALLBACK_SAMPLING} == FALLBACK_SAMPLING


def test_generate_chat_and_stream_without_params_take_the_models_defaults(llm, monkeypatch):
    """LLM.chat / generate used SamplingParams() (temperature 1.0) where `deepinfer chat` used 0.7."""
    seen = []
    add = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request",
                        lambda ids, params, **kw: seen.append(params) or add(ids, params, **kw))
    llm.generate([[5, 6, 7]], use_tqdm=False)
    llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    list(llm.stream([5, 6, 7]))
    assert len(seen) == 3
    assert all(_fields(p) == _fields(llm.get_default_sampling_params()) for p in seen)
    assert all(p.temperature == 0.7 and p.repetition_penalty == 1.05 for p in seen)  # the tiny model has no config


def test_the_help_of_generate_and_chat_names_the_fallback(capsys):
    for command in ("generate", "chat"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for name, value in FALLBACK_SAMPLING.items():
            assert f"--{name.replace('_', '-')} {name.upper()} " in text and f"else {value}" in text
    assert set(FALLBACK_SAMPLING) <= set(MODEL_DEFAULT_FLAGS)


@pytest.mark.parametrize("command", ["generate x", "chat", "info", "bench", "serve"])
def test_threads_flag_on_every_subcommand(command):
    args = cli.build_parser().parse_args([*command.split(), "--threads", "3"])
    assert args.threads == 3
    from deepinfer.entrypoints.engine_args import engine_kwargs

    assert engine_kwargs(args)["num_threads"] == 3


def test_llm_num_threads_sets_the_kernels_threads(tiny_checkpoint):
    before = torch.get_num_threads()
    try:
        with LLM(tiny_checkpoint("llama"), num_blocks=16, max_model_len=32, num_threads=1) as one:
            assert torch.get_num_threads() == 1
            out = one.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
            assert len(out.outputs[0].token_ids) == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="num_threads must be a positive integer, got 0"):
        LLM(tiny_checkpoint("llama"), num_threads=0)
