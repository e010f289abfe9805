"""The API key check of the routes behind `--api-key`: one FastAPI dependency for every API.

    Authorization: Bearer KEY      OpenAI's routes, the tokenizer routes, Ollama's /api routes
    x-api-key: KEY (or Bearer)     Anthropic's /v1/messages routes (what the `anthropic` client sends)

Exactly one of each header may be sent (two are a 400); a missing key is a 401, a wrong one a 401
(compared in constant time with every accepted key). Several keys may be accepted (`--api-key` given
more than once, or comma-separated); each identifies a client for the scheduler's fair share
(`client_id`: a short hash of the key, never the key itself).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from fastapi import Request

from deepinfer.entrypoints.openai.errors import APIError, bad_request


def api_keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """The accepted keys of `--api-key`: one string, or several (each may be comma-separated);
    blanks dropped. Empty: no key is checked."""
    given = [api_key] if isinstance(api_key, str) else list(api_key or ())
    return tuple(dict.fromkeys(k.strip() for item in given for k in item.split(",") if k.strip()))


def client_id(request: Request, api_key: str | Sequence[str] | None, user: str | None) -> str | None:
    """Whom a request counts for in the scheduler's fair share: with API keys, the key it presented
    (a short hash of it); else the body's `user` (hashed as well, to bound its length); else None,
    the one anonymous client."""
    given = _given_key(request, ("x-api-key", "authorization")) if api_keys(api_key) else None
    if given:
        return "key:" + hashlib.sha256(given.encode()).hexdigest()[:16]
    if user:
        return "user:" + hashlib.sha256(user.encode()).hexdigest()[:16]
    return None


def api_key_dependency(api_key: str | Sequence[str] | None, x_api_key: bool = False):
    """A dependency: with API keys, the request must send one of them as a Bearer token (or, with
    `x_api_key`, as `x-api-key`); without any, anything goes."""
    keys = tuple(key.encode() for key in api_keys(api_key))
    names = ("x-api-key", "authorization") if x_api_key else ("authorization",)
    prefix = "x-api-key: " if x_api_key else ""
    ways = "`x-api-key: KEY` or `Authorization: Bearer KEY`" if x_api_key else "`Authorization: Bearer KEY`"
    wrong = "x-api-key: invalid API key" if x_api_key else "Incorrect API key provided"

    async def verify(request: Request) -> None:
        if not keys:
            return
        given = _given_key(request, names)
        if given is None:
            raise APIError(401, f"{prefix}You didn't provide an API key; send it as {ways}", code="invalid_api_key")
        if not sum(hmac.compare_digest(given.encode(), key) for key in keys):  # no early exit
            raise APIError(401, wrong, code="invalid_api_key")

    return verify


def _given_key(request: Request, names: tuple[str, ...]) -> str | None:
    """The key of the first of `names` the request sends (a Bearer token for `authorization`: any
    other scheme gives ""); None when it sends none; a 400 for a header given twice."""
    for name in names:
        values = request.headers.getlist(name)
        if len(values) > 1:
            shown = "Authorization" if name == "authorization" else name
            raise bad_request(f"the request has {len(values)} {shown} headers; send exactly one",
                              code="invalid_api_key")
        if values and values[0]:
            if name == "x-api-key":
                return values[0].strip()
            scheme, _, token = values[0].partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None
