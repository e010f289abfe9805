"""Tenants kept apart, over HTTP against an in-process server started with two client keys and an
operator key (`--api-key KEY_A --api-key KEY_B --admin-api-key ADMIN`):

- a stored response (`POST /v1/responses`) is read by its owner and the operator only: for another
  client `GET /v1/responses/{id}`, `.../input_items` and `DELETE` are the 404 (`response_not_found`)
  of an id that does not exist, and `previous_response_id` the 400 (`previous_response_not_found`)
  of one; nothing of the response (a secret in its input) reaches that client;
- `GET /dashboard/state` shows a client its own requests only (the operator all of them);
- under `--scheduling-policy priority` a client may not put itself before others: a negative
  `priority` is a 400 naming the field and its range (`--priority-range LO:HI` widens it), the
  operator may send any;
- a wrong or missing key is a 401 on every route behind the keys (the new ones included), and
  every key, the operator's too, works on every client route.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid

import app_server
import httpx
import pytest
from hostile_routes import ROUTE, error_of
from server_probe import HANG_S, check_whole

KEY_A, KEY_B, ADMIN = "key-a-0123456789", "key-b-9876543210", "admin-key-5555"
SECRET = "hunter2"
POLL_S = 60.0  # a "must not hang" bound of a dashboard poll
STEP_DELAY_S = 0.25  # 480 tokens: two minutes, far more than the polls take
CMPL, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
SHORT = {"prompt": "hi", "max_tokens": 2}
PUBLIC = {"/", "/health", "/metrics", "/dashboard", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
CLIENT_ROUTES = [("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"), ("POST", CMPL), ("POST", CHAT),
                 ("POST", RESPONSES), ("GET", "/v1/responses/{response_id}"),
                 ("DELETE", "/v1/responses/{response_id}"), ("GET", "/v1/responses/{response_id}/input_items"),
                 ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/embeddings"),
                 ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/rerank"), ("POST", "/rerank"),
                 ("POST", "/v2/rerank"), ("POST", "/v1/score"), ("POST", "/score"), ("POST", "/infill"),
                 ("GET", "/api/version"), ("GET", "/api/tags"), ("POST", "/api/show"), ("POST", "/api/chat"),
                 ("POST", "/api/generate"), ("POST", "/api/embed"), ("POST", "/api/embeddings"),
                 ("GET", "/dashboard/state")]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _serve(model: str, *flags: str):
    """AppServer with both client keys and the operator key."""
    with app_server.AppServer("--model", model, "--served-model-name", "tiny", "--max-model-len", "512",
                              "--api-key", KEY_A, "--api-key", KEY_B, "--admin-api-key", ADMIN,
                              "--scheduling-policy", "priority", *flags) as server:
        yield server


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    yield from _serve(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def ranged_server(tiny_checkpoint):
    yield from _serve(tiny_checkpoint("llama"), "--priority-range=-5:5")


@pytest.fixture(autouse=True)
def whole_afterwards(request):
    """After each test its server runs nothing, answers a normal request and has every KV block free."""
    yield
    for name in ("server", "ranged_server"):
        if name in request.fixturenames:
            check_whole(request.getfixturevalue(name), bearer(ADMIN))


def _post(server, path: str, body: dict, key: str) -> httpx.Response:
    return server.client.post(path, json=body, headers=bearer(key), timeout=HANG_S)


def _create_response(server, key: str) -> str:
    resp = _post(server, RESPONSES, {"input": f"My password is {SECRET}", "max_output_tokens": 2}, key)
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def _reads(server, response_id: str, key: str) -> list[httpx.Response]:
    """GET of the response and of its input items; a continuation of it."""
    get = server.client.get(f"/v1/responses/{response_id}", headers=bearer(key))
    items = server.client.get(f"/v1/responses/{response_id}/input_items", headers=bearer(key))
    follow = _post(server, RESPONSES, {"input": "go on", "max_output_tokens": 2,
                                       "previous_response_id": response_id}, key)
    return [get, items, follow]


def _without(text: str, response_id: str) -> str:
    return text.replace(response_id, "ID")


def _check_list_shape(resp: httpx.Response) -> None:
    assert resp.status_code == 200, resp.text
    page = resp.json()
    assert page["object"] == "list" and isinstance(page["data"], list) and page["data"], page
    assert {"first_id", "last_id", "has_more"} <= set(page), page
    assert SECRET in json.dumps(page["data"]), page  # the input it was given


def test_a_stored_response_is_read_by_its_owner_and_the_operator_only(server):
    response_id = _create_response(server, KEY_A)
    for key in (KEY_A, ADMIN):
        get, items, follow = _reads(server, response_id, key)
        assert get.status_code == 200 and get.json()["id"] == response_id, (key, get.text)
        _check_list_shape(items)
        assert key == ADMIN or follow.status_code == 200, follow.text  # the owner continues it
    unknown = f"resp_{uuid.uuid4().hex}"
    theirs, nobodys = _reads(server, response_id, KEY_B), _reads(server, unknown, KEY_B)
    codes = ["response_not_found", "response_not_found", "previous_response_not_found"]
    for resp, none, code in zip(theirs, nobodys, codes, strict=True):
        assert resp.status_code == (400 if code.startswith("previous") else 404), resp.text
        assert resp.json()["error"]["code"] == code, resp.text
        assert _without(resp.text, response_id) == _without(none.text, unknown), (resp.text, none.text)
        assert SECRET not in resp.text
    assert _reads(server, response_id, KEY_A)[0].status_code == 200  # still there


def test_a_response_is_deleted_by_its_owner_only(server):
    response_id = _create_response(server, KEY_A)
    unknown = f"resp_{uuid.uuid4().hex}"
    refused = server.client.delete(f"/v1/responses/{response_id}", headers=bearer(KEY_B))
    nobodys = server.client.delete(f"/v1/responses/{unknown}", headers=bearer(KEY_B))
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "response_not_found", refused.text
    assert _without(refused.text, response_id) == _without(nobodys.text, unknown)
    assert SECRET not in refused.text
    assert server.client.get(f"/v1/responses/{response_id}", headers=bearer(KEY_A)).status_code == 200
    deleted = server.client.delete(f"/v1/responses/{response_id}", headers=bearer(KEY_A))
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": response_id, "object": "response", "deleted": True}
    for path in (f"/v1/responses/{response_id}", f"/v1/responses/{response_id}/input_items"):
        gone = server.client.get(path, headers=bearer(KEY_A))
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found", gone.text


def _dashboard(server, key: str, request_id: str | None = None, until=lambda view: True) -> dict:
    """/dashboard/state as `key` sees it once the engine built a picture and `until(view)` holds
    (polled, POLL_S at most)."""
    params = {} if request_id is None else {"request_id": request_id}
    deadline = time.monotonic() + POLL_S
    while True:
        resp = server.client.get("/dashboard/state", params=params, headers=bearer(key))
        assert resp.status_code == 200, resp.text
        view = resp.json()
        if not view.get("pending") and until(view):
            return view
        assert time.monotonic() < deadline, view
        time.sleep(0.05)


def _running_ids(view: dict) -> list[str]:
    return [r["request_id"] for r in view["running"]]


def test_the_dashboard_shows_a_client_its_own_requests_only(server, monkeypatch):
    """A's long stream runs (each engine step slowed by STEP_DELAY_S until the polls are done, so that it
    outlasts them however busy the machine) while B, A and the operator look."""
    step, looked = server.llm.engine.step, threading.Event()

    def slow_step():
        if not looked.is_set():
            time.sleep(STEP_DELAY_S)
        return step()

    monkeypatch.setattr(server.llm.engine, "step", slow_step)
    long = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.listen(), timeout=HANG_S) as http, \
            http.stream("POST", CMPL, json=long, headers=bearer(KEY_A)) as stream:
        assert stream.status_code == 200
        # The iterator is kept: a generator expression over a temporary `iter_lines()` closes it when
        # it is collected, which closes the connection, and the server aborts the stream it serves.
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        mine = json.loads(first[6:])["id"]
        owner = _dashboard(server, KEY_A, until=lambda view: mine in _running_ids(view))
        chosen = _dashboard(server, KEY_A, mine, until=lambda view: view["request"] is not None)
        other = _dashboard(server, KEY_B)
        other_chosen = _dashboard(server, KEY_B, mine)
        operator = _dashboard(server, ADMIN, until=lambda view: mine in _running_ids(view))  # still running
        looked.set()
    assert chosen["request"]["request_id"] == mine
    assert [r["num_prompt_tokens"] > 0 for r in owner["running"] if r["request_id"] == mine] == [True], owner
    for view in (other, other_chosen):
        assert view["running"] == [] and view["request"] is None, view
        assert mine not in json.dumps(view)
    assert mine in _running_ids(operator)


def _priority_refusal(resp: httpx.Response, *bounds: str) -> None:
    assert resp.status_code == 400, resp.text
    message, param = error_of(CMPL, resp)
    assert param == "priority" and "priority" in message, message
    for bound in bounds:  # the allowed range
        assert re.search(rf"(?<![\d-]){re.escape(bound)}(?!\d)", message), (bound, message)


def test_a_client_may_not_put_itself_before_others(server):
    for path, body in ((CMPL, SHORT), (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        _priority_refusal(_post(server, path, {**body, "priority": -1}, KEY_A), "0")
    for priority in (0, 3):
        resp = _post(server, CMPL, {**SHORT, "priority": priority}, KEY_B)
        assert resp.status_code == 200, (priority, resp.text)
    for priority in (-1000, -1, 1000):
        resp = _post(server, CMPL, {**SHORT, "priority": priority}, ADMIN)
        assert resp.status_code == 200, (priority, resp.text)


def test_a_priority_range_bounds_what_clients_may_send(ranged_server):
    for priority in (-5, 0, 5):
        resp = _post(ranged_server, CMPL, {**SHORT, "priority": priority}, KEY_A)
        assert resp.status_code == 200, (priority, resp.text)
    for priority in (-6, 6):
        _priority_refusal(_post(ranged_server, CMPL, {**SHORT, "priority": priority}, KEY_A), "-5", "5")
    assert _post(ranged_server, CMPL, {**SHORT, "priority": -6}, ADMIN).status_code == 200


def _routes(server) -> list[tuple[str, str]]:
    """(method, path) of every route behind the keys: the client routes and whatever else the
    app's OpenAPI document lists (path parameters filled in)."""
    routes = list(CLIENT_ROUTES)
    schema = server.client.get("/openapi.json")
    if schema.status_code == 200:
        for path, methods in schema.json()["paths"].items():
            routes += [(method.upper(), path) for method in methods if method.upper() != "HEAD"]
    filled = {(m, re.sub(r"\{[^}]*\}", "tiny" if "models" in p else "resp_0", p)) for m, p in routes}
    return sorted((m, p) for m, p in filled if p not in PUBLIC)


