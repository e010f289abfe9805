"""`deepinfer serve` with data parallelism: the front end, its local replicas, and replicas that join.

    deepinfer serve --data-parallel-size 2            a front end on --port and 2 local replicas
    deepinfer serve --data-parallel-size 4 --data-parallel-size-local 2
                                                      ranks 0, 1 here; 2, 3 join from elsewhere:
    deepinfer serve --data-parallel-address HOST:PORT --data-parallel-rank 2 --host 0.0.0.0 --port 8001
    torchrun --nnodes 2 --nproc-per-node 1 ... -m deepinfer.entrypoints.cli serve --data-parallel-size 2
                                                      RANK 0: the front end (MASTER_ADDR:--port) with
                                                      its replica; RANK r: replica r, joining it

A local replica gets every flag of the command but these (its address is 127.0.0.1 and a free
port) and, without --threads, 1/L of this machine's cores for L local replicas. It registers with a
per-run secret in its environment; every other replica with the cluster secret
(--data-parallel-secret or --data-parallel-secret-file on the front end and on the replica: identity.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import socket
import threading
import urllib.error
import urllib.request

from deepinfer.entrypoints.data_parallel.identity import HOST_SECRET_ENV, SECRET_ENV, SECRET_HEADER, cluster_secret
from deepinfer.entrypoints.data_parallel.replicas import HEARTBEAT_S, ReplicaSet, start_local_replica

logger = logging.getLogger("deepinfer.server")
_FRONTEND_FLAGS = ("--data-parallel-size", "--data-parallel-size-local", "--data-parallel-address",
                   "--data-parallel-rank", "--data-parallel-routing", "--data-parallel-secret",
                   "--data-parallel-secret-file", "--data-parallel-read-timeout", "--host", "--port")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


def replica_argv(argv: list[str], rank: int, frontend_port: int, port: int, threads: int | None) -> list[str]:
    """The serve flags of local replica `rank`: `argv` without the front end's own flags, listening on
    127.0.0.1:`port` and joining the front end on 127.0.0.1:`frontend_port`."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _FRONTEND_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in _FRONTEND_FLAGS)):
            kept.append(arg)
    if threads is not None and not any(a == "--threads" or a.startswith("--threads=") for a in kept):
        kept += ["--threads", str(threads)]
    return [*kept, "--host", "127.0.0.1", "--port", str(port),
            "--data-parallel-address", f"127.0.0.1:{frontend_port}", "--data-parallel-rank", str(rank)]


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT of --data-parallel-address; ValueError naming it otherwise."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--data-parallel-address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def check_dp_args(args) -> None:
    """The data-parallel flags, consistent; ValueError naming the flag and value."""
    size, local = args.data_parallel_size, args.data_parallel_size_local
    if size < 1:
        raise ValueError(f"--data-parallel-size {size} must be at least 1")
    if local is not None and not 0 <= local <= size:
        raise ValueError(f"--data-parallel-size-local {local} must be within 0..--data-parallel-size {size}")
    if not args.data_parallel_read_timeout > 0:
        raise ValueError(f"--data-parallel-read-timeout {args.data_parallel_read_timeout} must be > 0 (seconds)")
    secret = cluster_secret(args)  # a bad secret or an unreadable file fails here, naming the flag
    if args.data_parallel_address is not None:
        parse_address(args.data_parallel_address)
        if not 0 <= args.data_parallel_rank:
            raise ValueError(f"--data-parallel-rank {args.data_parallel_rank} must be at least 0")
        if secret is None and not os.environ.get(SECRET_ENV):
            raise ValueError("--data-parallel-address needs --data-parallel-secret or --data-parallel-secret-file: "
                             "a replica joins its front end with the front end's cluster secret")


def replica_secret(args) -> str | None:
    """The secret of a replica that joins a front end (--data-parallel-address): the cluster secret,
    else the one its front end put into its environment; None for a server that joins none. The
    replica trusts `x-deepinfer-client` only beside it."""
    if args.data_parallel_address is None:
        return os.environ.get(HOST_SECRET_ENV) or None  # a model host's child
    return cluster_secret(args) or os.environ.get(SECRET_ENV) or None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_frontend(args, argv: list[str]) -> int:
    """Start the local replicas, serve the front end until a signal, then stop the replicas."""
    import uvicorn

    from deepinfer.entrypoints.data_parallel.frontend import Frontend, build_frontend
    from deepinfer.entrypoints.data_parallel.router import PrefixRouter
    from deepinfer.entrypoints.openai.connections import ConnectionLimits, TimedH11Protocol

    size = args.data_parallel_size
    local = size if args.data_parallel_size_local is None else args.data_parallel_size_local
    replicas = ReplicaSet(size)
    secret = secrets.token_hex(16)
    env = {**{k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}, SECRET_ENV: secret}
    shared = cluster_secret(args)
    threads = None if args.threads else max(1, len(os.sched_getaffinity(0)) // max(1, local))
    for rank in range(local):
        replica = replicas.replicas[rank]
        replica.start = functools.partial(_start_replica, rank, argv, args.port, threads, env)
        replica.process = replica.start()
    frontend = Frontend(replicas, PrefixRouter(args.data_parallel_routing), _routing_tokenizer(args),
                        args.block_size or 16, child_secret=secret, cluster_secret=shared, api_key=args.api_key,
                        read_timeout=args.data_parallel_read_timeout)
    app = build_frontend(frontend, args.max_body_bytes, args.max_requests_per_client)
    print(f"deepinfer: data-parallel front end for {size} replicas ({local} here, routing "
          f"{args.data_parallel_routing}) on http://{args.host}:{args.port}/v1", flush=True)
    if shared is None:
        print(f"deepinfer: no --data-parallel-secret: this front end accepts no replica but the {local} it "
              f"starts" + (f"; ranks {local}..{size - 1} cannot join" if local < size else ""), flush=True)
    limits = ConnectionLimits(args.timeout_keep_alive, args.timeout_request_header, args.timeout_request_body,
                              args.max_connections)  # the replicas' connection bounds, here too
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_keep_alive=limits.keep_alive_s,
                                           http=functools.partial(TimedH11Protocol, limits=limits)))
    frontend.stop = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    finally:
        replicas.stop_local(args.shutdown_grace)
    return 1 if frontend.failed else 0


