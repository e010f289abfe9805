"""Data-parallel serving (`entrypoints/data_parallel/`): the router's choices, the routing key of each
API, the replicas' flags, the merged /metrics, and a live front end on the default model with one
local replica and one that joins: prefix-aware routing against random placement on a shared-prefix
workload, and a killed replica that fails only its own requests."""

from __future__ import annotations

import os
import random
import signal
import threading

import httpx
import pytest

from deepinfer.entrypoints.data_parallel.launch import check_dp_args, parse_address, replica_argv, torchrun_role
from deepinfer.entrypoints.data_parallel.metrics import merged_text
from deepinfer.entrypoints.data_parallel.replicas import MAX_MISSED, ReplicaSet
from deepinfer.entrypoints.data_parallel.router import PrefixRouter, block_hashes
from deepinfer.entrypoints.data_parallel.routing_key import routing_text
from tests.entrypoints.live_server import LiveServer, parse_metrics

# ---- the router ----------------------------------------------------------------------------------


def test_block_hashes_chain_over_full_blocks_only():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # 40 tokens: two full blocks, the partial one has no hash
    b = block_hashes([*range(16), 99, *range(17, 40)], 16)
    assert a[0] == b[0] and a[1] != b[1]  # the second hash names the whole prefix up to block 1
    c = block_hashes([*range(1, 16), 0, *range(16, 40)], 16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash
    assert len(block_hashes(list(range(16 * 50)), 16, max_blocks=8)) == 8


def test_a_shared_prefix_goes_where_it_went_before_unless_that_replica_is_overloaded():
    router = PrefixRouter("prefix", max_imbalance=2)
    shared = list(range(64))
    first = router.route(block_hashes(shared + [1] * 16, 16), {0: 0, 1: 0})
    assert first.reason == "least-load" and first.matched_blocks == 0
    again = router.route(block_hashes(shared + [2] * 16, 16), {0: 0, 1: 0} | {first.rank: 1})
    assert again.rank == first.rank and again.reason == "prefix" and again.matched_blocks == 4
    other = 1 - first.rank
    busy = router.route(block_hashes(shared, 16), {first.rank: 3, other: 0})  # 3 > 0 + 2: too loaded
    assert busy.rank == other and busy.reason == "least-load"


def test_a_replica_that_went_down_is_forgotten_and_none_up_is_an_error():
    router = PrefixRouter("prefix")
    hashes = block_hashes(list(range(32)), 16)
    rank = router.route(hashes, {0: 0, 1: 0}).rank
    moved = router.route(hashes, {1 - rank: 0})  # only the other one is up: the prefix moves there
    assert moved.rank == 1 - rank and moved.reason == "least-load"
    assert router.route(hashes, {0: 0, 1: 0}) == type(moved)(1 - rank, 2, "prefix")
    router.forget(1 - rank)  # it went down: its cache is gone, and so is what it was routed
    assert router.route(hashes, {0: 5, 1: 5}).reason == "least-load"
    with pytest.raises(ValueError, match="no data-parallel replica is up"):
        router.route(hashes, {})
    with pytest.raises(ValueError, match="--data-parallel-routing 'roundrobin'"):
        PrefixRouter("roundrobin")


def test_least_load_spreads_ties_and_random_is_seeded():
    router = PrefixRouter("least-load")
    ranks = [router.route([], {0: 0, 1: 0, 2: 0}).rank for _ in range(6)]
    assert sorted(ranks) == [0, 0, 1, 1, 2, 2]  # ties go to the replica routed the fewest so far
    a, b = PrefixRouter("random", seed=7), PrefixRouter("random", seed=7)
    draws = [[r.route([], {0: 0, 1: 0}).rank for _ in range(12)] for r in (a, b)]
    assert draws[0] == draws[1] and set(draws[0]) == {0, 1}


def test_the_routing_key_of_each_api_starts_with_the_shared_part():
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "Q"}]}]}
    assert routing_text("/v1/chat/completions", chat) == "system\nS\nuser\nQ"
    assert routing_text("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert routing_text("/api/generate", {"prompt": "P"}) == "P"
    assert routing_text("/v1/messages", {"system": "S", "messages": [{"role": "user", "content": "Q"}]}) \
        == "S\nuser\nQ"
    assert routing_text("/v1/responses", {"instructions": "I", "input": "Q"}) == "I\nQ"
    assert routing_text("/v1/embeddings", {"input": "x"}) is None and routing_text("/v1/completions", [1]) is None


# ---- flags and replicas ----------------------------------------------------------------------------


def test_a_local_replica_gets_every_flag_but_the_front_ends():
    argv = ["--model", "m.gguf", "--data-parallel-size", "2", "--port=8000", "--host", "0.0.0.0",
            "--data-parallel-routing", "random", "--api-key", "k"]
    assert replica_argv(argv, 1, 8000, 9001, threads=4) == [
        "--model", "m.gguf", "--api-key", "k", "--threads", "4", "--host", "127.0.0.1", "--port", "9001",
        "--data-parallel-address", "127.0.0.1:8000", "--data-parallel-rank", "1"]
    assert "--threads" not in replica_argv(["--threads", "2"], 0, 1, 2, threads=None)[2:]


def _dp_args(**kw):
    import argparse

    base = dict(data_parallel_size=2, data_parallel_size_local=None, data_parallel_address=None,
                data_parallel_rank=0, tensor_parallel_size=1, port=8000)
    return argparse.Namespace(**{**base, **kw})


def test_bad_data_parallel_flags_are_refused_naming_them():
    with pytest.raises(ValueError, match="--data-parallel-size 0"):
        check_dp_args(_dp_args(data_parallel_size=0))
    with pytest.raises(ValueError, match="--data-parallel-size-local 3"):
        check_dp_args(_dp_args(data_parallel_size_local=3))
    with pytest.raises(ValueError, match="--data-parallel-address 'nohost'"):
        parse_address("nohost")
    assert parse_address("[::1]:80") == ("::1", 80)


def test_under_torchrun_rank_0_is_the_front_end_and_the_others_join_it():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    args = _dp_args()
    assert torchrun_role(args, env) == "replica"
    assert args.data_parallel_address == "10.0.0.5:8000" and args.data_parallel_rank == 1
    assert "RANK" not in env  # no tensor parallelism starts in the replica
    front = _dp_args()
    assert torchrun_role(front, {"RANK": "0", "WORLD_SIZE": "2"}) == "frontend" and front.data_parallel_size_local == 1
    with pytest.raises(ValueError, match="must equal WORLD_SIZE=4"):
        torchrun_role(_dp_args(), {"RANK": "0", "WORLD_SIZE": "4"})


def test_replicas_go_down_after_missed_health_checks_and_come_back():
    replicas = ReplicaSet(2)
    with pytest.raises(ValueError, match="rank 2 is outside --data-parallel-size 2"):
        replicas.register(2, "http://x:1")
    replicas.register(1, "http://127.0.0.1:9")
    assert replicas.loads() == {1: 0}
    went_down = [replicas.health_result(1, False) for _ in range(MAX_MISSED)]
    assert went_down == [False] * (MAX_MISSED - 1) + [True] and replicas.loads() == {}
    replicas.health_result(1, True)
    assert replicas.loads() == {1: 0}


class _Child:
    returncode = None

    def poll(self):
        return None


def test_only_its_child_registers_a_local_rank_and_other_machines_need_the_api_key():
    from deepinfer.entrypoints.data_parallel.frontend import Frontend, registration_refusal

    replicas = ReplicaSet(3)
    replicas.replicas[0].process = _Child()
    closed = Frontend(replicas, PrefixRouter(), None, 16, secret="s3cret", remote_joins=False)
    assert "rank 0 is a replica this front end started" in registration_refusal(closed, 0, None, "127.0.0.1")
    assert registration_refusal(closed, 0, "guess", "127.0.0.1") is not None
    assert registration_refusal(closed, 0, "s3cret", "127.0.0.1") is None
    assert registration_refusal(closed, 1, None, "127.0.0.1") is None
    assert registration_refusal(closed, 2, None, "::1") is None
    assert "start the front end with --api-key" in registration_refusal(closed, 1, None, "10.0.0.7")
    assert registration_refusal(closed, 1, None, "not-an-address") is not None
    keyed = Frontend(replicas, PrefixRouter(), None, 16, secret="s3cret", remote_joins=True)
    assert registration_refusal(keyed, 1, None, "10.0.0.7") is None  # the API key was checked already
    assert registration_refusal(keyed, 0, None, "10.0.0.7") is not None


class _Exiting(_Child):
    def __init__(self, status=None):
        self.returncode = status

    def poll(self):
        return self.returncode


def test_a_local_child_that_exits_after_it_was_up_is_started_again_within_a_budget():
    from deepinfer.entrypoints.data_parallel.replicas import MAX_RESTARTS, RESTART_WINDOW_S

    replicas, started = ReplicaSet(2), []
    for r in replicas.replicas.values():
        r.start = lambda rank=r.rank: started.append(rank) or _Child()
        r.process = _Exiting(1)
    replicas.replicas[0].was_up = True  # rank 1 never came up: a start-up error, not restarted
    assert replicas.restart_exited(now=0.0) == [0] and started == [0]
    assert replicas.replicas[0].url == "" and not replicas.replicas[0].exited
    for i in range(1, MAX_RESTARTS + 1):
        replicas.replicas[0].process, replicas.replicas[0].was_up = _Exiting(1), True
        assert replicas.restart_exited(now=float(i)) == ([0] if i < MAX_RESTARTS else [])
    assert replicas.all_local_exited()  # the budget is spent and rank 1 never came up: stop
    assert replicas.restart_exited(now=RESTART_WINDOW_S + 5) == [0]  # the window moved on


def test_merged_metrics_label_each_replicas_samples():
    from prometheus_client import CollectorRegistry

    one = "# HELP a_total A\n# TYPE a_total counter\na_total{x=\"1\"} 3.0\n# TYPE g gauge\ng 2.0\n"
    text = merged_text(CollectorRegistry(), {0: one, 1: one.replace("3.0", "5.0")}).decode()
    values = parse_metrics(text)
    assert values['a_total{replica="0",x="1"}'] == 3.0 and values['a_total{replica="1",x="1"}'] == 5.0
    assert values['g{replica="1"}'] == 2.0 and text.count("# TYPE a_total counter") == 1


def test_a_front_end_whose_replicas_all_fail_to_start_exits_1_with_their_errors():
    """Two replicas of two tensor-parallel ranks each: SmolLM2's 9 heads do not split in two, so
    both replicas exit at start-up, and the front end stops instead of answering 503 forever."""
    import subprocess
    import sys

    from tests.entrypoints.live_server import free_port

    done = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "serve", "--port", str(free_port()),
                           "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--log-level", "warning"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.count("tensor_parallel_size=2 must divide num_attention_heads=9") == 2
    assert "every data-parallel replica exited (status [2, 2])" in done.stderr


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
                            str(port), "--log-level", "warning"], env={**env, "OMP_NUM_THREADS": "1"},
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


