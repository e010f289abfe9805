"""What the server's log says about tool calls and client errors, on tiny models with hand-written
templates: the start-up line naming the chat template's tool format and the parser chosen (or that
none applies), one line per 4xx with its reason and without the request's body, and a forced call
the server cannot constrain blamed on the model's template (param tool_choice), not on `tools`."""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
from agent_models import HERMES, TOOL_TEMPLATES, WEATHER, templated_checkpoint
from app_server import AppServer

from deepinfer.entrypoints.openai.error_log import MAX_MESSAGE_CHARS, client_error_line
from deepinfer.serving.chat.diagnostics import template_takes_tools, tool_call_summary
from deepinfer.serving.chat.tool_parsers import make_tool_parser

PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_FORMAT = "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}" + PLAIN  # reads tools, writes no known calls
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
REFUSED = 'requests with tools are refused unless tool_choice is "none"'
SECRET = "SECRET-BODY-TEXT-4711"
CHAT = "/v1/chat/completions"


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def server_log():
    """The messages logged on "deepinfer.server" (at INFO and above) while the block runs."""
    logger, handler = logging.getLogger("deepinfer.server"), _Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _served(tiny_checkpoint, tmp_path_factory, template: str, *flags: str):
    path = templated_checkpoint(tiny_checkpoint("llama"), str(tmp_path_factory.mktemp("tmpl")), template)
    return AppServer("--model", path, "--served-model-name", "tiny", *flags)


@pytest.fixture(scope="module")
def hermes(tiny_checkpoint, tmp_path_factory):
    """The hermes-template server and every line its logger writes, from its start-up on."""
    with server_log() as lines, _served(tiny_checkpoint, tmp_path_factory, HERMES, "--max-body-bytes", "4096") as app:
        yield app, lines


def _tool_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("tool calls:")]


def test_the_start_up_line_names_the_template_format_and_the_parser(hermes):
    app, lines = hermes
    assert _tool_lines(lines) == ["tool calls: the chat template takes tools in the hermes format (<tool_call>); "
                                  "parser: hermes"]


@pytest.mark.slow
def test_a_template_without_tools_says_so_at_start_up_and_refuses_tools(tiny_checkpoint, tmp_path_factory):
    with server_log() as lines, _served(tiny_checkpoint, tmp_path_factory, PLAIN) as app:
        assert _tool_lines(lines) == [f"tool calls: the chat template has no tool support; {REFUSED}"]
        resp = app.client.post(CHAT, json={"messages": QUESTION, "tools": [WEATHER], "max_tokens": 1})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools"
        assert app.client.post(CHAT, json={"messages": QUESTION, "tools": [WEATHER], "tool_choice": "none",
                                           "max_tokens": 1}).status_code == 200


@pytest.fixture(scope="module")
def tokenizer(hermes):
    return copy.deepcopy(hermes[0].llm.get_tokenizer())


def _summary(tokenizer, template: str | None, requested: str = "auto") -> str:
    tokenizer.chat_template = template
    return tool_call_summary(tokenizer, requested, make_tool_parser(requested, tokenizer))


@pytest.mark.parametrize("name", sorted(TOOL_TEMPLATES))
def test_each_known_format_is_named_with_its_parser(tokenizer, name):
    summary = _summary(tokenizer, TOOL_TEMPLATES[name])
    assert summary.startswith(f"tool calls: the chat template takes tools in the {name} format (")
    assert summary.endswith(f"; parser: {name}")


def test_the_other_cases_of_the_start_up_line(tokenizer):
    assert _summary(tokenizer, NO_FORMAT) == ("tool calls: the chat template takes tools but writes calls in no "
                                              f"format the server knows; {REFUSED}")
    assert _summary(tokenizer, HERMES, "mistral").endswith(
        "takes tools in the hermes format (<tool_call>); parser: mistral (--tool-call-parser; the template "
        "writes hermes)")
    assert _summary(tokenizer, PLAIN, "hermes") == ("tool calls: the chat template has no tool support; parser: "
                                                    "hermes (--tool-call-parser)")
    assert _summary(tokenizer, None).startswith("tool calls: the model has no chat template")
    assert template_takes_tools(NO_FORMAT) and not template_takes_tools(PLAIN + "{# tools #}")


