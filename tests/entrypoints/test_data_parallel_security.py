"""Who may join a data-parallel front end and what it passes on, against an in-process front end and
stand-in replicas (small apps with no engine that record every request they get), each served by
uvicorn in a thread: registration needs the cluster secret (never an API key), hostile addresses and
bodies are 4xx while the health task goes on, bodies are read off the event loop, only the replica
server's routes and the headers it needs are forwarded, garbage metrics are skipped, and each API
key has its own share at the front end, which a forged `x-deepinfer-client` or a made-up key does
not change (the replica's side: test_data_parallel_clients.py)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer.entrypoints.data_parallel.frontend import Frontend, build_frontend
from deepinfer.entrypoints.data_parallel.identity import CLIENT_HEADER, SECRET_HEADER
from deepinfer.entrypoints.data_parallel.replicas import ReplicaSet
from deepinfer.entrypoints.data_parallel.router import PrefixRouter
from deepinfer.serving.tenancy import key_id
from tests.entrypoints.live_server import parse_metrics

SECRET = "cluster-secret-of-these-tests"
CHILD_SECRET = "child-secret-of-these-tests"
NOT_FORWARDED_HEADERS = {"cookie": "session=1", "x-forwarded-for": "10.9.9.9", "proxy-authorization": "Basic eA==",
                         CLIENT_HEADER: "key:forged", SECRET_HEADER: "forged-secret-forged"}


# ---- stand-ins ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """An ASGI app served by uvicorn on a free 127.0.0.1 port, in a thread of this process."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class FakeReplica:
    """A replica without an engine: records each request (method, path, header pairs) other than the
    health checks, and answers as `?mode=` says: echo (the default: the headers it got), hang (until
    its client leaves, which it notes in `disconnected`), hold (until `release`), cut (a stream of the
    path's API that dies after two events), stall (a stream that sends one event, then nothing)."""

    def __init__(self):
        self.seen: list[tuple[str, str, list[tuple[str, str]]]] = []
        self.healthy = True
        self.metrics_text = b"# TYPE fake_total counter\nfake_total 1.0\n"
        self.disconnected = threading.Event()
        self.release = threading.Event()
        self.waiting = 0  # requests in "hang" or "hold"
        self.app = FastAPI()
        self.app.add_api_route("/health", self._health, methods=["GET"])
        self.app.add_api_route("/metrics", self._metrics, methods=["GET"])
        self.app.add_api_route("/{path:path}", self._any, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])

    async def _health(self) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def _metrics(self) -> Response:
        return Response(self.metrics_text, media_type="text/plain")

    async def _any(self, request: Request, path: str) -> Response:
        self.seen.append((request.method, "/" + path, list(request.headers.items())))
        mode = request.query_params.get("mode", "echo")
        if mode in ("hang", "hold"):
            return await self._wait(request, mode)
        if mode in ("cut", "stall"):
            return StreamingResponse(_stream("/" + path, mode, request), media_type=_media("/" + path))
        return JSONResponse({"headers": list(request.headers.items())},
                            headers={"set-cookie": "replica=1", "x-internal-secret": "s", "x-request-id": "r1"})

    async def _wait(self, request: Request, mode: str) -> Response:
        self.waiting += 1
        try:
            for _ in range(1200):
                if await request.is_disconnected():
                    self.disconnected.set()
                    return Response(status_code=499)
                if mode == "hold" and self.release.is_set():
                    return JSONResponse({"released": True})
                await asyncio.sleep(0.05)
            return JSONResponse({"gave_up": True})
        finally:
            self.waiting -= 1


def _media(path: str) -> str:
    return "application/x-ndjson" if path.startswith("/api/") else "text/event-stream"