# ---- live: a front end, its local replica 0 and a replica 1 that joins -----------------------------

_TOPICS = ["lighthouses of the northern coast", "the history of paper money", "how bees build their combs",
           "glaciers and the valleys they carve", "the first railways in Europe", "tides and the moon",
           "the chemistry of bread dough", "maps drawn before satellites"]
_ASK = ["Summarise it.", "Give one fact.", "Name a place.", "Ask a question about it."]


def _prefix(topic: str) -> str:
    return (f"You are a patient teacher. The lesson today is about {topic}. " * 6).strip()


def _complete(url: str, prompt: str, max_tokens: int = 1) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _hit_rate(before: dict, after: dict) -> float:
    def total(values, name):
        return sum(v for k, v in values.items() if k.startswith(name + "{"))

    def delta(name: str) -> float:
        counter = f"deepinfer_prefix_cache_{name}_total"
        return total(after, counter) - total(before, counter)

    return delta("hits") / delta("queries")


@pytest.fixture(scope="module")
def cluster():
    with LiveServer("--data-parallel-size", "2", "--data-parallel-size-local", "1", "--threads", "1") as front:
        with LiveServer("--data-parallel-address", f"127.0.0.1:{front.port}", "--data-parallel-rank", "1",
                        "--threads", "1") as joined:
            for _ in range(100):
                if httpx.get(f"{front.url}/health").json()["replicas_up"] == [0, 1]:
                    break
                threading.Event().wait(0.2)
            yield front, joined


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


