"""`deepinfer serve` against live clients: the official openai client, concurrent streams with
disconnects, a table of bad requests, a full queue, and SIGTERM under load.

The API's semantics are tested on the app in this process (`AppServer`; served on a free
127.0.0.1 port where a client must leave mid-answer or another program is the client); a full
queue drained by SIGTERM on a `deepinfer serve` subprocess, killed in teardown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import time

import httpx
import pytest
from app_server import AppServer
from live_server import LiveServer

KEY = "test-key"
MAX_BODY = 64 * 1024
EXIT_BOUND_S = 120  # how long a stopped server may take to exit before the test calls it hung


@pytest.fixture(scope="module")
def tiny_server(tiny_checkpoint):
    with AppServer("--model", tiny_checkpoint("llama"), "--max-body-bytes", str(MAX_BODY),
                   api_key=KEY) as server:
        yield server


# -- the official client on the default model ------------------------------------------------------


@pytest.fixture(scope="module")
def offline_llm():
    """The default model offline, an engine of its own beside the app's."""
    from deepinfer import LLM

    with LLM() as llm:
        yield llm


@pytest.mark.real_model
@pytest.mark.slow
def test_openai_client_matches_offline_generate(default_server, offline_llm):
    client = default_server.openai()
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    # the server's unset fields take the model's defaults, as LLM.get_default_sampling_params() gives them
    params = dataclasses.replace(offline_llm.get_default_sampling_params(), max_tokens=8, temperature=0)
    expected = offline_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]

    whole = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert whole.choices[0].text == expected.text
    assert whole.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


@pytest.mark.real_model
@pytest.mark.slow
def test_openai_client_chat_matches_offline_chat(default_server, offline_llm):
    client = default_server.openai()
    messages = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]
    params = dataclasses.replace(offline_llm.get_default_sampling_params(), max_tokens=12, temperature=0)
    expected = offline_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    model = "SmolLM2-135M-Instruct"
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == expected.finish_reason
    stream = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


@pytest.mark.real_model
@pytest.mark.slow
def test_openai_client_logprobs_shapes(default_server):
    client = default_server.openai()
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(lp.token_logprobs[i] <= max(lp.top_logprobs[i].values()) + 1e-6 for i in range(4))
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:  # greedy: the sampled token is the best one
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(item.bytes).decode(errors="replace") == item.token


# -- concurrency and cancellation --------------------------------------------------------------------


async def _stream(client: httpx.AsyncClient, index: int, disconnect_after: int | None) -> tuple:
    """One streamed completion; returns (finish_reason or 'disconnected', chunks, saw [DONE])."""
    body = {"prompt": [100 + index, 200, 300], "temperature": 0, "ignore_eos": True, "stream": True,
            "max_tokens": 600 if disconnect_after else 24}
    num_chunks, finish = 0, None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                return finish, num_chunks, True
            if line.startswith("data: "):
                num_chunks += 1
                finish = json.loads(line[6:])["choices"][0]["finish_reason"]
                if disconnect_after and num_chunks == disconnect_after:
                    return "disconnected", num_chunks, False  # leaving the block closes the connection
    return finish, num_chunks, False


def test_concurrent_streams_with_disconnects_free_the_cache(tiny_server):
    tiny_server.listen()  # clients that leave mid-stream need real connections
    before = tiny_server.metrics()

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=tiny_server.headers,
                                     limits=limits, timeout=60) as client:
            return await asyncio.gather(*(_stream(client, i, 4 if i % 4 == 0 else None)
                                          for i in range(32)))

    results = asyncio.run(run())
    assert sum(r[0] == "disconnected" for r in results) == 8
    assert [r for r in results if r[0] != "disconnected"] == [("length", 24, True)] * 24
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = tiny_server.metrics()
        if (m["deepinfer_num_requests_running"] == 0
                and m["deepinfer_kv_free_blocks"] == m["deepinfer_kv_total_blocks"]):
            break
        time.sleep(0.1)
    aborted = 'deepinfer_requests_total{finish_reason="abort",status="aborted"}'
    finished = 'deepinfer_requests_total{finish_reason="length",status="finished"}'
    assert m[aborted] - before.get(aborted, 0) == 8
    assert m[finished] - before.get(finished, 0) == 24
    assert m["deepinfer_kv_free_blocks"] == m["deepinfer_kv_total_blocks"] > 0
    assert m["deepinfer_kv_cache_usage_perc"] == 0
    assert m["deepinfer_num_requests_waiting"] == 0


