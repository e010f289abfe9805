"""The API key check of the routes behind `--api-key`: one FastAPI dependency for every API.

    Authorization: Bearer KEY      OpenAI's routes, the tokenizer routes, Ollama's /api routes
    x-api-key: KEY (or Bearer)     Anthropic's /v1/messages routes (what the `anthropic` client sends)

Exactly one of each header may be sent (two are a 400); a missing key is a 401, a wrong one a 401
(compared in constant time).
"""

from __future__ import annotations

import hmac

from fastapi import Request

from deepinfer.entrypoints.openai.errors import APIError, bad_request


def api_key_dependency(api_key: str | None, x_api_key: bool = False):
    """A dependency: with an API key, the request must send it as a Bearer token (or, with
    `x_api_key`, as `x-api-key`); without one, anything goes."""
    names = ("x-api-key", "authorization") if x_api_key else ("authorization",)
    prefix = "x-api-key: " if x_api_key else ""
    ways = "`x-api-key: KEY` or `Authorization: Bearer KEY`" if x_api_key else "`Authorization: Bearer KEY`"
    wrong = "x-api-key: invalid API key" if x_api_key else "Incorrect API key provided"

    async def verify(request: Request) -> None:
        if api_key is None:
            return
        given = _given_key(request, names)
        if given is None:
            raise APIError(401, f"{prefix}You didn't provide an API key; send it as {ways}", code="invalid_api_key")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
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
