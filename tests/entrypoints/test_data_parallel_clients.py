"""Client identity and the cluster secret of data-parallel serving: a replica believes the
`x-deepinfer-client` header only beside its own secret (its per-client share and the fair share's
client alike), so a client that forges the header gains nothing; the secret flags refuse a weak or
unreadable secret without printing it, and a replica that joins needs one."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest
from fastapi.responses import JSONResponse

from deepinfer.entrypoints.data_parallel.identity import CLIENT_HEADER, SECRET_HEADER
from deepinfer.serving.tenancy import key_id

SECRET = "cluster-secret-of-these-tests"
CHILD_SECRET = "child-secret-of-these-tests"


def _scope(headers: dict[str, str], peer: str = "10.0.0.1") -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/completions", "client": (peer, 5),
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}


def test_a_replica_believes_the_client_header_only_beside_its_own_secret():
    from deepinfer.entrypoints.openai.admission import scope_client
    from deepinfer.serving.tenancy import Credentials

    def client_key(scope, secret, credentials=None):
        return scope_client(credentials or Credentials(), secret, scope)

    named = {CLIENT_HEADER: key_id("k2")}
    assert client_key(_scope(named), None) == "addr:10.0.0.1"  # a plain server trusts nobody
    assert client_key(_scope(named), SECRET) == "addr:10.0.0.1"  # no secret sent
    assert client_key(_scope({**named, SECRET_HEADER: "wrong-secret-wrong"}), SECRET) == "addr:10.0.0.1"
    assert client_key(_scope({**named, SECRET_HEADER: SECRET[:-1]}), SECRET) == "addr:10.0.0.1"
    assert client_key(_scope({CLIENT_HEADER: "key:" + "x" * 200, SECRET_HEADER: SECRET}), SECRET) == "addr:10.0.0.1"
    assert client_key(_scope({**named, SECRET_HEADER: SECRET}), SECRET) == key_id("k2")
    by_key = _scope({"authorization": "Bearer k1"})
    assert client_key(by_key, None, Credentials("k1")) == key_id("k1")  # the name the front end uses
    assert client_key(_scope({**named, "authorization": "Bearer k1"}), None, Credentials("k1")) == key_id("k1")


def test_a_replicas_share_counts_the_client_the_front_end_names():
    import functools

    from deepinfer.entrypoints.openai.admission import ClientShares, scope_client
    from deepinfer.serving.admission import ClientSeats
    from deepinfer.serving.tenancy import Credentials

    release = asyncio.Event()

    async def app(scope, receive, send):
        await release.wait()
        await JSONResponse({})(scope, receive, send)

    async def main() -> list[int]:
        shares = ClientShares(app, ClientSeats(1), functools.partial(scope_client, Credentials(), SECRET))
        transport = httpx.ASGITransport(app=shares)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            def post(headers):
                return asyncio.ensure_future(client.post("/v1/completions", json={}, headers=headers))
            first = post({CLIENT_HEADER: key_id("a"), SECRET_HEADER: SECRET})
            await asyncio.sleep(0.05)
            other = post({CLIENT_HEADER: key_id("b"), SECRET_HEADER: SECRET})  # another client: its own share
            same = post({CLIENT_HEADER: key_id("a"), SECRET_HEADER: SECRET})
            forged = post({CLIENT_HEADER: key_id("c")})  # no secret: the peer address, whose share...
            await asyncio.sleep(0.05)
            forged_too = post({CLIENT_HEADER: key_id("d")})  # ...is taken: a new name gains nothing
            await asyncio.sleep(0.05)
            release.set()
            return [(await t).status_code for t in (first, other, same, forged, forged_too)]

    assert asyncio.run(main()) == [200, 200, 429, 200, 429]


def test_the_cluster_secret_flags(tmp_path):
    from deepinfer.entrypoints.data_parallel.identity import cluster_secret
    from deepinfer.entrypoints.data_parallel.launch import replica_argv

    def args(secret=None, path=None):
        return argparse.Namespace(data_parallel_secret=secret, data_parallel_secret_file=path)

    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    assert cluster_secret(args(path=str(secret_file))) == SECRET and cluster_secret(args(SECRET)) == SECRET
    assert cluster_secret(args()) is None
    for bad, match in [(args("short"), "--data-parallel-secret: a secret of 5 characters"),
                       (args("with spaces inside it"), "printable ASCII without spaces"),
                       (args("sécret-" * 4), "printable ASCII"),
                       (args(SECRET, str(secret_file)), "not both"),
                       (args(path=str(tmp_path / "missing")), "-secret-file .*missing.* cannot be read")]:
        with pytest.raises(ValueError, match=match) as refused:
            cluster_secret(bad)
        assert SECRET not in str(refused.value) and "with spaces inside it" not in str(refused.value)
    argv = ["--model", "m", "--data-parallel-secret", SECRET, "--data-parallel-secret-file=/s",
            "--data-parallel-read-timeout", "5"]
    assert replica_argv(argv, 0, 1, 2, None)[:2] == ["--model", "m"] and SECRET not in replica_argv(argv, 0, 1, 2, None)


def test_a_replica_address_without_a_secret_is_refused_at_start_up(monkeypatch):
    from deepinfer.entrypoints.data_parallel.identity import SECRET_ENV
    from deepinfer.entrypoints.data_parallel.launch import check_dp_args, replica_secret

    monkeypatch.delenv(SECRET_ENV, raising=False)
    args = argparse.Namespace(data_parallel_size=1, data_parallel_size_local=None, data_parallel_address="h:1",
                              data_parallel_rank=1, data_parallel_secret=None, data_parallel_secret_file=None,
                              data_parallel_read_timeout=600.0)
    with pytest.raises(ValueError, match="--data-parallel-address needs --data-parallel-secret"):
        check_dp_args(args)
    monkeypatch.setenv(SECRET_ENV, CHILD_SECRET)  # a local child: its front end's secret
    check_dp_args(args)
    assert replica_secret(args) == CHILD_SECRET
    args.data_parallel_secret = SECRET
    assert replica_secret(args) == SECRET
    args.data_parallel_read_timeout = 0
    with pytest.raises(ValueError, match="--data-parallel-read-timeout 0 must be > 0"):
        check_dp_args(args)