def test_non_streaming_client_that_gives_up_is_aborted(tiny_server):
    aborted = 'deepinfer_requests_total{finish_reason="abort",status="aborted"}'
    before = tiny_server.metrics().get(aborted, 0)
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # over a real connection, which the client closes
        httpx.post(f"{tiny_server.listen()}/v1/completions", json=body, headers=_AUTH, timeout=0.5)
    deadline = time.monotonic() + 10
    while tiny_server.metrics().get(aborted, 0) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    m = tiny_server.metrics()
    assert m[aborted] == before + 1
    assert m["deepinfer_kv_free_blocks"] == m["deepinfer_kv_total_blocks"]


def test_bench_serve_replays_cpu32(tiny_server, tmp_path, capsys):
    from deepinfer.entrypoints import cli

    out = tmp_path / "bench.json"
    status = cli.main(["bench", "serve", "--url", tiny_server.listen(), "--api-key", KEY, "--num-requests", "4",
                       "--concurrency", "4", "--json", str(out)])
    res = capsys.readouterr()
    assert status == 0, res.out + res.err
    assert "Serving Benchmark Result" in res.out and "P99 TTFT (ms)" in res.out
    summary = json.loads(out.read_text())
    assert summary["successful_requests"] == 4 and summary["failed_requests"] == 0
    assert summary["total_output_tokens"] == summary["expected_output_tokens"] > 0
    assert 0 < summary["p50_ttft_ms"] <= summary["p99_ttft_ms"]
    assert summary["output_throughput"] > 0 and summary["mean_tpot_ms"] > 0


# -- bad requests --------------------------------------------------------------------------------------