def _send(server, method: str, path: str, headers: dict) -> httpx.Response:
    """The request, with the route's valid body for a POST (hostile_routes; else {})."""
    route = ROUTE.get(path)
    content = json.dumps(route.body if route is not None else {}).encode() if method == "POST" else None
    return server.client.request(method, path, content=content, timeout=HANG_S,
                                 headers={**headers, "Content-Type": "application/json"})


def _has_error_shape(path: str, resp: httpx.Response) -> bool:
    try:
        error_of(path, resp)
    except (AssertionError, ValueError):
        return False
    return True


def test_a_wrong_or_missing_key_is_a_401_everywhere(server):
    problems = []
    for method, path in _routes(server):
        for label, headers in (("no key", {}), ("a wrong key", bearer("wrong-key")),
                               ("the admin key misspelled", bearer(ADMIN + "x"))):
            resp = _send(server, method, path, headers)
            if resp.status_code != 401 or not _has_error_shape(path, resp):
                problems.append(f"{method} {path} with {label}: {resp.status_code} {resp.text[:200]}")
    assert not problems, "\n".join(problems)


def test_every_key_works_on_every_client_route(server):
    problems = []
    for method, path in _routes(server):
        for key in (KEY_A, KEY_B, ADMIN):
            resp = _send(server, method, path, bearer(key))
            if resp.status_code in (401, 403) or resp.status_code >= 500:
                problems.append(f"{method} {path} with {key}: {resp.status_code} {resp.text[:200]}")
    for key in (KEY_A, ADMIN):  # Anthropic's own header
        resp = _send(server, "POST", "/v1/messages", {"x-api-key": key})
        if resp.status_code != 200:
            problems.append(f"POST /v1/messages with x-api-key {key}: {resp.status_code} {resp.text[:200]}")
    assert not problems, "\n".join(problems)
