"""A live data-parallel front end on the default model, with one local replica (rank 0) and one that
joins with the cluster secret (rank 1): prefix-aware routing against random placement on a
shared-prefix workload, the dashboard of one replica, hostile requests, a replica stopped with
SIGSTOP (its request fails within the read timeout), a client that leaves (its request is aborted
on the replica), a killed replica that fails only its own requests, and a local one that is killed
mid-stream (its streams end with an error event of their API) and started again; and torchrun ranks
that become a front end and a replica."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.entrypoints.live_server import LiveServer, parse_metrics

SECRET = "cluster-secret-of-these-tests"
MUST_NOT_HANG_S = 120.0
READ_TIMEOUT_S = 10.0


_TOPICS = ["lighthouses of the northern coast", "the history of paper money", "how bees build their combs",
           "glaciers and the valleys they carve", "the first railways in Europe", "tides and the moon",
           "the chemistry of bread dough", "maps drawn before satellites"]
_ASK = ["Summarise it.", "Give one fact.", "Name a place.", "Ask a question about it."]


def _prefix(topic: str) -> str:
    return (f"You are a patient teacher. The lesson today is about {topic}. " * 6).strip()


def _complete(url: str, prompt: str, max_tokens: int = 1) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _total(values: dict, name: str, *labels: str) -> float:
    """The sum of a metric's samples (over the replicas) whose labels include all of `labels`."""
    return sum(v for k, v in values.items() if k.startswith(name + "{") and all(x in k for x in labels))


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + MUST_NOT_HANG_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _hit_rate(before: dict, after: dict) -> float:
    def total(values, name):
        return sum(v for k, v in values.items() if k.startswith(name + "{"))

    def delta(name: str) -> float:
        counter = f"deepinfer_prefix_cache_{name}_total"
        return total(after, counter) - total(before, counter)

    return delta("hits") / delta("queries")


@pytest.fixture(scope="module")
def cluster():
    with LiveServer("--data-parallel-size", "2", "--data-parallel-size-local", "1", "--threads", "1",
                    "--data-parallel-secret", SECRET, "--data-parallel-read-timeout", str(READ_TIMEOUT_S)) as front:
        with LiveServer("--data-parallel-address", f"127.0.0.1:{front.port}", "--data-parallel-rank", "1",
                        "--threads", "1", "--data-parallel-secret", SECRET) as joined:
            for _ in range(100):
                if httpx.get(f"{front.url}/health").json()["replicas_up"] == [0, 1]:
                    break
                threading.Event().wait(0.2)
            yield front, joined


@pytest.mark.live_server
def test_routing_by_prefix_hits_the_cache_more_than_random_placement(cluster):
    front, _ = cluster
    urls = {r["rank"]: r["url"] for r in httpx.get(f"{front.url}/dp/replicas").json()["replicas"]}
    assert sorted(urls) == [0, 1] and all(urls.values())
    before = front.metrics()
    placed = {}
    for topic in _TOPICS[:4]:
        for ask in _ASK:
            answer = _complete(front.url, f"{_prefix(topic)} {ask}")
            assert answer.status_code == 200, answer.text
            placed.setdefault(topic, set()).add(answer.headers["x-deepinfer-replica"])
    routed = _hit_rate(before, middle := front.metrics())
    assert all(len(ranks) == 1 for ranks in placed.values())  # each prefix stayed on one replica
    assert {r for ranks in placed.values() for r in ranks} == {"0", "1"}  # and the prefixes were spread
    rng = random.Random(0)
    for topic in _TOPICS[4:]:
        for ask in _ASK:
            assert _complete(urls[rng.choice([0, 1])], f"{_prefix(topic)} {ask}").status_code == 200
    scattered = _hit_rate(middle, front.metrics())
    print(f"prefix-cache hit rate: routed {routed:.3f}, random placement {scattered:.3f}")
    assert routed >= 0.6  # 3 of each group's 4 prompts find their ~90% shared prefix cached
    assert routed > scattered


