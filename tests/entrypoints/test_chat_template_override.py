"""`--chat-template FILE|TEMPLATE` and `LLM(chat_template=...)` replace the model's chat template for
the server (/tokenize renders with it, the tool-call format is detected from it), `LLM.chat`,
`deepinfer chat` and `generate`; bad values are refused, naming the option, before the model loads.
And a GGUF model's id (/v1/models) is the file's stem unless --served-model-name says otherwise."""

from __future__ import annotations

import argparse

import gguf
import pytest
from agent_models import HERMES
from app_server import AppServer
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints import cli
from deepinfer.entrypoints.engine_args import make_llm
from deepinfer.entrypoints.openai.args import served_model_name

MARKED = ("{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}"
          "{% if add_generation_prompt %}<<assistant|{% endif %}")
CHAT = [{"role": "user", "content": "Hello there"}]
MARKED_TEXT = "<<user|Hello there>><<assistant|"


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("templates") / "marked.jinja"
    path.write_text(MARKED)
    return str(path)


def _rendered(app) -> str:
    """The chat prompt /tokenize counts for CHAT, as text."""
    tokens = app.client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    return app.client.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_the_server_renders_with_a_template_file(tiny_checkpoint, template_file):
    with AppServer("--model", tiny_checkpoint("llama"), "--chat-template", template_file) as app:
        assert _rendered(app) == MARKED_TEXT
        answer = app.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
        assert answer["usage"]["prompt_tokens"] == len(app.llm.get_tokenizer()(MARKED_TEXT)["input_ids"])


@pytest.mark.slow
def test_the_server_renders_with_a_template_string_and_detects_its_tool_format(tiny_checkpoint):
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    expected = own.apply_chat_template(CHAT, chat_template=HERMES, add_generation_prompt=True, tokenize=False)
    assert expected != own.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    with AppServer("--model", tiny_checkpoint("llama"), "--chat-template", HERMES) as app:
        assert _rendered(app) == expected
        assert app.app.state.server.chat_setup.tool_parser.name == "hermes"


@pytest.mark.slow
def test_llm_chat_takes_a_template_string_or_file(tiny_checkpoint, template_file):
    params = SamplingParams(max_tokens=1, temperature=0)
    for value in (MARKED, template_file):
        with LLM(tiny_checkpoint("llama"), chat_template=value) as llm:
            tokenizer = llm.get_tokenizer()
            assert tokenizer.decode(llm.apply_chat_template(CHAT)) == MARKED_TEXT
            (out,) = llm.chat(CHAT, params, use_tqdm=False)
            assert out.prompt_token_ids == tokenizer(MARKED_TEXT, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("command", [["chat"], ["generate", "hi"]])
def test_chat_and_generate_take_the_flag(tiny_checkpoint, template_file, command):
    args = cli.build_parser().parse_args([*command, "--model", tiny_checkpoint("llama"),
                                          "--chat-template", template_file])
    with make_llm(args) as llm:  # what cmd_chat and cmd_generate build and render with
        assert llm.get_tokenizer().decode(llm.apply_chat_template(CHAT)) == MARKED_TEXT


@pytest.mark.parametrize("value, match", [
    ("no/such/template.jinja", "chat_template 'no/such/template.jinja': no such file, and not a Jinja template"),
    ("{% for m in messages %}{{ m.content }", "is not a valid Jinja template: unexpected '}' \\(line 1\\)"),
    ("", "chat_template must be a Jinja template or a path to a file holding one, got ''")])
def test_bad_templates_are_refused_before_the_model_loads(value, match):
    with pytest.raises(ValueError, match=match):
        LLM("/no/such/model", chat_template=value)


def test_a_file_without_jinja_is_refused(tmp_path):
    path = tmp_path / "plain.txt"
    path.write_text("just words")
    with pytest.raises(ValueError, match="the file holds no Jinja template"):
        LLM("/no/such/model", chat_template=str(path))


def _tiny_gguf(path, tokenizer: bool = True) -> str:
    config = tiny_hf_config("llama")
    state = random_hf_model(config).state_dict()
    return write_gguf(path, "llama", config, state, qtype=gguf.GGMLQuantizationType.Q8_0, tokenizer=tokenizer)


def test_a_gguf_model_is_served_under_its_file_stem(tmp_path):
    path = _tiny_gguf(tmp_path / "Tiny-Llama-Q8_0.gguf")
    with AppServer("--model", path) as app:
        assert [card["id"] for card in app.client.get("/v1/models").json()["data"]] == ["Tiny-Llama-Q8_0"]
        resp = app.client.post("/v1/completions", json={"model": "Tiny-Llama-Q8_0", "prompt": [5], "max_tokens": 1})
        assert resp.status_code == 200 and resp.json()["model"] == "Tiny-Llama-Q8_0"


def test_the_served_name_of_gguf_files():
    cases = [("/m/SmolLM2-135M-Instruct-Q4_K_M.gguf", None, "SmolLM2-135M-Instruct-Q4_K_M"),
             ("bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_K_M.gguf", None,
              "SmolLM2-135M-Instruct-Q4_K_M"),
             ("/m/x.Q8_0.GGUF", None, "x.Q8_0"), ("/m/x.gguf", "mine", "mine"), ("/m/dir.gguf.d", None, "dir.gguf.d")]
    for model, served, expected in cases:
        assert served_model_name(argparse.Namespace(model=model, served_model_name=served)) == expected, model


def test_a_model_without_tokenizer_refuses_a_template(tmp_path):
    path = _tiny_gguf(tmp_path / "bare.gguf", tokenizer=False)
    with pytest.raises(ValueError, match="chat_template: this model ships no tokenizer"):
        LLM(path, chat_template=MARKED)