def _new_lines(lines: list[str], since: int, prefix: str) -> list[str]:
    return [line for line in lines[since:] if line.startswith(prefix)]


def test_a_400_is_logged_in_one_line_with_its_reason_and_no_body(hermes):
    app, lines = hermes
    since = len(lines)
    resp = app.client.post(CHAT, json={"messages": [{"role": "user", "content": SECRET}], "max_tokens": -5})
    assert resp.status_code == 400
    error = resp.json()["error"]
    (line,) = _new_lines(lines, since, f"POST {CHAT} -> 400")
    assert f"param {error['param']}" in line and line.endswith(error["message"][:MAX_MESSAGE_CHARS])
    assert not any(SECRET in logged for logged in lines)


def test_4xx_answers_from_middlewares_and_unknown_routes_are_logged_too(hermes):
    app, lines = hermes
    since = len(lines)
    too_big = app.client.post(CHAT, json={"messages": [{"role": "user", "content": SECRET * 400}]})
    assert too_big.status_code == 413
    assert app.client.get("/v1/nowhere").status_code == 404
    (big,) = _new_lines(lines, since, f"POST {CHAT} -> 413")
    assert "the request body is too large" in big
    assert len(_new_lines(lines, since, "GET /v1/nowhere -> 404")) == 1
    assert not any(SECRET in logged for logged in lines)


def test_the_log_line_is_cut_and_cannot_be_forged():
    body = b'{"error": {"message": "bad\\nINFO: forged ' + b"x" * 1000 + b'", "param": "tools", "code": null}}'
    line = client_error_line("POST", "/v1/chat/completions", 400, body)
    assert line.startswith("POST /v1/chat/completions -> 400 (param tools): bad\\nINFO: forged xxx")
    assert "\n" not in line and line.endswith("...") and len(line) < MAX_MESSAGE_CHARS + 80
    assert client_error_line("GET", "/x", 404, b"not json") == "GET /x -> 404: (no error message)"


def _refuse(*args, **kwargs):
    raise ValueError('token "<tool_call>" doesn\'t satisfy the grammar; forced bytes: got \'<\'')


@pytest.mark.parametrize("where", ["compiling", "building"])
def test_a_forced_call_the_server_cannot_constrain_blames_the_template_not_tools(hermes, monkeypatch, where):
    app, lines = hermes
    if where == "compiling":  # llguidance refuses the forced call's grammar (not the tool's own schema) at admission
        grammars = app.app.state.server.grammars
        prepare = grammars.prepare
        monkeypatch.setattr(grammars, "prepare", lambda spec, *a: prepare(spec, *a) if spec.kind == "json"
                            else _refuse())
    else:  # the grammar is refused while the chat's constraint is built
        monkeypatch.setattr("deepinfer.serving.chat.prompt.forced_call", _refuse)
    since = len(lines)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        resp = app.client.post(CHAT, json={"messages": QUESTION, "tools": [WEATHER], "tool_choice": choice})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == ("tool_choice", "unsupported_tool_choice")
        assert "this model's chat template" in error["message"] and "hermes format" in error["message"]
        assert not error["message"].startswith("tools")
    logged = _new_lines(lines, since, f"POST {CHAT} -> 400")
    assert len(logged) == 2 and all("code unsupported_tool_choice, param tool_choice" in x for x in logged)


def test_a_forced_call_of_a_refused_schema_blames_the_tool(hermes):
    """The forced call's grammar is refused because the client's own argument schema is (it refers to
    itself): a 400 naming `tools` and the function's parameters, not the template."""
    app, _ = hermes
    selfref = {"type": "function", "function": {"name": "loop", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}
    resp = app.client.post(CHAT, json={"messages": QUESTION, "tools": [WEATHER, selfref],
                                       "tool_choice": {"type": "function", "function": {"name": "loop"}}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "tools" and "tools[1].function.parameters" in error["message"], error