@pytest.mark.live_server
def test_the_dashboard_through_the_front_end_shows_one_replicas_engine(cluster):
    from playwright.sync_api import sync_playwright
    from test_chat_page import CHROMIUM_FLAGS, chromium_path

    front, _ = cluster
    assert httpx.get(f"{front.url}/dashboard/state", params={"replica": "1"}).headers["x-deepinfer-replica"] == "1"
    assert httpx.get(f"{front.url}/dashboard/state", params={"replica": "7"}).status_code == 400
    answer = _complete(front.url, "Dashboard check: one two three", max_tokens=3)
    rank = answer.headers["x-deepinfer-replica"]
    want = parse_metrics(httpx.get(f"{front.url}/metrics").text)[
        f'deepinfer_generation_tokens_total{{replica="{rank}"}}']
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
        page = browser.new_page()
        page.goto(f"{front.url}/dashboard?replica={rank}")
        page.wait_for_function("() => Number(document.body.dataset.refreshes) >= 2", timeout=30_000)
        shown = page.inner_text("#v-gen-total")
        browser.close()
    assert shown == str(int(want))  # replica `rank`'s own counter, not another's nor a sum


@pytest.mark.live_server
def test_the_front_end_refuses_hostile_requests_as_a_replica_does(cluster):
    front, _ = cluster
    secret = {"x-deepinfer-dp-secret": SECRET}
    stolen = httpx.post(f"{front.url}/dp/register", json={"rank": 0, "url": "http://127.0.0.1:1"}, headers=secret)
    assert stolen.status_code == 403 and "only that process registers it" in stolen.json()["error"]["message"]
    assert httpx.post(f"{front.url}/dp/register", content=b"[").status_code == 403  # no secret: not read
    assert httpx.post(f"{front.url}/dp/register", content=b"[", headers=secret).status_code == 400
    huge = httpx.post(f"{front.url}/v1/completions", content=b"{" + b" " * (9 << 20) + b"}",
                      headers={"Content-Type": "application/json"})
    assert huge.status_code == 413 and "the limit is 8388608 bytes" in huge.text
    deep = httpx.post(f"{front.url}/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                      headers={"Content-Type": "application/json"})
    assert deep.status_code == 400 and deep.headers["x-deepinfer-replica"] in ("0", "1")  # the replica's answer
    nested = {"prompt": "hi", "max_tokens": 1, "x": [[[[1]]]]}  # routed by load when no key can be read
    assert httpx.post(f"{front.url}/v1/completions", json=nested).status_code in (200, 400)
    assert httpx.get(f"{front.url}/health").json()["replicas_up"] == [0, 1]


@pytest.mark.live_server
def test_a_replica_stopped_with_sigstop_does_not_hold_a_request(cluster):
    front, joined = cluster
    os.kill(joined.proc.pid, signal.SIGSTOP)  # it accepts connections (the kernel does) and answers nothing
    try:
        started = time.monotonic()
        answer = httpx.get(f"{front.url}/dashboard/state", params={"replica": "1"}, timeout=MUST_NOT_HANG_S)
        print(f"the stopped replica's request ended after {time.monotonic() - started:.1f} s "
              f"(read timeout {READ_TIMEOUT_S:g} s): {answer.status_code}")
    finally:
        os.kill(joined.proc.pid, signal.SIGCONT)
    # failed by its read timeout (504) or at once when the health checks marked it down (502)
    assert answer.status_code in (502, 504) and answer.headers["x-deepinfer-replica"] == "1", answer.text
    _wait_for(lambda: httpx.get(f"{front.url}/health").json()["replicas_up"] == [0, 1], "rank 1 answers again")


@pytest.mark.live_server
def test_a_client_that_leaves_a_whole_answer_aborts_it_on_its_replica(cluster):
    front, _ = cluster
    before = front.metrics()
    body = json.dumps({"prompt": "Count: 1, 2, 3,", "max_tokens": 1500, "ignore_eos": True}).encode()
    client = socket.create_connection(("127.0.0.1", front.port))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n%s" % (len(body), body))
    tokens = "deepinfer_generation_tokens_total"
    _wait_for(lambda: _total(front.metrics(), tokens) > _total(before, tokens) + 8, "the request generates")
    client.close()  # not streamed: its answer has not started
    aborted = ("deepinfer_requests_total", 'status="aborted"')
    _wait_for(lambda: _total(front.metrics(), *aborted) == _total(before, *aborted) + 1, "the request is aborted")
    _wait_for(lambda: _total(front.metrics(), "deepinfer_num_requests_running") == 0, "nothing runs")
    after = _total(front.metrics(), tokens)
    time.sleep(2 * 1.0)  # two health rounds later: not one token more
    assert _total(front.metrics(), tokens) == after and after - _total(before, tokens) < 1500


@pytest.mark.live_server
def test_a_killed_replica_fails_only_its_requests_and_is_routed_no_more(cluster):
    front, joined = cluster
    results: dict[str, object] = {}

    def stream(name: str, topic: str) -> None:
        body = {"prompt": _prefix(topic), "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{front.url}/v1/completions", json=body, timeout=120) as answer:
                results[name + "_rank"] = answer.headers["x-deepinfer-replica"]  # 502s name the replica too
                results[name + "_status"] = answer.status_code
                lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
                results[name] = sum(1 for line in lines if line.startswith('data: {"id"'))
                results[name + "_end"] = lines[-2:]
        except httpx.HTTPError as exc:
            results[name] = exc

    fresh = (("a", "storms over a harbour no other test names"), ("b", "orchards in a spring no other test names"))
    threads = [threading.Thread(target=stream, args=pair) for pair in fresh]  # new prefixes: placed by load
    for t in threads:
        t.start()
    for _ in range(200):  # both streaming: one on each replica (the least loaded takes the second)
        table = httpx.get(f"{front.url}/dp/replicas").json()["replicas"]
        if all(r["in_flight"] == 1 for r in table):
            break
        threading.Event().wait(0.05)
    assert [r["in_flight"] for r in table] == [1, 1], table
    joined.proc.kill()
    for t in threads:
        t.join(120)
    on_killed = "a" if results["a_rank"] == "1" else "b"
    survivor = "b" if on_killed == "a" else "a"
    assert {results["a_rank"], results["b_rank"]} == {"0", "1"}
    assert results[survivor + "_status"] == 200 and results[survivor] == 400, results  # every token streamed
    # killed before its answer started (the front end's 502), or while it streamed (then its stream
    # ends with an error event and [DONE])
    if results[on_killed + "_status"] != 502:
        error, done = results[on_killed + "_end"]
        assert results[on_killed] < 400 and done == "data: [DONE]", results
        assert json.loads(error.removeprefix("data: "))["error"]["code"] == "replica_failed", results
    for _ in range(3):
        answer = _complete(front.url, f"{_prefix(_TOPICS[1])} again")
        assert answer.status_code == 200 and answer.headers["x-deepinfer-replica"] == "0"
    assert httpx.get(f"{front.url}/health").json()["replicas_up"] == [0]
    assert front.metrics()['deepinfer_dp_replica_up{replica="1"}'] == 0.0


@pytest.mark.live_server
def test_a_local_replica_killed_mid_stream_ends_its_streams_with_error_events_and_starts_again(cluster):
    front, _ = cluster  # rank 1 was killed by the test before: every request goes to rank 0
    secret = {"x-deepinfer-dp-secret": SECRET}
    for url in ("http://127.0.0.1:1\r\nX-Injected: 1", "file:///etc/passwd", "http://u:p@127.0.0.1:1"):
        assert httpx.post(f"{front.url}/dp/register", json={"rank": 1, "url": url}, headers=secret).status_code == 400
    for body in (b'{"rank": Infinity, "url": "http://h:1"}', b'{"rank": 1e400, "url": "http://h:1"}',
                 b"[" * 100_000 + b"]" * 100_000):
        assert httpx.post(f"{front.url}/dp/register", content=body, headers=secret).status_code in (400, 413)
    rank0 = httpx.get(f"{front.url}/dp/replicas").json()["replicas"][0]
    model = httpx.get(f"{front.url}/v1/models").json()["data"][0]["id"]
    lines: dict[str, list[str]] = {"openai": [], "ollama": []}
    bodies = {"openai": ("/v1/completions", {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True,
                                             "stream": True}),
              "ollama": ("/api/generate", {"model": model, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "raw": True,
                                           "options": {"num_predict": 400, "temperature": 0}})}

    def read(name: str) -> None:
        path, body = bodies[name]
        with httpx.stream("POST", f"{front.url}{path}", json=body, timeout=MUST_NOT_HANG_S) as answer:
            assert answer.headers["x-deepinfer-replica"] == "0"
            for line in answer.iter_lines():
                if line.strip():
                    lines[name].append(line)

    readers = [threading.Thread(target=read, args=(name,)) for name in lines]
    for t in readers:
        t.start()
    _wait_for(lambda: all(len(got) >= 3 for got in lines.values()), "both streams are under way")
    os.kill(rank0["pid"], signal.SIGKILL)
    for t in readers:
        t.join(MUST_NOT_HANG_S)
    assert lines["openai"][-1] == "data: [DONE]", lines["openai"][-3:]
    assert json.loads(lines["openai"][-2].removeprefix("data: "))["error"]["code"] == "replica_failed"
    ollama_end = json.loads(lines["ollama"][-1])
    assert list(ollama_end) == ["error"] and "data-parallel replica 0 failed" in ollama_end["error"]
    assert len(lines["ollama"]) < 400 and not any('"done": true' in line for line in lines["ollama"])
    _wait_for(lambda: (lambda again: again["up"] and again["pid"] != rank0["pid"])(
        httpx.get(f"{front.url}/dp/replicas").json()["replicas"][0]), "rank 0 is started again")
    again = httpx.get(f"{front.url}/dp/replicas").json()["replicas"][0]
    assert again["restarts"] == 1 and again["url"] != rank0["url"], again  # a new process on a new port
    answer = _complete(front.url, "After the restart:", max_tokens=2)
    assert answer.status_code == 200 and answer.headers["x-deepinfer-replica"] == "0"
    assert front.metrics()["deepinfer_dp_health_task_restarts_total"] == 0.0


@pytest.mark.multirank
@pytest.mark.subprocess
def test_torchrun_ranks_become_a_front_end_and_a_replica_that_joins_it():
    """`torchrun --nproc-per-node 2 ... serve --data-parallel-size 2`: RANK 0 serves the front end
    (with its own replica), RANK 1 a replica that registers with it; both answer through it."""
    import subprocess
    import sys

    from tests.entrypoints.live_server import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "deepinfer.entrypoints.cli", "serve", "--data-parallel-size", "2", "--port",
                            str(port), "--log-level", "warning", "--data-parallel-secret", SECRET],
                           env={**env, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).json().get("replicas_up") == [0, 1]:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert job.poll() is None, job.stderr.read()[-3000:]
            threading.Event().wait(0.2)
        table = {r["rank"]: r for r in httpx.get(f"{url}/dp/replicas").json()["replicas"]}
        assert table[0]["local"] and not table[1]["local"] and table[1]["up"]  # rank 1 joined by itself
        served = {_complete(url, f"{_prefix(t)} Hello", max_tokens=2).headers["x-deepinfer-replica"]
                  for t in _TOPICS[:2]}
        assert served == {"0", "1"}
    finally:
        job.send_signal(signal.SIGTERM)
        job.wait(60)