_AUTH = {"Authorization": f"Bearer {KEY}"}
_CMPL, _CHAT = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = [  # (name, path, body (bytes: raw), headers, status, type, param, code)
    ("malformed json", _CMPL, b'{"prompt": ', _AUTH, 400, "invalid_request_error", None, "invalid_json"),
    ("not an object", _CMPL, b"[1, 2]", _AUTH, 400, "invalid_request_error", None, None),
    ("empty body", _CMPL, b"", _AUTH, 400, "invalid_request_error", None, None),
    ("missing prompt", _CMPL, {}, _AUTH, 400, "invalid_request_error", "prompt", None),
    ("prompt of wrong type", _CMPL, {"prompt": 5}, _AUTH, 400, "invalid_request_error", "prompt", None),
    ("max_tokens of wrong type", _CMPL, {"prompt": "hi", "max_tokens": "ten"}, _AUTH, 400,
     "invalid_request_error", "max_tokens", None),
    ("negative max_tokens", _CMPL, {"prompt": "hi", "max_tokens": -1}, _AUTH, 400,
     "invalid_request_error", "max_tokens", None),
    ("temperature 5", _CMPL, {"prompt": "hi", "temperature": 5}, _AUTH, 400, "invalid_request_error",
     "temperature", None),
    ("top_p 0", _CMPL, {"prompt": "hi", "top_p": 0}, _AUTH, 400, "invalid_request_error", "top_p", None),
    ("empty stop string", _CMPL, {"prompt": "hi", "stop": [""]}, _AUTH, 400, "invalid_request_error",
     "stop", None),
    ("huge prompt", _CMPL, {"prompt": "hello " * 3000}, _AUTH, 400, "invalid_request_error", "prompt",
     "context_length_exceeded"),
    ("prompt + max_tokens too long", _CMPL, {"prompt": [7] * 100, "max_tokens": 1000}, _AUTH, 400,
     "invalid_request_error", "prompt", "context_length_exceeded"),
    ("token id outside the vocabulary", _CMPL, {"prompt": [10 ** 7]}, _AUTH, 400,
     "invalid_request_error", "prompt", None),
    ("two prompts", _CMPL, {"prompt": ["a", "b"]}, _AUTH, 400, "invalid_request_error", "prompt", None),
    ("unknown model", _CMPL, {"prompt": "hi", "model": "gpt-nope"}, _AUTH, 404, "invalid_request_error",
     "model", "model_not_found"),
    ("missing key", _CMPL, {"prompt": "hi"}, {}, 401, "invalid_request_error", None, "invalid_api_key"),
    ("wrong key", _CMPL, {"prompt": "hi"}, {"Authorization": "Bearer nope"}, 401,
     "invalid_request_error", None, "invalid_api_key"),
    ("missing key on models", "/v1/models", None, {}, 401, "invalid_request_error", None,
     "invalid_api_key"),
    ("oversized body", _CMPL, {"prompt": "a" * (MAX_BODY + 10)}, _AUTH, 413, "invalid_request_error",
     None, "request_too_large"),
    ("n over 128", _CMPL, {"prompt": "hi", "n": 129}, _AUTH, 400, "invalid_request_error", "n", None),
    ("best_of below n", _CMPL, {"prompt": "hi", "n": 3, "best_of": 2}, _AUTH, 400, "invalid_request_error",
     "best_of", None),
    ("best_of with stream", _CMPL, {"prompt": "hi", "best_of": 2, "stream": True}, _AUTH, 400,
     "invalid_request_error", "best_of", None),
    ("echo", _CMPL, {"prompt": "hi", "echo": True}, _AUTH, 400, "invalid_request_error", "echo",
     "unsupported_parameter"),
    ("logit_bias out of range", _CMPL, {"prompt": "hi", "logit_bias": {"5": 101}}, _AUTH, 400,
     "invalid_request_error", "logit_bias", None),
    ("tool without a function", _CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                         "tools": [{"type": "function"}]},
     _AUTH, 400, "invalid_request_error", "tools", None),
    ("unknown response_format", _CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                        "response_format": {"type": "xml"}}, _AUTH, 400,
     "invalid_request_error", "response_format", None),
    ("empty messages", _CHAT, {"messages": []}, _AUTH, 400, "invalid_request_error", "messages", None),
    ("unknown route", "/v1/nothing", {}, _AUTH, 404, "not_found_error", None, None),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(tiny_server, case):
    _, path, body, headers, status, kind, param, code = case
    client = tiny_server.client
    if body is None:
        resp = client.get(path, headers=headers)
    elif isinstance(body, bytes):
        resp = client.post(path, content=body, headers=headers | {"Content-Type": "application/json"})
    else:
        resp = client.post(path, json=body, headers=headers)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (kind, param, code), error
    assert error["message"]


def test_context_length_message_names_the_lengths(tiny_server):
    resp = tiny_server.client.post("/v1/completions", json={"prompt": [7] * 1500}, headers=_AUTH)
    message = resp.json()["error"]["message"]
    assert resp.status_code == 400 and "1500" in message and "1024" in message


def test_harmless_unknown_fields_are_ignored(tiny_server):
    body = {"prompt": [5, 6], "max_tokens": 3, "user": "u1", "metadata": {"x": 1}, "store": False,
            "ignore_eos": True, "temperature": 0}
    resp = tiny_server.client.post("/v1/completions", json=body, headers=_AUTH)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                    "prompt_tokens_details": {"cached_tokens": 0}}


# -- full queue and graceful shutdown ------------------------------------------------------------------


async def _drain_stream(resp: httpx.Response) -> str | None:
    """The stream's finish_reason, or "error:CODE" for an error event."""
    finish = None
    try:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    finish = f"error:{event['error']['code']}"
                else:
                    finish = event["choices"][0]["finish_reason"] or finish
    except httpx.HTTPError:
        return "connection closed"
    return finish


