"""`deepinfer serve`: the engine behind uvicorn, with a graceful shutdown.

On the first SIGINT or SIGTERM the server keeps listening but answers new requests with 503,
lets running requests finish for most of `--shutdown-grace` seconds, aborts what is left, and
then lets uvicorn close the connections; the process exits 0. A second signal stops at once.
Its flags live in `args.py`, which the CLI imports without uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading

import uvicorn

from deepinfer.entrypoints.engine_args import make_llm

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
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
    """Load the engine, serve until a signal, drain, and end the process with status 0.

    The process ends through `os._exit` once uvicorn has shut down: the interpreter's own
    teardown (over a second with torch and transformers loaded) would overrun a short grace.
    """
    from deepinfer.entrypoints.openai.server import ServerSettings, build_app

    _check_args(args)
    _setup_logging(args.log_level)
    engine = make_llm(args).engine
    settings = ServerSettings(model_name=args.served_model_name or args.model or DEFAULT_MODEL_NAME,
                              api_key=args.api_key, max_waiting=args.max_waiting,
                              max_body_bytes=args.max_body_bytes)
    app = build_app(engine, settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=shutdown_budget(args.shutdown_grace)[2])
    print(f"deepinfer: serving {settings.model_name} (max_model_len {engine.max_model_len}) "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    GracefulServer(config, app.state.server.engine_loop, args.shutdown_grace).run()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def _check_args(args) -> None:
    for name in ("max_waiting", "max_body_bytes", "port"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.shutdown_grace < 0:
        raise ValueError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")


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
