"""`deepinfer serve` with data parallelism: the front end, its local replicas, and replicas that join.

    deepinfer serve --data-parallel-size 2            a front end on --port and 2 local replicas
    deepinfer serve --data-parallel-size 4 --data-parallel-size-local 2
                                                      ranks 0, 1 here; 2, 3 join from elsewhere:
    deepinfer serve --data-parallel-address HOST:PORT --data-parallel-rank 2 --host 0.0.0.0 --port 8001
    torchrun --nnodes 2 --nproc-per-node 1 ... -m deepinfer.entrypoints.cli serve --data-parallel-size 2
                                                      RANK 0: the front end (MASTER_ADDR:--port) with
                                                      its replica; RANK r: replica r, joining it

A local replica gets every flag of the command but these (its address is 127.0.0.1 and a free
port) and, without --threads, 1/L of this machine's cores for L local replicas.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import socket
import threading
import urllib.request

from deepinfer.entrypoints.data_parallel.replicas import (
    HEARTBEAT_S,
    SECRET_ENV,
    SECRET_HEADER,
    ReplicaSet,
    start_local_replica,
)

logger = logging.getLogger("deepinfer.server")
_FRONTEND_FLAGS = ("--data-parallel-size", "--data-parallel-size-local", "--data-parallel-address",
                   "--data-parallel-rank", "--data-parallel-routing", "--host", "--port")
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
    if args.data_parallel_address is not None:
        parse_address(args.data_parallel_address)
        if not 0 <= args.data_parallel_rank:
            raise ValueError(f"--data-parallel-rank {args.data_parallel_rank} must be at least 0")


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
    threads = None if args.threads else max(1, len(os.sched_getaffinity(0)) // max(1, local))
    for rank in range(local):
        replica = replicas.replicas[rank]
        replica.start = functools.partial(_start_replica, rank, argv, args.port, threads, env)
        replica.process = replica.start()
    frontend = Frontend(replicas, PrefixRouter(args.data_parallel_routing), _routing_tokenizer(args),
                        args.block_size or 16, secret=secret, remote_joins=bool(args.api_key))
    app = build_frontend(frontend, args.api_key, args.max_body_bytes)
    print(f"deepinfer: data-parallel front end for {size} replicas ({local} here, routing "
          f"{args.data_parallel_routing}) on http://{args.host}:{args.port}/v1", flush=True)
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
    """A replica: register with the front end at --data-parallel-address now and every HEARTBEAT_S."""
    host, frontend_port = parse_address(args.data_parallel_address)
    url = f"http://{advertised_host(args.host, host)}:{port}"
    body = json.dumps({"rank": args.data_parallel_rank, "url": url}).encode()
    headers = {"Content-Type": "application/json"}
    if os.environ.get(SECRET_ENV):  # a child of the front end: the secret it was given
        headers[SECRET_HEADER] = os.environ[SECRET_ENV]
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key.split(',')[0]}"
    target = f"http://{host}:{frontend_port}/dp/register"

    def beat() -> None:
        stop = threading.Event()
        _wait_listening(args.host, port, stop)
        while not stop.wait(0 if not beat.sent else HEARTBEAT_S):
            try:
                urllib.request.urlopen(urllib.request.Request(target, body, headers), timeout=5).read()
                if not beat.sent:
                    logger.info("data-parallel rank %d joined the front end at %s as %s",
                                args.data_parallel_rank, target, url)
                beat.sent = True
            except OSError as exc:
                logger.debug("data-parallel registration at %s failed: %s", target, exc)
                stop.wait(1.0)

    beat.sent = False
    logging.getLogger("uvicorn.access").addFilter(_NotHealthChecks())
    thread = threading.Thread(target=beat, name="deepinfer-dp-join", daemon=True)
    thread.start()
    return thread


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
