"""`deepinfer chat` without a terminal: history trimming, the model's sampling defaults, commands."""

from __future__ import annotations

import io
import json
import shutil
import types

import pytest

from deepinfer.entrypoints import cli
from deepinfer.entrypoints.chat import (
    CHAT_MAX_TOKENS,
    LENGTH_LIMIT,
    QUIT_HINT,
    MessageTooLong,
    chat_params,
    fit_history,
    reply_room,
    run_chat,
)
from deepinfer.entrypoints.engine_args import sampling_params
from deepinfer.sampling_params import FALLBACK_SAMPLING, SamplingParams


def words(messages: list[dict]) -> list[int]:
    """A stand-in prompt encoder: one token per word and two per message (its role markers)."""
    return [0] * sum(len(m["content"].split()) + 2 for m in messages)


def msg(role: str, text: str) -> dict:
    return {"role": role, "content": text}


SYSTEM = msg("system", "be brief")  # 4 tokens
TURNS = [msg("user", "one two"), msg("assistant", "three four five"), msg("user", "six"),
         msg("assistant", "seven eight"), msg("user", "nine ten eleven")]  # 4 + 5 + 3 + 4 + 5 tokens


def test_fit_history_keeps_everything_that_fits_and_encodes_once():
    calls = []
    kept, ids = fit_history([SYSTEM, *TURNS], lambda m: calls.append(m) or words(m), max_prompt_tokens=25)
    assert kept == [SYSTEM, *TURNS] and len(ids) == 25 and len(calls) == 1


def test_fit_history_drops_oldest_turns_keeps_the_system_prompt_and_starts_with_a_user():
    messages = [SYSTEM, *TURNS]
    kept, ids = fit_history(messages, words, max_prompt_tokens=20)  # 25 tokens: the first turn (user + reply) goes
    assert kept == [SYSTEM, *TURNS[2:]] and len(ids) == 16
    assert messages == [SYSTEM, *TURNS]  # the caller's list is left alone
    kept, _ = fit_history(messages, words, max_prompt_tokens=11)  # only the newest message still fits
    assert kept == [SYSTEM, TURNS[-1]]
    kept, _ = fit_history(TURNS, words, max_prompt_tokens=12)  # no system prompt: nothing is special
    assert kept == TURNS[2:]


def test_fit_history_refuses_a_message_that_cannot_fit_alone():
    with pytest.raises(MessageTooLong, match="9 prompt tokens, over the 8") as exc:
        fit_history([SYSTEM, *TURNS], words, max_prompt_tokens=8)
    assert exc.value.num_tokens == 9 and exc.value.max_prompt_tokens == 8


def test_reply_room_is_max_tokens_within_half_the_context():
    assert reply_room(40, 100) == 40
    assert reply_room(100, 100) == 50
    assert reply_room(4096, 4096) == 1024
    assert reply_room(5, 1) == 1


def llm_with_generation_config(config: dict):
    """An LLM whose engine has only what get_default_sampling_params reads (no model is loaded)."""
    from deepinfer import LLM

    llm = LLM.__new__(LLM)
    llm.engine = types.SimpleNamespace(source=types.SimpleNamespace(generation_config=config, path="m"))
    return llm


@pytest.mark.parametrize("config, expected", [
    ({}, dict(temperature=0.7, top_p=0.9, repetition_penalty=1.05, top_k=0)),  # GGUF: no config
    ({"bos_token_id": 1, "eos_token_id": 2}, dict(temperature=0.7, top_p=0.9, repetition_penalty=1.05)),
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 300},
     dict(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.0, max_tokens=300)),
    ({"do_sample": False, "temperature": 0.6}, dict(temperature=0.0, top_p=1.0)),  # greedy, as transformers does
])
def test_default_sampling_params_follow_the_generation_config(config, expected):
    params = llm_with_generation_config(config).get_default_sampling_params()
    assert {name: getattr(params, name) for name in expected} == expected


def test_a_bad_generation_config_value_is_named():
    with pytest.raises(ValueError, match=r"generation config of 'm': top_p must be in \(0, 1\], got 0"):
        llm_with_generation_config({"top_p": 0.0}).get_default_sampling_params()


def test_hf_source_reads_generation_config(tiny_checkpoint, tmp_path):
    from transformers import GenerationConfig

    from deepinfer.model_executor.loader.hf import load_hf_source

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), path)
    (path / "generation_config.json").unlink(missing_ok=True)
    assert load_hf_source(str(path)).generation_config == {}
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.8, repetition_penalty=1.1).save_pretrained(path)
    config = load_hf_source(str(path)).generation_config
    assert (config["temperature"], config["top_p"], config["repetition_penalty"]) == (0.6, 0.8, 1.1)


def test_chat_flags_default_to_the_model_and_explicit_ones_win():
    args = cli.build_parser().parse_args(["chat", "--top-p", "0.5"])
    assert args.temperature is None and args.repetition_penalty is None
    assert args.max_tokens == CHAT_MAX_TOKENS == 1024  # a reply is capped unless --max-tokens says otherwise
    model = SamplingParams(temperature=0.6, top_p=0.95, repetition_penalty=1.1, max_tokens=7)
    params = sampling_params(args, model)
    assert (params.temperature, params.top_p, params.repetition_penalty, params.max_tokens) == (0.6, 0.5, 1.1, 1024)
    assert sampling_params(args).temperature == SamplingParams().temperature  # no defaults: SamplingParams'
    assert cli.build_parser().parse_args(["chat", "--max-tokens", "5"]).max_tokens == 5
    gen = cli.build_parser().parse_args(["generate", "x"])  # generate: the model's sampling too, 128 tokens
    assert gen.temperature is None and gen.top_p is None and gen.max_tokens == 128