_EVENTS = {  # two events of each API's stream, as its replica would send them
    "/v1/completions": [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n'],
    "/v1/messages": [b'event: message_start\ndata: {"type": "message_start"}\n\n',
                     b'event: content_block_delta\ndata: {"type": "content_block_delta"}\n\n'],
    "/v1/responses": [b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n',
                      b'event: response.output_text.delta\ndata: {"type": "x", "sequence_number": 1}\n\n'],
    "/api/generate": [b'{"response": "a", "done": false}\n', b'{"response": "b", "done": false}\n'],
}


async def _stream(path: str, mode: str, request: Request):
    events = _EVENTS.get(path, _EVENTS["/v1/completions"])
    yield events[0]
    if mode == "stall":
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)
        return
    yield events[1][:-1]  # the last event cut mid-way, as a dying replica cuts it
    raise RuntimeError("the stand-in replica dies mid-stream")


def make_frontend(size: int = 1, *, api_key: str | None = None, cluster_secret: str | None = SECRET,
                  read_timeout: float = 600.0, limit: int | None = None):
    frontend = Frontend(ReplicaSet(size), PrefixRouter("least-load"), None, 16, child_secret=CHILD_SECRET,
                        cluster_secret=cluster_secret, api_key=api_key, read_timeout=read_timeout)
    return frontend, build_frontend(frontend, max_requests_per_client=limit)


def register(front_url: str, rank: int, url: str, secret: str | None = SECRET, **kw) -> httpx.Response:
    headers = {SECRET_HEADER: secret} if secret is not None else {}
    return httpx.post(f"{front_url}/dp/register", json={"rank": rank, "url": url}, headers=headers, timeout=10, **kw)


@pytest.fixture
def cluster():
    """A front end (cluster secret SECRET, API keys k1 and k2, 1 request per client) with one stand-in
    replica registered as rank 0: (front end's Served, Frontend, FakeReplica, replica's Served)."""
    fake = FakeReplica()
    frontend, app = make_frontend(api_key="k1,k2", limit=1)
    with Served(fake.app) as replica, Served(app) as front:
        assert register(front.url, 0, replica.url).status_code == 200
        yield front, frontend, fake, replica
        fake.release.set()


def rounds(front) -> float:
    return parse_metrics(httpx.get(f"{front.url}/metrics", timeout=10).text)["deepinfer_dp_health_check_rounds_total"]


# ---- registration -----------------------------------------------------------------------------------


def test_a_client_api_key_never_registers_a_replica_and_the_cluster_secret_does():
    frontend, app = make_frontend(2, api_key="client-key")
    with Served(app) as front:
        as_client = httpx.post(f"{front.url}/dp/register", json={"rank": 1, "url": "http://127.0.0.1:9"},
                               headers={"Authorization": "Bearer client-key"})
        assert as_client.status_code == 403 and "an API key is not a secret" in as_client.text
        assert register(front.url, 1, "http://127.0.0.1:9", secret="client-key").status_code == 403
        assert register(front.url, 1, "http://127.0.0.1:9", secret=None).status_code == 403  # nor from loopback
        assert frontend.replicas.replicas[1].url == ""
        assert register(front.url, 1, "http://127.0.0.1:9").status_code == 200
        table = httpx.get(f"{front.url}/dp/replicas", headers={"Authorization": "Bearer client-key"}).json()
        assert table["replicas"][1]["url"] == "http://127.0.0.1:9"


def test_a_front_end_without_a_secret_accepts_no_replica_it_did_not_start():
    frontend, app = make_frontend(2, cluster_secret=None)
    with Served(app) as front:
        for secret in (None, SECRET, "", CHILD_SECRET + "x"):
            refused = register(front.url, 1, "http://127.0.0.1:9", secret=secret)
            assert refused.status_code == 403, secret
            assert "has no --data-parallel-secret, so it accepts no replica" in refused.json()["error"]["message"]
        assert all(r.url == "" for r in frontend.replicas.replicas.values())


