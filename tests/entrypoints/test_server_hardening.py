"""`deepinfer serve` against hostile input: no 5xx from any body, tokenization off the event
loop, bounded connections, strict request types, OpenAI-only finish reasons, and an exit on a
fatal engine fault.

What a request gets is tested on the app in this process (`AppServer`). Connection limits, a
shutdown by SIGTERM and the exit status after a fatal fault need a `deepinfer serve` subprocess
on a free 127.0.0.1 port, killed in teardown; the hardened one uses ~1 s connection timeouts to
keep the tests short.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from app_server import AppServer
from live_server import LiveServer

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_CONNECTIONS = 24
TIMEOUT_S = 1.0
INTERNAL_NAMES = ("Error", "Exception", "Traceback", "TypeError", "ValueError", "RecursionError")


@pytest.fixture(scope="module")
def app(tiny_checkpoint):
    with AppServer("--model", tiny_checkpoint("llama"), api_key=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def hardened(tiny_checkpoint):
    flags = ["--timeout-keep-alive", "--timeout-request-header", "--timeout-request-body"]
    timeouts = [x for flag in flags for x in (flag, str(TIMEOUT_S))]
    with LiveServer("--model", tiny_checkpoint("llama"), *timeouts, "--max-connections", str(MAX_CONNECTIONS),
                    api_key=KEY) as server:
        yield server


def post_raw(server: AppServer, path: str, raw: bytes, headers: dict | None = None,
             timeout: float = 60) -> httpx.Response:
    headers = (AUTH if headers is None else headers) | {"Content-Type": "application/json"}
    return server.client.post(path, content=raw, headers=headers, timeout=timeout)


def dumps(body: dict) -> bytes:
    """JSON with \\u escapes, so that lone surrogates survive (httpx's own encoder would refuse them)."""
    return json.dumps(body, ensure_ascii=True).encode()


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert not any(name in error["message"] for name in INTERNAL_NAMES), error
    return error


# -- 1. no 5xx from input ---------------------------------------------------------------------------

_BIG = "9" * 5001
_MSG = [{"role": "user", "content": "hi"}]
HOSTILE = [  # (name, path, raw body, param, code)
    ("prompt nested 100k deep", CMPL, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "prompt",
     "invalid_json"),
    ("messages nested deep", CHAT, b'{"messages": [{"role": "user", "content": "x", "name": '
     + b"{\"a\": " * 5000 + b"1" + b"}" * 5000 + b"}]}", "messages", "invalid_json"),
    ("5001-digit max_tokens", CMPL, f'{{"prompt": "hi", "max_tokens": {_BIG}}}'.encode(), "max_tokens",
     "invalid_number"),
    ("5001-digit seed", CHAT, f'{{"messages": [{{"role": "user", "content": "hi"}}], "seed": -{_BIG}}}'.encode(),
     "seed", "invalid_number"),
    ("5001-digit token id", CMPL, f'{{"prompt": [1, {_BIG}]}}'.encode(), "prompt", "invalid_number"),
    ("5001-digit float", CMPL, f'{{"prompt": "hi", "temperature": 0.{_BIG}}}'.encode(), "temperature",
     "invalid_number"),
    ("5001-digit unknown field", CMPL, f'{{"prompt": "hi", "junk": {_BIG}}}'.encode(), "junk", "invalid_number"),
    ("float overflow", CMPL, b'{"prompt": "hi", "top_p": 1e999}', "top_p", "invalid_number"),
    ("NaN", CMPL, b'{"prompt": "hi", "temperature": NaN}', "temperature", "invalid_number"),
    ("surrogate in prompt", CMPL, dumps({"prompt": "a\ud800b"}), "prompt", "invalid_unicode"),
    ("surrogate in prompt list", CMPL, dumps({"prompt": ["a\udfff"]}), "prompt", "invalid_unicode"),
    ("surrogate in model", CMPL, dumps({"prompt": "hi", "model": "m\ud800"}), "model", "invalid_unicode"),
    ("surrogate in stop", CMPL, dumps({"prompt": "hi", "stop": ["ok", "\ud800"]}), "stop", "invalid_unicode"),
    ("surrogate in user", CMPL, dumps({"prompt": "hi", "user": "\ud800"}), "user", "invalid_unicode"),
    ("surrogate in chat content", CHAT, dumps({"messages": [{"role": "user", "content": "\ud800"}]}), "messages",
     "invalid_unicode"),
    ("surrogate in chat role", CHAT, dumps({"messages": [{"role": "\udc00", "content": "x"}]}), "messages",
     "invalid_unicode"),
    ("surrogate in chat model", CHAT, dumps({"messages": _MSG, "model": "\ud800"}), "model", "invalid_unicode"),
    ("surrogate in a field name", CMPL, dumps({"prompt": "hi", "\ud800": 1}), None, "invalid_unicode"),
    ("UTF-8-encoded surrogate", CMPL, b'{"prompt": "a\xed\xa0\x80b"}', None, "invalid_json"),
    ("not UTF-8", CMPL, b'{"prompt": "\xff\xfe"}', None, "invalid_json"),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_bodies_get_a_400_naming_the_field(app, case):
    _, path, raw, param, code = case
    error = assert_openai_error(post_raw(app, path, raw), 400, param, code)
    if param is not None:
        assert param in error["message"]


STRICT = [  # (name, path, body, param): OpenAI's types, no coercion
    ("max_tokens true", CMPL, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("stream 'yes'", CMPL, {"prompt": "hi", "stream": "yes"}, "stream"),
    ("stream 1", CHAT, {"messages": _MSG, "stream": 1}, "stream"),
    ("temperature '0.5'", CMPL, {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("max_tokens 2.0", CMPL, {"prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
    ("logprobs true on completions", CMPL, {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("logprobs 1 on chat", CHAT, {"messages": _MSG, "logprobs": 1}, "logprobs"),
    ("token id true", CMPL, {"prompt": [1, True]}, "prompt"),
    ("include_usage 'yes'", CMPL, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options"),
    ("ignore_eos 'true'", CMPL, {"prompt": "hi", "ignore_eos": "true"}, "ignore_eos"),
    ("seed over 64 bits", CMPL, {"prompt": "hi", "seed": 2**64}, "seed"),
    ("model 5", CMPL, {"prompt": "hi", "model": 5}, "model"),
]


@pytest.mark.parametrize("case", STRICT, ids=[c[0] for c in STRICT])
def test_request_types_are_strict(app, case):
    _, path, body, param = case
    assert_openai_error(post_raw(app, path, dumps(body)), 400, param)


def test_a_strict_request_still_accepts_ints_for_floats(app):
    body = {"prompt": [5, 6], "max_tokens": 2, "temperature": 0, "top_p": 1, "ignore_eos": True, "stream": False}
    resp = post_raw(app, CMPL, dumps(body))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] == "length"


def test_internal_errors_name_only_a_request_id(caplog):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from deepinfer.entrypoints.openai.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a secret internal detail")

    with caplog.at_level(logging.ERROR, logger="deepinfer.server"):
        resp = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert resp.status_code == 500
    error = resp.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert error["message"].startswith("internal error (request id req-")
    assert "secret" not in resp.text and "RuntimeError" not in resp.text
    request_id = resp.headers["x-request-id"]
    assert request_id in error["message"]
    (record,) = [r for r in caplog.records if request_id in r.getMessage()]
    assert record.exc_info is not None and "secret" in str(record.exc_info[1])


def test_a_refusing_chat_template_gets_a_400_without_its_text():
    from deepinfer.serving.chat.prompt import ChatSetup
    from deepinfer.serving.errors import ServingError
    from deepinfer.serving.parse import parse_body
    from deepinfer.serving.prepare import prepare_chat
    from deepinfer.serving.protocol import ChatCompletionRequest

    class RefusingTokenizer:
        chat_template = "{{ raise_exception('a secret internal detail') }}"

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("a secret internal detail")

    class State:
        chat_setup = ChatSetup()  # no tool or reasoning parser

        def check_model(self, model):
            pass

    raw = json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}).encode()
    with pytest.raises(ServingError) as err:
        prepare_chat(RefusingTokenizer(), State(), parse_body(raw, ChatCompletionRequest))
    assert err.value.status_code == 400 and err.value.param() == "messages"
    assert "secret" not in err.value.message() and "ValueError" not in err.value.message()


# -- 2. tokenization off the event loop -------------------------------------------------------------


@pytest.mark.slow
def test_health_answers_fast_while_a_maximal_prompt_is_tokenized(app):
    """A maximal chat message (a text prompt this long is refused by its length before tokenizing)."""
    max_body = 8 << 20  # the default --max-body-bytes
    prompt = "hello world, " * ((max_body - 200) // 13)
    raw = json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode()
    assert len(raw) <= max_body
    result = {}

    def send():  # a hang guard, not a speed bound: tokenizing takes minutes on a loaded machine
        result["resp"] = post_raw(app, CHAT, raw, timeout=600)

    sender = threading.Thread(target=send)
    latencies = []
    assert app.client.get("/health").status_code == 200
    began = time.perf_counter()
    sender.start()
    time.sleep(0.3)  # the body is handed over; tokenizing it takes seconds
    while sender.is_alive():
        start = time.perf_counter()
        assert app.client.get("/health").status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.05)
    sender.join()
    tokenizing = time.perf_counter() - began
    assert_openai_error(result["resp"], 400, "messages", "context_length_exceeded")
    latencies.sort()
    print(f"\n/health during tokenization: {len(latencies)} probes, median "
          f"{latencies[len(latencies) // 2] * 1e3:.1f} ms, p90 {latencies[int(len(latencies) * 0.9)] * 1e3:.1f} ms, "
          f"max {latencies[-1] * 1e3:.1f} ms")
    # on the event loop, one probe would wait out the whole tokenization (seconds), and there would be
    # one or two probes: counted, and each probe against the tokenization of the same run (a busy
    # machine slows both), not against a number of seconds
    assert len(latencies) >= 10, "tokenizing took too little time to measure anything"
    assert latencies[-1] < tokenizing / 4, (latencies[-5:], tokenizing)


# -- 3. connection limits ---------------------------------------------------------------------------


def _open(server: LiveServer, first_bytes: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


def _wait_closed(sock: socket.socket, limit_s: float) -> bytes:
    """Everything the server sent until it closed the connection (fails after `limit_s`)."""
    sock.settimeout(limit_s)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.mark.live_server
def test_slow_connections_are_closed_while_others_are_served(hardened):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
    start = time.monotonic()
    idle = [_open(hardened) for _ in range(4)]
    partial_head = [_open(hardened, head) for _ in range(4)]
    partial_body = [_open(hardened, head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ') for _ in range(4)]
    resp = httpx.post(hardened.url + CMPL, json={"prompt": [5, 6], "max_tokens": 3}, headers=AUTH, timeout=30)
    assert resp.status_code == 200, resp.text  # served meanwhile
    answers = {kind: [_wait_closed(s, 5 * TIMEOUT_S) for s in socks]
               for kind, socks in (("idle", idle), ("head", partial_head), ("body", partial_body))}
    elapsed = time.monotonic() - start
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 3, elapsed
    assert answers["idle"] == [b""] * 4  # closed without a word
    for answer in answers["head"] + answers["body"]:
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"code":"request_timeout"' in answer.replace(b" ", b"")
    for sock in idle + partial_head + partial_body:
        sock.close()


@pytest.mark.live_server
def test_a_trickling_client_is_closed_at_the_deadline(hardened):
    sock = _open(hardened)
    sock.settimeout(0.2)
    answer, sent = b"", 0
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    with pytest.raises(OSError):  # the server closes the connection: a reset, or EOF below
        for byte in head:
            sock.send(bytes([byte]))
            sent += 1
            try:
                if (chunk := sock.recv(65536)) == b"":
                    raise ConnectionResetError("EOF")
                answer += chunk
            except TimeoutError:
                pass
    # closed well before the whole head was sent (a byte per 0.2 s, ~30 s): a per-read timeout would never
    # fire here. Counted in bytes, with room for a busy machine (~TIMEOUT_S / 0.2 bytes on a quiet one)
    assert sent < len(head) // 2, sent
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
    sock.close()


@pytest.mark.live_server
def test_connections_over_the_cap_get_503(hardened):
    held = [_open(hardened) for _ in range(MAX_CONNECTIONS)]
    try:
        resp = httpx.get(hardened.url + "/v1/models", headers=AUTH, timeout=5)
        error = assert_openai_error(resp, 503, None, "server_unavailable")
        assert "connections" in error["message"] and resp.headers["connection"] == "close"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while (resp := httpx.get(hardened.url + "/v1/models", headers=AUTH, timeout=5)).status_code == 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert resp.status_code == 200


# -- 4. names, auth, finish reasons -----------------------------------------------------------------


def test_models_show_the_served_name_not_a_path(app, tiny_checkpoint):
    card = app.client.get("/v1/models", headers=AUTH).json()["data"][0]
    assert card["id"] == card["root"] == os.path.basename(tiny_checkpoint("llama"))
    assert os.sep not in json.dumps(card)
    resp = app.client.post(CMPL, json={"prompt": [5], "max_tokens": 1, "model": card["id"]}, headers=AUTH)
    assert resp.status_code == 200 and resp.json()["model"] == card["id"]


@pytest.mark.real_model
@pytest.mark.parametrize("model, served, expected", [
    ("/models/smol/model-q8.gguf", None, "model-q8"), ("/models/smol/", None, "smol"),
    ("./relative/dir", None, "dir"), (None, None, "SmolLM2-135M-Instruct"), ("/x/y.gguf", "mine", "mine"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", None, "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("gemma3-270m", None, "gemma3-270m")])
def test_served_model_name_defaults_to_the_base_name(model, served, expected):
    from deepinfer.entrypoints.openai.args import served_model_name

    assert served_model_name(argparse.Namespace(model=model, served_model_name=served)) == expected


@pytest.mark.parametrize("values", [[f"Bearer {KEY}", f"Bearer {KEY}"], [f"Bearer {KEY}", "Bearer nope"],
                                    ["Bearer nope", f"Bearer {KEY}"]])
def test_duplicate_authorization_headers_are_refused(app, values):
    headers = [("Authorization", value) for value in values]
    resp = app.client.get("/v1/models", headers=headers)
    error = assert_openai_error(resp, 400, None, "invalid_api_key")
    assert "Authorization" in error["message"]


class _FakeHandle:
    """A RequestHandle that yields the given outputs."""

    request_id = "r"

    def __init__(self, outputs):
        self._outputs, self.aborted = list(outputs), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._outputs:
            raise StopAsyncIteration
        return self._outputs.pop(0)

    def abort(self):
        self.aborted = True


def _output(finish_reason, text="", error=None):
    from deepinfer.outputs import CompletionOutput, RequestOutput

    c = CompletionOutput(0, text=text, token_ids=[1] * len(text), finish_reason=finish_reason, delta_text=text,
                         delta_token_ids=[1] * len(text))
    return RequestOutput("r", None, [1], [c], finished=finish_reason is not None, error=error)


@pytest.mark.parametrize("reason, status, code", [("abort", 503, "request_aborted"), ("error", 500, "internal_error")])
def test_aborted_or_failed_requests_are_errors_not_finish_reasons(reason, status, code):
    from deepinfer.entrypoints.openai.openai_output import CompletionFormatter, OpenAIStream
    from deepinfer.outputs import RequestFailedError
    from deepinfer.serving import run
    from deepinfer.serving.errors import ServingError

    error = RequestFailedError("r", "sampling failed: ValueError: boom") if reason == "error" else None
    outputs = [_output(None, "ab"), _output(reason, error=error)]

    async def connected():
        return False

    with pytest.raises(ServingError) as err:
        asyncio.run(run.whole(None, _FakeHandle(outputs), connected))
    assert (err.value.status_code, err.value.code) == (status, code)
    assert "boom" not in err.value.message() and "abort" != err.value.message()

    async def stream():
        handle = _FakeHandle(outputs)
        encoder = OpenAIStream(CompletionFormatter("cmpl-1", "m", None, 1, None), True)
        events = [e async for e in run.stream(None, handle, encoder)]
        return events, handle

    events, handle = asyncio.run(stream())
    payloads = [e.removeprefix("data: ").strip() for e in events]
    assert json.loads(payloads[0])["choices"][0]["text"] == "ab"
    assert json.loads(payloads[-2])["error"]["code"] == code and payloads[-1] == "[DONE]"
    assert not any('"finish_reason": "' + reason in p for p in payloads)
    if reason == "error":
        assert "internal error (request id req-" in payloads[-2]


async def _shutdown_scenario(server: LiveServer) -> tuple[httpx.Response, list[str]]:
    body = {"prompt": [11, 12, 13], "max_tokens": 8000, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        stream = await client.send(client.build_request("POST", CMPL, json=body | {"stream": True}), stream=True)
        whole = asyncio.create_task(client.post(CMPL, json=body))
        while server.metrics()["deepinfer_num_requests_running"] < 2:
            await asyncio.sleep(0.05)
        os.kill(server.proc.pid, signal.SIGTERM)
        lines = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
        return await whole, lines


@pytest.mark.live_server
def test_requests_cut_by_shutdown_get_503_or_an_error_event(tiny_checkpoint):
    with LiveServer("--model", tiny_checkpoint("llama"), "--max-model-len", "8192",
                    "--allow-long-max-model-len", "--shutdown-grace", "2") as server:
        whole, lines = asyncio.run(_shutdown_scenario(server))
        server.proc.wait(10)
        assert server.proc.returncode == 0, server.log_tail()
    error = assert_openai_error(whole, 503, None, "request_aborted")
    assert "shutting down" in error["message"] and "retry-after" in whole.headers
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "request_aborted"
    assert all(json.loads(line[6:])["choices"][0]["finish_reason"] is None for line in lines[:-2])


# -- 5. a fatal engine fault ends the process -------------------------------------------------------

_FATAL_STEP = """
from deepinfer.engine.llm_engine import LLMEngine

def _fatal_step(self):
    raise RuntimeError("injected fatal engine fault")

LLMEngine.step = _fatal_step
"""


@pytest.mark.live_server
def test_a_fatal_engine_fault_exits_the_process_non_zero(tiny_checkpoint):
    with LiveServer("--model", tiny_checkpoint("llama"), prelude=_FATAL_STEP) as server:
        resp = httpx.post(server.url + CMPL, json={"prompt": [5, 6], "max_tokens": 3}, timeout=30)
        error = assert_openai_error(resp, 500, None, "internal_error")
        assert "injected" not in error["message"]
        server.proc.wait(30)
        log = server.log_tail()
    assert server.proc.returncode not in (0, None), log
    assert "fatal" in log and "injected fatal engine fault" in log
