"""`deepinfer serve`: the engine behind uvicorn, with a graceful shutdown and connection limits.

On the first SIGINT or SIGTERM the server keeps listening but answers new requests with 503,
lets running requests finish for most of `--shutdown-grace` seconds, aborts what is left, and
then lets uvicorn close the connections; the process exits 0. A second signal stops at once.
If the engine dies of a fatal fault, the server shuts down and the process exits with
FATAL_EXIT_STATUS (a supervisor restarts it) rather than answering 503 forever.

Connections are bounded (`connections.py`: `TimedH11Protocol`): an idle one is closed after `--timeout-keep-alive`,
a request head must arrive within `--timeout-request-header`, its body within
`--timeout-request-body`, and at most `--max-connections` are served at once.
Its flags live in `args.py`, which the CLI imports without uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import threading

import uvicorn

from deepinfer.entrypoints.engine_args import make_llm
from deepinfer.entrypoints.openai.connections import ConnectionLimits, TimedH11Protocol

FATAL_EXIT_STATUS = 1
# The grace period, in order: running requests may finish (80% of what the reserve leaves),
# then the aborted ones end their streams; the reserve is for uvicorn to close the connections
# (a third of it) and for the process to exit.
_MAX_RESERVE_S, _RESERVE_SHARE, _FINISH_SHARE = 1.5, 0.4, 0.8


def shutdown_budget(grace_s: float) -> tuple[float, float, float]:
    """(finish_s, abort_s, close_s): seconds to finish, then to end aborted streams, then to close."""
    reserve = min(_MAX_RESERVE_S, _RESERVE_SHARE * grace_s)
    finish = (grace_s - reserve) * _FINISH_SHARE
    return finish, grace_s - reserve - finish, reserve / 3


logger = logging.getLogger("deepinfer.server")


def run_server(args) -> int:
    """Load the engine, serve until a signal, drain, and end the process with status 0 (or
    FATAL_EXIT_STATUS after a fatal engine fault).

    The process ends through `os._exit` once uvicorn has shut down: the interpreter's own
    teardown (over a second with torch and transformers loaded) would overrun a short grace.
    """
    from deepinfer.entrypoints.data_parallel.launch import serve_data_parallel, start_joining
    from deepinfer.entrypoints.openai.args import server_settings
    from deepinfer.entrypoints.openai.server import build_app

    _check_args(args)
    _setup_logging(args.log_level)
    from deepinfer.entrypoints.model_host.launch import hosts_models, run_model_host
    from deepinfer.entrypoints.model_host.load_priority import restore_after_load

    if hosts_models(args):
        return run_model_host(args)
    frontend_status = serve_data_parallel(args)
    if frontend_status is not None:
        return frontend_status
    settings = server_settings(args)  # a malformed flag (--lora-modules, --priority-range) fails before the load
    engine = make_llm(args).engine
    fatal = FatalExit()
    app = build_app(engine, settings, on_fatal=fatal)
    app.state.server.engine_loop.stats_logger.interval_s = None if args.disable_log_stats else args.log_stats_interval
    limits = ConnectionLimits(args.timeout_keep_alive, args.timeout_request_header,
                              args.timeout_request_body, args.max_connections)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=shutdown_budget(args.shutdown_grace)[2],
                            timeout_keep_alive=limits.keep_alive_s,
                            http=functools.partial(TimedH11Protocol, limits=limits))
    print(f"deepinfer: serving {settings.model_name} (max_model_len {engine.max_model_len}) "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    fatal.server = GracefulServer(config, app.state.server.engine_loop, args.shutdown_grace)
    restore_after_load()  # a model host's child: back under SCHED_OTHER once loaded
    if args.data_parallel_address is not None:
        start_joining(args, args.port)
    fatal.server.run()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if fatal.error is None else FATAL_EXIT_STATUS)


def _setup_logging(level: str) -> None:
    """The server's lines and the engine's (the start-up summary, cache sizing) to stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    engine_logger = logging.getLogger("deepinfer")
    engine_logger.addHandler(handler)
    engine_logger.setLevel(level.upper())


def _check_args(args) -> None:
    for name, value in (("max_waiting", args.max_waiting), ("max_body_bytes", args.max_body_bytes),
                        ("port", args.port)):
        if value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.max_requests_per_client is not None and args.max_requests_per_client < 1:
        raise ValueError(f"--max-requests-per-client must be >= 1, got {args.max_requests_per_client}")
    for name, value in (("max_connections", args.max_connections), ("tokenizer_workers", args.tokenizer_workers)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name, value in (("timeout_keep_alive", args.timeout_keep_alive),
                        ("timeout_request_header", args.timeout_request_header),
                        ("timeout_request_body", args.timeout_request_body)):
        if not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.shutdown_grace < 0:
        raise ValueError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")


class FatalExit:
    """The engine loop's `on_fatal`: records the fault and shuts the server down (the process
    then exits with FATAL_EXIT_STATUS). Called once, on the engine thread."""

    def __init__(self):
        self.error: BaseException | None = None
        self.server: GracefulServer | None = None

    def __call__(self, exc: BaseException) -> None:
        self.error = exc
        logger.critical("the engine died of a fatal fault (%s); shutting down, exit status %d",
                        type(exc).__name__, FATAL_EXIT_STATUS)
        if self.server is not None:
            self.server.stop_soon()


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first signal drains the engine before uvicorn shuts down."""

    def __init__(self, config, engine_loop, grace_s: float):
        super().__init__(config)
        self.engine_loop, self.grace_s = engine_loop, grace_s
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._event_loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # listening: where the pages are (the port bound, when --port 0 chose one)
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
            print(f"deepinfer: chat page http://{host}:{port}/\ndeepinfer: dashboard http://{host}:{port}/dashboard",
                  flush=True)

    def stop_soon(self) -> None:
        """From any thread: refuse new requests and shut down now (no drain: the engine is gone)."""
        if self._event_loop is None:
            self.should_exit = True
            return
        with contextlib.suppress(RuntimeError):  # the event loop is closed: it is over anyway
            self._event_loop.call_soon_threadsafe(self._stop_now)

    def _stop_now(self) -> None:
        self.engine_loop.stop_accepting()
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        if self._drain_task is not None or self._event_loop is None:
            return super().handle_exit(sig, frame)  # second signal: uvicorn's own, faster exit
        self._event_loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        """503 for new requests; running ones may finish, then are aborted; then uvicorn stops."""
        self.engine_loop.stop_accepting()
        logger.info("shutting down: %d requests open, %.1f s grace", self.engine_loop.num_active,
                    self.grace_s)
        finish_s, abort_s, _ = shutdown_budget(self.grace_s)
        if not await self.engine_loop.wait_idle(finish_s):
            logger.info("aborting %d requests", self.engine_loop.num_active)
            self.engine_loop.abort_all()
            await self.engine_loop.wait_idle(abort_s)
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's signal capture, minus re-raising the signal afterwards: a drain exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