HOSTILE_URLS = ["http://127.0.0.1:9\r\nX-Injected: 1", "http://u:p@127.0.0.1:9", "file:///etc/passwd",
                "http://127.0.0.1", "http://127.0.0.1:9/internal", "http://127.0.0.1 :9", "http://127.0.0.1:9\u202e",
                "http://127.0.0.1:9\x00", "http://" + "a" * 600 + ":9", "http://127.0.0.1:9?x=1", "gopher://h:9",
                "http://127.0.0.1:99999", "http://[nothing]:9", "http://h\u0130st:9", " http://127.0.0.1:9"]
HOSTILE_BODIES = [b'{"rank": Infinity, "url": "http://127.0.0.1:9"}', b'{"rank": -Infinity, "url": "http://h:9"}',
                  b'{"rank": 1e400, "url": "http://h:9"}', b'{"rank": NaN, "url": "http://h:9"}',
                  b"[" * 100_000 + b"]" * 100_000, b'{"rank": [0], "url": "http://h:9"}',
                  b'{"rank": {"a": 1}, "url": "http://h:9"}', b'{"rank": true, "url": "http://h:9"}',
                  b'{"rank": 0.0, "url": "http://h:9"}', b'{"rank": "0", "url": "http://h:9"}',
                  b'{"rank": 0, "url": ["http://h:9"]}', b'{"rank": 0, "url": {"x": 1}}', b'{"rank": 0}',
                  b'{"rank": -1, "url": "http://h:9"}', b'{"rank": 7, "url": "http://h:9"}',
                  b'{"rank": ' + b"9" * 90 + b', "url": "http://h:9"}', b'{"rank": 0, "url": "http://h:9", "x": 1}',
                  b"", b"\xff\xfe", b'"text"', b'{"rank": 0, "url": "http://h:9"' + b" " * 5000 + b"}"]


def test_hostile_addresses_and_bodies_are_4xx_and_the_health_task_goes_on(caplog):
    fake = FakeReplica()
    frontend, app = make_frontend(2)
    caplog.set_level(logging.INFO, logger="deepinfer.server")
    with Served(fake.app) as replica, Served(app) as front:
        assert register(front.url, 0, replica.url).status_code == 200
        before = rounds(front)
        for url in HOSTILE_URLS:
            refused = register(front.url, 1, url)
            message = refused.json()["error"]["message"]
            assert refused.status_code == 400 and message.startswith("url") and refused.json()["error"]["param"] == \
                "url", (url, refused.text)
            assert url[:100] not in message or url.isascii() and url.isprintable(), message  # escaped
        for body in HOSTILE_BODIES:
            refused = httpx.post(f"{front.url}/dp/register", content=body, headers={SECRET_HEADER: SECRET})
            assert refused.status_code in (400, 413), (body[:60], refused.status_code, refused.text)
        assert frontend.replicas.replicas[1].url == ""
        deadline = time.monotonic() + 30
        while rounds(front) < before + 3:  # the health task still runs its rounds
            assert time.monotonic() < deadline, "the health task stopped"
            time.sleep(0.2)
        assert frontend.metrics.registry.get_sample_value("deepinfer_dp_health_task_restarts_total") == 0
        assert httpx.get(f"{front.url}/v1/models").headers["x-deepinfer-replica"] == "0"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "\r\nX-Injected" not in logged and "\u202e" not in logged and "\x00" not in logged


def test_bodies_are_read_off_the_event_loop(monkeypatch):
    from deepinfer.entrypoints.data_parallel import registration

    fake = FakeReplica()
    frontend = Frontend(ReplicaSet(2), PrefixRouter("prefix"), None, 16, cluster_secret=SECRET)
    threads: list[threading.Thread] = []
    parse, hashes = registration.parse_registration, frontend._hashes
    monkeypatch.setattr(registration, "parse_registration",
                        lambda *a: threads.append(threading.current_thread()) or parse(*a))
    monkeypatch.setattr(frontend, "_hashes", lambda *a: threads.append(threading.current_thread()) or hashes(*a))
    with Served(fake.app) as replica, Served(build_frontend(frontend)) as front:
        assert register(front.url, 0, replica.url).status_code == 200
        assert httpx.post(f"{front.url}/v1/completions", json={"prompt": [1, 2, 3]}).status_code == 200
        assert len(threads) == 2 and front.thread not in threads  # neither ran on the front end's event loop


