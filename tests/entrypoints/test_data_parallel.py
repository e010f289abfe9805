"""Data-parallel serving (`entrypoints/data_parallel/`): the router's choices, the routing key of each
API, the replicas' flags, who may register, the merged /metrics, and a front end whose replicas all
fail to start. The live front end is in test_data_parallel_live.py; what it refuses and how it fails
against stand-in replicas in test_data_parallel_security.py and test_data_parallel_failures.py."""

from __future__ import annotations

import pytest

from deepinfer.entrypoints.data_parallel.launch import check_dp_args, parse_address, replica_argv, torchrun_role
from deepinfer.entrypoints.data_parallel.metrics import merged_text, replica_families
from deepinfer.entrypoints.data_parallel.replicas import MAX_MISSED, ReplicaSet
from deepinfer.entrypoints.data_parallel.router import PrefixRouter, block_hashes
from deepinfer.entrypoints.data_parallel.routing_key import routing_text
from tests.entrypoints.live_server import parse_metrics

SECRET = "cluster-secret-of-these-tests"

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
                data_parallel_rank=0, tensor_parallel_size=1, port=8000, data_parallel_secret=SECRET,
                data_parallel_secret_file=None, data_parallel_read_timeout=600.0)
    return argparse.Namespace(**{**base, **kw})


def test_bad_data_parallel_flags_are_refused_naming_them():
    with pytest.raises(ValueError, match="--data-parallel-size 0"):
        check_dp_args(_dp_args(data_parallel_size=0))
    with pytest.raises(ValueError, match="--data-parallel-size-local 3"):
        check_dp_args(_dp_args(data_parallel_size_local=3))
    with pytest.raises(ValueError, match="--data-parallel-address 'nohost'"):
        parse_address("nohost")
    assert parse_address("[::1]:80") == ("::1", 80)


@pytest.mark.multirank
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
    with pytest.raises(ValueError, match="under torchrun needs --data-parallel-secret-file"):
        torchrun_role(_dp_args(data_parallel_secret=None), {"RANK": "0", "WORLD_SIZE": "2"})


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


def test_only_its_child_registers_a_local_rank_and_other_ranks_need_the_cluster_secret():
    from deepinfer.entrypoints.data_parallel.frontend import Frontend
    from deepinfer.entrypoints.data_parallel.registration import (
        CHILD,
        CLUSTER,
        no_secret_refusal,
        registration_refusal,
        secret_kind,
    )

    replicas = ReplicaSet(3)
    replicas.replicas[0].process = _Child()
    front = Frontend(replicas, PrefixRouter(), None, 16, child_secret="c" * 32, cluster_secret=SECRET)
    assert secret_kind(front, ["c" * 32]) == CHILD and secret_kind(front, [SECRET]) == CLUSTER
    assert secret_kind(front, []) is None and secret_kind(front, ["guess"]) is None
    assert secret_kind(front, [SECRET, SECRET]) is None  # exactly one header
    assert "rank 0 is a replica this front end started" in registration_refusal(front, 0, CLUSTER)
    assert registration_refusal(front, 0, CHILD) is None
    assert registration_refusal(front, 1, CLUSTER) is None
    assert "joins with the cluster secret" in registration_refusal(front, 1, CHILD)
    closed = Frontend(ReplicaSet(2), PrefixRouter(), None, 16, child_secret="c" * 32, cluster_secret=None)
    assert secret_kind(closed, [SECRET]) is None and secret_kind(closed, [""]) is None
    assert "has no --data-parallel-secret, so it accepts no replica" in no_secret_refusal(closed)


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
    families, rejected = replica_families({0: one, 1: one.replace("3.0", "5.0")})
    text = merged_text(CollectorRegistry(), families).decode()
    assert rejected == {}
    values = parse_metrics(text)
    assert values['a_total{replica="0",x="1"}'] == 3.0 and values['a_total{replica="1",x="1"}'] == 5.0
    assert values['g{replica="1"}'] == 2.0 and text.count("# TYPE a_total counter") == 1


@pytest.mark.multirank
@pytest.mark.subprocess
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
    assert "no --data-parallel-secret: this front end accepts no replica but the 2 it starts" in done.stdout