def test_chat_params_cap_a_reply_by_default():
    """The first answer of `deepinfer chat` used to have no cap but the context (minutes of text)."""
    llm = llm_with_generation_config({})
    params = chat_params(cli.build_parser().parse_args(["chat"]), llm)
    assert params.max_tokens == CHAT_MAX_TOKENS
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.7, 0.9, 1.05)


class InterruptingStdin(io.StringIO):
    """Lines to read, where the entry None stands for a Ctrl-C landing while the prompt waits."""

    def __init__(self, lines):
        super().__init__()
        self.lines = list(lines)

    def readline(self, *args):
        line = self.lines.pop(0) if self.lines else ""
        if line is None:
            raise KeyboardInterrupt
        return line


def test_one_ctrl_c_at_the_prompt_does_not_end_the_session(tiny_checkpoint):
    """A Ctrl-C meant for an answer that has just ended lands at the prompt: the session says how to
    leave and goes on; only a second Ctrl-C in a row leaves with 130."""
    from deepinfer import LLM

    llm = LLM(tiny_checkpoint("llama"), num_blocks=32, max_model_len=48)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = io.StringIO()
    assert run_chat(llm, params, stdin=InterruptingStdin(["hi\n", None, "again\n", "/exit\n"]), stdout=out) == 0
    text = out.getvalue()
    assert QUIT_HINT in text and text.count(LENGTH_LIMIT) == 2  # both answers came
    out = io.StringIO()
    assert run_chat(llm, params, stdin=InterruptingStdin(["hi\n", None, None]), stdout=out) == 130
    out = io.StringIO()  # a line typed between two Ctrl-Cs disarms the first
    assert run_chat(llm, params, stdin=InterruptingStdin([None, "/help\n", None, ""]), stdout=out) == 0


def test_chat_help_says_the_flags_default_to_the_model(capsys):
    with pytest.raises(SystemExit):
        cli.main(["chat", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name, value in FALLBACK_SAMPLING.items():  # the help spells out what get_default_sampling_params gives
        flag = "--" + name.replace("_", "-")
        assert f"{flag} {name.upper()} " in help_text
        assert help_text.split(f"{flag} {name.upper()} ")[1].split(" --")[0].endswith(f"else {value}")
    assert "cap on each reply, which also stops at the end of the context (default: 1024)" in help_text


def test_commands_and_a_context_that_overflows(tiny_checkpoint, tmp_path):
    """Without a terminal: commands are never sent to the model, the history that outgrows the
    context loses its oldest turns with a notice, a too-long message is refused, the session goes on."""
    from deepinfer import LLM

    llm = LLM(tiny_checkpoint("llama"), num_blocks=32, max_model_len=48)
    prompts = []
    original = llm.apply_chat_template
    llm.apply_chat_template = lambda msgs, *a: prompts.append(list(msgs)) or original(msgs, *a)
    saved = tmp_path / "chat.json"
    lines = ["/help", "/system be brief", "/bogus", "first", "/stats", "second", "third",
             "word " * 60, f"/save {saved}", "/reset", "/stats", "/exit"]
    out = io.StringIO()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert run_chat(llm, params, stdin=io.StringIO("\n".join(lines) + "\n"), stdout=out) == 0
    text = out.getvalue()
    assert "/save FILE" in text and "system prompt set: be brief" in text
    assert "unknown command /bogus; /help lists the commands" in text
    assert text.count(LENGTH_LIMIT + "\n") == 3  # each reply ran into --max-tokens 12
    assert "[dropped 2 oldest messages to fit the 48-token context]" in text
    assert "[message not sent: " in text and "history cleared" in text
    assert all(not m["content"].startswith("/") for sent in prompts for m in sent)
    assert all(sent[0] == {"role": "system", "content": "be brief"} for sent in prompts)
    conversation = json.loads(saved.read_text())
    assert conversation[0] == {"role": "system", "content": "be brief"}
    assert [m["role"] for m in conversation[1:]] == ["user", "assistant"] * ((len(conversation) - 1) // 2)
    assert conversation[-2]["content"] == "third" and conversation[1]["content"] != "first"
    assert "last reply: 12 tokens in " in text and "prompt " in text
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_a_refused_request_is_one_line_and_the_session_goes_on():
    """The engine refusing a turn (here: every other one) costs that turn only; history stays as it was."""
    from deepinfer.outputs import CompletionOutput, RequestOutput

    calls = []

    def stream(ids, params):
        calls.append(list(ids))
        if len(calls) == 1:
            raise ValueError("the KV cache cannot hold it")
        yield RequestOutput("r", None, ids, [CompletionOutput(0, "hi", [5], delta_text="hi", finish_reason="stop")],
                            finished=True)

    llm = types.SimpleNamespace(engine=types.SimpleNamespace(max_model_len=100), stream=stream,
                                apply_chat_template=lambda msgs, *a: [len(m["content"]) for m in msgs])
    out = io.StringIO()
    assert run_chat(llm, SamplingParams(max_tokens=10), stdin=io.StringIO("first\nsecond\n"), stdout=out) == 0
    assert "[message not sent: the KV cache cannot hold it]" in out.getvalue() and "> hi\n" in out.getvalue()
    assert calls[1] == [len("second")]  # the refused turn left no trace in the history