# ---- what is forwarded ----------------------------------------------------------------------------------


def test_a_path_outside_the_replica_servers_routes_never_reaches_a_replica(cluster):
    front, _, fake, _ = cluster
    for method, path in [("GET", "/internal/secret"), ("POST", "/v1/load_lora_adapter"), ("GET", "/openapi.json"),
                         ("GET", "/v1/models/%2e%2e/%2e%2e/internal/secret"), ("GET", "/docs"),
                         ("DELETE", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("GET", "/static/../x")]:
        answer = httpx.request(method, f"{front.url}{path}", headers={"Authorization": "Bearer k1"})
        assert answer.status_code in (404, 405), (method, path, answer.status_code)
        assert "x-deepinfer-replica" not in answer.headers and "error" in answer.json()
    assert fake.seen == []
    answer = httpx.get(f"{front.url}/v1/models", headers={"Authorization": "Bearer k1"})
    assert answer.status_code == 200 and answer.headers["x-deepinfer-replica"] == "0"
    assert [(m, p) for m, p, _ in fake.seen] == [("GET", "/v1/models")]


def test_only_the_headers_a_replica_needs_go_there_and_back(cluster):
    front, _, fake, _ = cluster
    sent = {"Authorization": "Bearer k1", "x-api-key": "k1", "anthropic-version": "2023-06-01",
            "content-type": "application/json", **NOT_FORWARDED_HEADERS}
    answer = httpx.post(f"{front.url}/v1/completions", json={"prompt": "hi"}, headers=sent)
    assert answer.status_code == 200
    got = dict(fake.seen[-1][2])
    assert got["authorization"] == "Bearer k1" and got["x-api-key"] == "k1" and got["anthropic-version"] == "2023-06-01"
    assert got[CLIENT_HEADER] == key_id("k1") and got[SECRET_HEADER] == SECRET  # the front end's, not the client's
    assert [v for k, v in fake.seen[-1][2] if k == CLIENT_HEADER] == [key_id("k1")]
    assert not {"cookie", "x-forwarded-for", "proxy-authorization"} & set(got)
    assert "set-cookie" not in answer.headers and "x-internal-secret" not in answer.headers
    assert answer.headers["x-request-id"] == "r1" and answer.headers["x-deepinfer-replica"] == "0"
    anonymous = httpx.post(f"{front.url}/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer no"})
    assert dict(fake.seen[-1][2])[CLIENT_HEADER] == "addr:127.0.0.1"  # a key it does not accept names nobody
    assert anonymous.status_code == 200  # (the replica checks keys; this stand-in does not)


def test_the_route_list_matches_the_replica_servers_route_table(tiny_checkpoint, tmp_path):
    from fastapi.routing import iter_route_contexts
    from starlette.routing import Mount

    from deepinfer import LLM
    from deepinfer.entrypoints.data_parallel.proxy import ALLOWED_ROUTES, NOT_FORWARDED
    from deepinfer.entrypoints.openai.server import ServerSettings, build_app

    llm = LLM(tiny_checkpoint("llama"), enable_lora=True)
    app = build_app(llm.engine, ServerSettings(model_name="m", allow_runtime_lora_updating=True,
                                               lora_dirs=(str(tmp_path),)))  # its lifespan never starts
    served = set()
    for route in iter_route_contexts(app.routes):  # the routes of the included routers as well
        if isinstance(route.original_route, Mount):
            served.add(("GET", route.path + "/{file_path:path}"))
        else:
            served |= {(m, route.path) for m in route.methods - {"HEAD"}}
    forwarded = {(m, path) for path, methods in ALLOWED_ROUTES for m in methods}
    assert forwarded <= served, forwarded - served  # no route the server does not have
    left = {path for _, path in served - forwarded}
    assert left == set(NOT_FORWARDED), left  # every other route is left out on purpose, with its reason
    assert ("POST", "/v1/load_lora_adapter") in served
    llm.close()