def test_the_front_end_refuses_hostile_requests_as_a_replica_does(cluster):
    front, _ = cluster
    stolen = httpx.post(f"{front.url}/dp/register", json={"rank": 0, "url": "http://127.0.0.1:1"})
    assert stolen.status_code == 403 and "only that process registers it" in stolen.json()["error"]["message"]
    assert httpx.post(f"{front.url}/dp/register", content=b"[").status_code == 400
    huge = httpx.post(f"{front.url}/v1/completions", content=b"{" + b" " * (9 << 20) + b"}",
                      headers={"Content-Type": "application/json"})
    assert huge.status_code == 413 and "the limit is 8388608 bytes" in huge.text
    deep = httpx.post(f"{front.url}/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                      headers={"Content-Type": "application/json"})
    assert deep.status_code == 400 and deep.headers["x-deepinfer-replica"] in ("0", "1")  # the replica's answer
    nested = {"prompt": "hi", "max_tokens": 1, "x": [[[[1]]]]}  # routed by load when no key can be read
    assert httpx.post(f"{front.url}/v1/completions", json=nested).status_code in (200, 400)
    assert httpx.get(f"{front.url}/health").json()["replicas_up"] == [0, 1]


def test_a_killed_replica_fails_only_its_requests_and_is_routed_no_more(cluster):
    front, joined = cluster
    results: dict[str, object] = {}

    def stream(name: str, topic: str) -> None:
        body = {"prompt": _prefix(topic), "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{front.url}/v1/completions", json=body, timeout=120) as answer:
                results[name + "_rank"] = answer.headers["x-deepinfer-replica"]  # 502s name the replica too
                results[name + "_status"] = answer.status_code
                results[name] = sum(1 for line in answer.iter_lines() if line.startswith("data: {"))
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
    # killed before its answer started (the front end's 502), or while it streamed (a cut stream)
    killed = results[on_killed]
    assert results.get(on_killed + "_status") == 502 or isinstance(killed, Exception) or killed < 400, results
    for _ in range(3):
        answer = _complete(front.url, f"{_prefix(_TOPICS[1])} again")
        assert answer.status_code == 200 and answer.headers["x-deepinfer-replica"] == "0"
    assert httpx.get(f"{front.url}/health").json()["replicas_up"] == [0]
    assert front.metrics()['deepinfer_dp_replica_up{replica="1"}'] == 0.0


def test_a_local_replica_that_dies_is_started_again_and_serves(cluster):
    front, _ = cluster
    rank0 = httpx.get(f"{front.url}/dp/replicas").json()["replicas"][0]
    os.kill(rank0["pid"], signal.SIGKILL)
    for _ in range(600):
        again = httpx.get(f"{front.url}/dp/replicas").json()["replicas"][0]
        if again["up"] and again["pid"] != rank0["pid"]:
            break
        threading.Event().wait(0.2)
    assert again["restarts"] == 1 and again["url"] != rank0["url"], again  # a new process on a new port
    answer = _complete(front.url, "After the restart:", max_tokens=2)
    assert answer.status_code == 200 and answer.headers["x-deepinfer-replica"] == "0"
