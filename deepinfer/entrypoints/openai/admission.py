"""Admission over HTTP: each client's seats (`deepinfer.serving.admission.ClientSeats`), taken before
a request's body is read and given back once its answer, a stream included, is sent."""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers

from deepinfer.entrypoints.openai.errors import error_response
from deepinfer.serving.admission import ClientSeats, client_key
from deepinfer.serving.errors import ServingError
from deepinfer.serving.tenancy import Credentials

ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
                            "/tokenize", "/detokenize", "/v1/messages", "/v1/messages/count_tokens",
                            "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score", "/infill",
                            "/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show"})


def scope_client(credentials: Credentials, secret: str | None, scope) -> str:
    """The client a server's request counts for (`serving.admission.client_key`)."""
    peer = scope.get("client")
    return client_key(Headers(scope=scope).getlist, peer[0] if peer else None, credentials, secret)


class ClientShares:
    """ASGI middleware: a POST to an admitted path takes a seat of its client (`client_of(scope)`) for
    its whole life (a 429 in the API's shape when the client has none left, unless the server is
    shutting down: the route's 503 goes first). The client is also left in the scope
    (`deepinfer.client`) for the routes that take more seats (embeddings windows)."""

    def __init__(self, app, seats: ClientSeats, client_of: Callable[[dict], str],
                 accepting: Callable[[], bool] = lambda: True):
        self.app, self.seats, self.client_of, self.accepting = app, seats, client_of, accepting

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in ADMITTED_PATHS:
            return await self.app(scope, receive, send)
        client = self.client_of(scope)
        try:
            if self.accepting():
                self.seats.take(client)
            else:
                client = None  # shutting down: the route answers 503 and nothing is counted
        except ServingError as error:
            return await error_response(error, scope["path"])(scope, receive, send)
        scope["deepinfer.client"] = client
        try:
            await self.app(scope, receive, send)
        finally:
            if client is not None:
                self.seats.give_back(client)