# ---- metrics ------------------------------------------------------------------------------------------------


GARBAGE_METRICS = {
    "unreadable": b"this is { not prometheus\n\x00\x01",
    "too_many_samples": b"".join(b"m{i=\"%d\"} 1\n" % i for i in range(60_000)),
    "too_large": b"# " + b"x" * (5 << 20) + b"\n",
}


@pytest.mark.parametrize("reason", list(GARBAGE_METRICS))
def test_a_replica_sending_garbage_metrics_is_skipped_and_counted(reason):
    good, bad = FakeReplica(), FakeReplica()
    good.metrics_text = (b'# TYPE fake_total counter\nfake_total{replica="9"} 1.0\n'
                         b"# TYPE deepinfer_dp_replica_up gauge\ndeepinfer_dp_replica_up{replica=\"0\"} 7\n")
    bad.metrics_text = GARBAGE_METRICS[reason]
    _, app = make_frontend(2)
    with Served(good.app) as r0, Served(bad.app) as r1, Served(app) as front:
        assert register(front.url, 0, r0.url).status_code == 200 and register(front.url, 1, r1.url).status_code == 200
        for _ in range(2):
            answer = httpx.get(f"{front.url}/metrics", timeout=30)
            assert answer.status_code == 200
        values = parse_metrics(answer.text)
    assert values['fake_total{replica="0"}'] == 1.0  # the replica's own `replica` label is overwritten
    assert values['deepinfer_dp_replica_up{replica="0"}'] == 1.0  # the front end's own name stays its own
    assert values[f'deepinfer_dp_replica_metrics_rejected_total{{reason="{reason}",replica="1"}}'] == 2.0
    assert not any('replica="1"' in k for k in values if not k.startswith("deepinfer_dp_"))


# ---- each client's share --------------------------------------------------------------------------------------


def _held(front_url: str, key: str, results: list, extra: dict | None = None) -> threading.Thread:
    def run() -> None:
        headers = {"Authorization": f"Bearer {key}", **(extra or {})}
        answer = httpx.post(f"{front_url}/v1/completions?mode=hold", json={"prompt": "x"}, headers=headers, timeout=60)
        results.append(answer.status_code)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_for(condition, what: str, bound_s: float = 30.0) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_each_api_key_has_its_own_share_at_the_front_end_and_a_forged_client_header_gains_nothing(cluster):
    front, _, fake, _ = cluster
    results: list[int] = []
    first = _held(front.url, "k1", results)
    _wait_for(lambda: fake.waiting == 1, "k1's request reached the replica")
    over = httpx.post(f"{front.url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k1"})
    assert over.status_code == 429 and "x-deepinfer-replica" not in over.headers  # the front end's own refusal
    forged = httpx.post(f"{front.url}/v1/completions", json={"prompt": "x"},
                        headers={"Authorization": "Bearer k1", CLIENT_HEADER: key_id("k2"), SECRET_HEADER: SECRET})
    assert forged.status_code == 429
    second = _held(front.url, "k2", results)  # another key: a share of its own
    _wait_for(lambda: fake.waiting == 2, "k2's request reached the replica")
    third = _held(front.url, "made-up", results)  # a key the front end does not accept: its peer address
    _wait_for(lambda: fake.waiting == 3, "the keyless request reached the replica")
    again = httpx.post(f"{front.url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer other"})
    assert again.status_code == 429  # a second made-up key is the same client (its address), not a new one
    fake.release.set()
    for t in (first, second, third):
        t.join(60)
    assert sorted(results) == [200, 200, 200]
