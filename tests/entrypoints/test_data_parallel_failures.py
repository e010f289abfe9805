"""How a data-parallel front end fails a request whose replica fails, against an in-process front end
and stand-in replicas (test_data_parallel_security.py): a silent replica costs at most the read
timeout (504), one that goes down fails its waiting requests and streams at once (502, an error
event), a client that leaves closes its request on the replica, a cut stream ends with an error
event in its API's own format, and the health task outlives its own failures."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading

import httpx
import pytest

from deepinfer.entrypoints.data_parallel import frontend as frontend_module
from deepinfer.entrypoints.data_parallel.replicas import ReplicaSet
from deepinfer.entrypoints.data_parallel.router import PrefixRouter
from deepinfer.entrypoints.data_parallel.stream_errors import StreamTail, stream_format
from tests.entrypoints.test_data_parallel_security import FakeReplica, Served, _wait_for, make_frontend, register

MUST_NOT_HANG_S = 60.0  # a bound for "it ended", far above what any of these takes


def test_a_silent_replica_costs_a_request_the_read_timeout_not_more():
    fake = FakeReplica()  # its /health answers: only the read timeout can end the request
    frontend, app = make_frontend(read_timeout=1.0)
    with Served(fake.app) as replica, Served(app) as front:
        assert register(front.url, 0, replica.url).status_code == 200
        answer = httpx.post(f"{front.url}/v1/completions?mode=hang", json={}, timeout=MUST_NOT_HANG_S)
        assert answer.status_code == 504 and answer.headers["x-deepinfer-replica"] == "0", answer.text
        assert "--data-parallel-read-timeout" in answer.json()["error"]["message"]
        assert fake.disconnected.wait(MUST_NOT_HANG_S)  # and the replica saw its client (the front end) leave
        assert frontend.replicas.replicas[0].up and frontend.replicas.replicas[0].in_flight == 0


def test_a_replica_that_goes_down_fails_its_waiting_requests_at_once():
    fake = FakeReplica()
    frontend, app = make_frontend()  # the read timeout (600 s) plays no part
    with Served(fake.app) as replica, Served(app) as front:
        assert register(front.url, 0, replica.url).status_code == 200
        results: list = []
        waiting = threading.Thread(target=lambda: results.append(
            httpx.post(f"{front.url}/v1/completions?mode=hang", json={}, timeout=MUST_NOT_HANG_S)))
        streaming = threading.Thread(target=lambda: results.append(
            httpx.post(f"{front.url}/v1/completions?mode=stall", json={}, timeout=MUST_NOT_HANG_S)))
        waiting.start()
        streaming.start()
        _wait_for(lambda: frontend.replicas.replicas[0].in_flight == 2, "both requests reached the replica")
        fake.healthy = False  # two missed health checks: down
        waiting.join(MUST_NOT_HANG_S)
        streaming.join(MUST_NOT_HANG_S)
    by_status = {r.status_code: r for r in results}
    assert sorted(by_status) == [200, 502], results
    assert by_status[502].headers["x-deepinfer-replica"] == "0" and "went down" in by_status[502].text
    events = [line for line in by_status[200].text.splitlines() if line.startswith("data: ")]
    assert events[0].startswith('data: {"choices"') and "went down" in events[-2] and events[-1] == "data: [DONE]"


def test_a_client_that_leaves_a_whole_answer_closes_it_on_the_replica():
    fake = FakeReplica()
    frontend, app = make_frontend()
    with Served(fake.app) as replica, Served(app) as front:
        assert register(front.url, 0, replica.url).status_code == 200
        client = socket.create_connection(("127.0.0.1", front.port))
        client.sendall(b"POST /v1/completions?mode=hang HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: 2\r\n\r\n{}")
        _wait_for(lambda: fake.waiting == 1, "the request reached the replica")
        client.close()  # the client leaves before its answer started
        assert fake.disconnected.wait(MUST_NOT_HANG_S)  # the front end closed its request to the replica
        _wait_for(lambda: frontend.replicas.replicas[0].in_flight == 0, "the front end let the request go")
        assert frontend.replicas.replicas[0].up  # a client leaving says nothing about the replica


CUT = [("/v1/completions", "openai"), ("/v1/messages", "anthropic"), ("/v1/responses", "responses"),
       ("/api/generate", "ndjson")]


@pytest.mark.parametrize(("path", "kind"), CUT)
def test_a_stream_cut_by_its_replica_ends_with_an_error_event_of_its_api(path, kind):
    fake = FakeReplica()
    frontend, app = make_frontend()
    with Served(fake.app) as replica, Served(app) as front:
        assert register(front.url, 0, replica.url).status_code == 200
        answer = httpx.post(f"{front.url}{path}?mode=cut", json={}, timeout=MUST_NOT_HANG_S)
        assert answer.status_code == 200 and answer.headers["x-deepinfer-replica"] == "0"
        assert not frontend.replicas.replicas[0].up  # its connection failed: down until its /health answers
        _wait_for(lambda: frontend.replicas.replicas[0].up, "the replica is up again after a health check")
    text = answer.text
    if kind == "ndjson":
        last = json.loads(text.splitlines()[-1])
        assert list(last) == ["error"] and "failed during this answer" in last["error"]
        assert json.loads(text.splitlines()[0]) == {"response": "a", "done": False}
        return
    events = [e for e in text.split("\n\n") if e.strip()]
    if kind == "openai":
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "replica_failed"
        return
    name, data = events[-1].split("\n")
    assert name == "event: error"
    error = json.loads(data.removeprefix("data: "))
    assert error["type"] == "error"
    if kind == "anthropic":
        assert error["error"]["type"] == "api_error" and "failed during this answer" in error["error"]["message"]
    else:
        assert error["code"] == "replica_failed" and error["sequence_number"] == 2  # after the two it relayed


def test_the_stream_format_follows_the_content_type_and_the_path():
    assert stream_format("/v1/chat/completions", "text/event-stream; charset=utf-8") == "openai"
    assert stream_format("/v1/messages", "text/event-stream") == "anthropic"
    assert stream_format("/api/chat", "application/x-ndjson") == "ndjson"
    assert stream_format("/v1/completions", "application/json") is None
    tail = StreamTail("/v1/completions", "text/event-stream")
    tail.seen(b'data: {"choices": []}\n\ndata: {"cho')  # cut inside an event
    assert tail.error_event("gone").startswith(b"\n\ndata: {") and tail.error_event("x").endswith(b"data: [DONE]\n\n")
    whole = StreamTail("/v1/completions", "application/json")
    whole.seen(b'{"id": ')
    assert whole.error_event("gone") is None  # a whole answer cut short: the connection is cut


def test_the_health_task_survives_its_own_failure_and_goes_on(monkeypatch, caplog):
    monkeypatch.setattr(frontend_module, "HEALTH_INTERVAL_S", 0.01)
    frontend = frontend_module.Frontend(ReplicaSet(1), PrefixRouter(), None, 16)
    frontend.stop = lambda: None
    calls = []

    def restart_exited(now: float) -> list[int]:
        calls.append(now)
        if len(calls) == 2:
            raise RuntimeError("a bug in a health round")
        return []

    monkeypatch.setattr(frontend.replicas, "restart_exited", restart_exited)

    async def main() -> None:
        task = asyncio.create_task(frontend.check_health())
        while len(calls) < 6:
            assert not task.done(), task
            await asyncio.sleep(0.01)
        task.cancel()
        await frontend.close()

    caplog.set_level(logging.ERROR, logger="deepinfer.server")
    asyncio.run(main())
    value = frontend.metrics.registry.get_sample_value
    assert value("deepinfer_dp_health_task_restarts_total") == 1
    assert value("deepinfer_dp_health_check_rounds_total") >= 4  # it went on after the failure
    failures = [r for r in caplog.records if "health check failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info[0] is RuntimeError  # logged with its traceback
