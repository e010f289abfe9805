"""The last event of a stream whose replica failed mid-answer, in the API's own stream format.

A stream the front end relays can be cut by its replica (killed, stopped, silent past the read
timeout). The client then gets what the replica sent, and one error event in the format it was
reading, chosen by the answer's content type and the path:

    text/event-stream on /v1/messages     event: error / data: {"type": "error", "error": {type, message}}
    text/event-stream on /v1/responses    event: error / data: {"type": "error", "code", "message", ...}
    any other text/event-stream           data: {"error": {message, type, param, code}}, data: [DONE]
    application/x-ndjson (Ollama)         {"error": "message"}

Other answers (a whole JSON body cut short) get none: the connection is cut, as the replica's was.
A partial event or line already relayed is ended first, so the error event stands alone.
"""

from __future__ import annotations

import json
import re

_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')
_TAIL_BYTES = 64  # kept across chunks, for a sequence number cut in two


class StreamTail:
    """What a relayed stream's error event needs to know of it: its format, how its bytes ended, and
    (for the Responses API) the last sequence number sent."""

    def __init__(self, path: str, content_type: str):
        self.format = stream_format(path, content_type)
        self.tail = b""
        self.sequence = -1

    def seen(self, chunk: bytes) -> None:
        window = self.tail + chunk
        if self.format == "responses":
            self.sequence = max([self.sequence, *(int(m) for m in _SEQUENCE.findall(window))])
        self.tail = window[-_TAIL_BYTES:]

    def error_event(self, message: str) -> bytes | None:
        """The bytes that end the stream with `message`; None for an answer that is no stream."""
        if self.format is None:
            return None
        if self.format == "ndjson":
            return (b"" if self.tail.endswith(b"\n") or not self.tail else b"\n") + \
                (json.dumps({"error": message}) + "\n").encode()
        end = b"" if self.tail.endswith(b"\n\n") or not self.tail else b"\n" if self.tail.endswith(b"\n") else b"\n\n"
        return end + _sse_error(self.format, message, self.sequence + 1)


def stream_format(path: str, content_type: str) -> str | None:
    """"anthropic", "responses", "openai" (SSE), "ndjson", or None for an answer that is no stream."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "text/event-stream":
        if path.startswith("/v1/messages"):
            return "anthropic"
        return "responses" if path.startswith("/v1/responses") else "openai"
    return "ndjson" if media == "application/x-ndjson" else None


def _sse_error(kind: str, message: str, sequence: int) -> bytes:
    if kind == "anthropic":
        return _event("error", {"type": "error", "error": {"type": "api_error", "message": message}})
    if kind == "responses":
        return _event("error", {"type": "error", "sequence_number": sequence, "code": "replica_failed",
                                "message": message, "param": None})
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