async def _sigterm_scenario(server: LiveServer, grace: float) -> dict:
    body = {"prompt": [11, 12, 13], "max_tokens": 1000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        streams = [await client.send(client.build_request("POST", "/v1/completions", json=body),
                                     stream=True) for _ in range(3)]  # 2 run, 1 waits
        assert [s.status_code for s in streams] == [200] * 3
        readers = [asyncio.create_task(_drain_stream(s)) for s in streams]
        while server.metrics()["deepinfer_num_requests_waiting"] < 1:
            await asyncio.sleep(0.05)
        full = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        os.kill(server.proc.pid, signal.SIGTERM)
        start = time.monotonic()
        await asyncio.sleep(0.2)
        late = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        while server.proc.poll() is None and time.monotonic() - start < EXIT_BOUND_S:  # must not hang
            await asyncio.sleep(0.05)
        return {"full": full, "late": late, "finishes": await asyncio.gather(*readers)}


@pytest.mark.live_server
def test_full_queue_then_sigterm_exits_zero_within_grace(tiny_checkpoint):
    grace = 3.0
    with LiveServer("--model", tiny_checkpoint("llama"), "--max-num-seqs", "2", "--max-waiting", "1",
                    "--shutdown-grace", str(grace), "--log-level", "info") as server:
        result = asyncio.run(_sigterm_scenario(server, grace))
        assert server.proc.returncode == 0, server.log_tail()  # it exited by itself (None: still running)
        log = server.log_tail(100_000)
    assert result["full"].status_code == 429 and "retry-after" in result["full"].headers
    assert result["full"].json()["error"]["code"] == "queue_full"
    assert result["late"].status_code == 503 and "retry-after" in result["late"].headers
    # it keeps its budget of the grace (requests finish, then are aborted, then teardown): shown by what it
    # did, read from its log, not timed (a busy machine stretches the teardown)
    assert re.search(rf"shutting down: [1-9]\d* requests open, {grace:.1f} s grace", log), log[-3000:]
    assert re.search(r"aborting [1-9]\d* requests", log), log[-3000:]  # at the end of its budget, not waited on
    # 1000 tokens take longer than the grace period: aborted, reported as an error event (no "abort")
    assert result["finishes"] == ["error:request_aborted"] * 3


@pytest.mark.slow
def test_queued_streaming_client_that_leaves_is_aborted_before_it_runs(tiny_checkpoint):
    """One seat: a long stream holds it; a second stream waits, its client leaves before any
    chunk, and the request is aborted while still queued (the first one keeps running)."""
    aborted = 'deepinfer_requests_total{finish_reason="abort",status="aborted"}'
    with AppServer("--model", tiny_checkpoint("llama"), "--max-num-seqs", "1", "--max-model-len", "8192",
                   "--allow-long-max-model-len") as server:
        server.listen()  # the client leaves by closing a real connection
        long_body = {"prompt": [5, 6, 7], "max_tokens": 8000, "ignore_eos": True, "stream": True}

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                holder = asyncio.create_task(_drain(client, long_body))
                await asyncio.sleep(0.5)
                with pytest.raises(httpx.ReadTimeout):  # queued: no chunk comes, and the client leaves
                    async with client.stream("POST", "/v1/completions", json={**long_body, "max_tokens": 5},
                                             timeout=httpx.Timeout(60, read=1.0)) as resp:
                        async for _ in resp.aiter_lines():
                            pass
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    m = server.metrics()
                    if m.get(aborted, 0) == 1:
                        break
                    await asyncio.sleep(0.1)
                assert m.get(aborted, 0) == 1 and m["deepinfer_num_requests_waiting"] == 0
                assert m["deepinfer_num_requests_running"] == 1 and not holder.done()
                holder.cancel()

        asyncio.run(run())


async def _drain(client, body) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for _ in resp.aiter_lines():
            pass
