"""Bounds on the connections of `deepinfer serve` (and of a data-parallel front end): deadlines on
reading a request, per phase, and a cap on open connections (`TimedH11Protocol`)."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from deepinfer.entrypoints.openai.errors import error_response
from deepinfer.serving.errors import ServingError, service_unavailable

logger = logging.getLogger("deepinfer.server")


@dataclass(frozen=True)
class ConnectionLimits:
    """Deadlines for reading a request, per phase (seconds), and the most open connections."""

    keep_alive_s: float = 5.0
    header_s: float = 10.0
    body_s: float = 60.0
    max_connections: int = 512

    def timeout(self, phase: str) -> float:
        return {"idle": self.keep_alive_s, "head": self.header_s, "body": self.body_s}[phase]


_PHASE_NAMES = {"head": "request headers", "body": "request body"}


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on reading a request, and a cap on connections.

        phase                                deadline        then
        no request under way, nothing read   keep_alive_s    close
        part of a request head is in         header_s        408, close
        the head is in, not all of the body  body_s          408 (unless a response started), close

    A deadline runs from the start of its phase and more bytes do not extend it, so a client
    that trickles a byte at a time is closed too. Once the whole request is in, no deadline
    applies (generating the answer may take long). A connection over `max_connections` gets a
    503 for its first request and is closed.
    """

    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._phase: str | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            logger.warning("%d connections are open (limit %d): refusing one", len(self.connections),
                           self.limits.max_connections)
            self.app = _over_capacity
        self._update_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    def _reading_phase(self) -> str | None:
        """What the connection waits for from the client: 'idle', 'head', 'body' or None."""
        if self.transport.is_closing():
            return None
        state = self.conn.their_state
        if state is h11.IDLE:
            return "head" if self.conn.trailing_data[0] else "idle"
        return "body" if state is h11.SEND_BODY else None

    def _update_deadline(self) -> None:
        phase = self._reading_phase()
        if phase != self._phase:
            self._set_phase(phase)

    def _set_phase(self, phase: str | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            self._deadline = self.loop.call_later(self.limits.timeout(phase), self._expire, phase)

    def _expire(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        started = self.cycle is not None and self.cycle.response_started
        if phase == "head" or (phase == "body" and not started):
            self.transport.write(_timeout_response(phase, self.limits.timeout(phase)))
        self.transport.close()  # connection_lost tells a request still reading that the client left


def _timeout_response(phase: str, timeout_s: float) -> bytes:
    error = ServingError(408, f"the {_PHASE_NAMES[phase]} did not arrive within {timeout_s:g} s",
                         code="request_timeout")
    body = json.dumps(error.to_dict()).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


async def _over_capacity(scope, receive, send) -> None:
    error = service_unavailable("the server has too many open connections; retry later", retry_after_s=1)
    error.headers["Connection"] = "close"
    await error_response(error, scope.get("path", ""))(scope, receive, send)