def _start_replica(rank: int, argv: list[str], frontend_port: int, threads: int | None, env: dict[str, str]):
    """Local replica `rank` as a child, on a free port (a new one at each start)."""
    return start_local_replica(rank, replica_argv(argv, rank, frontend_port, free_port(), threads), env)


def _routing_tokenizer(args):
    """The model's tokenizer (for routing keys only), without its weights."""
    from deepinfer.model_executor.loader.source import load_model_source

    return load_model_source(args.model, "dummy", revision=args.revision).tokenizer


def start_joining(args, port: int) -> threading.Thread:
    """A replica: register with the front end at --data-parallel-address now and every HEARTBEAT_S
    (with its secret); a refusal is logged with the front end's reason, once."""
    host, frontend_port = parse_address(args.data_parallel_address)
    url = f"http://{_in_url(advertised_host(args.host, host))}:{port}"
    body = json.dumps({"rank": args.data_parallel_rank, "url": url}).encode()
    headers = {"Content-Type": "application/json", SECRET_HEADER: replica_secret(args) or ""}
    target = f"http://{_in_url(host)}:{frontend_port}/dp/register"
    said: dict[str, str] = {}  # what was logged last: "joined" or the refusal

    def beat() -> None:
        stop = threading.Event()
        _wait_listening(args.host, port, stop)
        while not stop.wait(HEARTBEAT_S if said else 0):
            try:
                urllib.request.urlopen(urllib.request.Request(target, body, headers), timeout=5).read()
                _say(said, "joined", logging.INFO, f"data-parallel rank {args.data_parallel_rank} joined the "
                     f"front end at {target} as {url}")
            except urllib.error.HTTPError as exc:  # refused: say why (the front end's message)
                reason = exc.read(2000).decode("utf-8", "replace")
                _say(said, reason, logging.WARNING, f"data-parallel registration at {target} refused "
                     f"({exc.code}): {reason}")
            except OSError as exc:
                logger.debug("data-parallel registration at %s failed: %s", target, exc)
                stop.wait(1.0)

    logging.getLogger("uvicorn.access").addFilter(_NotHealthChecks())
    thread = threading.Thread(target=beat, name="deepinfer-dp-join", daemon=True)
    thread.start()
    return thread


def _say(said: dict[str, str], what: str, level: int, line: str) -> None:
    """Log `line` unless it says what was said last."""
    if said.get("last") != what:
        logger.log(level, "%s", line)
    said["last"] = what


def _in_url(host: str) -> str:
    """A host as it goes into a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


class _NotHealthChecks(logging.Filter):
    """A replica's access log without the front end's health checks (one a second)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.args, tuple) and len(record.args) > 2 and record.args[2] == "/health")


def _wait_listening(host: str, port: int, stop: threading.Event) -> None:
    """Until this process's own server answers /health (registering earlier would draw requests)."""
    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    while True:
        try:
            urllib.request.urlopen(f"http://{local}:{port}/health", timeout=2).read()
            return
        except OSError:
            stop.wait(0.2)


def advertised_host(listen_host: str, frontend_host: str) -> str:
    """The address the front end reaches this replica at: the listen address, or for a wildcard
    one the local address of the route to the front end."""
    if listen_host not in ("0.0.0.0", "::", ""):
        return listen_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((frontend_host, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


def serve_data_parallel(args) -> int | None:
    """Run the front end when this `deepinfer serve` is one (its exit status); None when it is a
    plain server, possibly a replica that joins a front end (`start_joining` once it listens)."""
    check_dp_args(args)
    role = torchrun_role(args)
    if role == "frontend" or (role is None and args.data_parallel_size > 1):
        argv = list(getattr(args, "argv", None) or [])
        return run_frontend(args, argv[argv.index("serve") + 1:] if "serve" in argv else argv)
    return None


def torchrun_role(args, environ=os.environ) -> str | None:
    """Under torchrun with --data-parallel-size N (N = WORLD_SIZE): "frontend" on RANK 0 (one local
    replica), "replica" elsewhere (rank and address set from RANK and MASTER_ADDR). The torchrun
    variables are removed so that no replica starts tensor parallelism. None otherwise."""
    if args.data_parallel_size == 1 or "RANK" not in environ:
        return None
    rank, world = int(environ["RANK"]), int(environ.get("WORLD_SIZE", "0"))
    if world != args.data_parallel_size:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} under torchrun must equal "
                         f"WORLD_SIZE={world} (one replica per rank)")
    if cluster_secret(args) is None:
        raise ValueError("--data-parallel-size under torchrun needs --data-parallel-secret-file (or "
                         "--data-parallel-secret): the ranks other than 0 join the front end with it")
    master = environ.get("MASTER_ADDR", "127.0.0.1")
    for name in _TORCHRUN_VARS:
        environ.pop(name, None)
    if rank == 0:
        args.data_parallel_size_local = 1
        return "frontend"
    args.data_parallel_address, args.data_parallel_rank = f"{master}:{args.port}", rank
    args.port = free_port("0.0.0.0")
    args.data_parallel_size = 1
    return "replica"
