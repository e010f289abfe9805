"""`POST /dp/register {rank, url}`: a replica says where it listens.

Who may (identity.py): a rank the front end started itself only its child (the per-run secret in
the child's environment); any other rank only a replica that sends the cluster secret. Without a
cluster secret the front end accepts no replica but its own children. An API key is no secret here:
a request without a secret the front end knows is refused (403) before its body is read.

The body is read under bounds, off the event loop, strictly:

    at most MAX_REGISTRATION_BYTES            413
    JSON under the server's rules              400 (serving.parse: depth, NaN/Infinity, 1e400, ...)
    {"rank": int, "url": str}, nothing else   400 naming the field and the value (pydantic, strict)
    rank within --data-parallel-size           400
    url scheme://host:port (replica_url)       400 naming url, its value escaped
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from deepinfer.entrypoints.data_parallel.identity import SECRET_HEADER, same_secret
from deepinfer.entrypoints.data_parallel.replicas import MAX_URL_CHARS, replica_url
from deepinfer.entrypoints.openai.body import body_too_large
from deepinfer.serving.errors import ServingError, bad_request
from deepinfer.serving.parse import parse_body

MAX_REGISTRATION_BYTES = 4096
CHILD, CLUSTER = "child", "cluster"  # which secret a registration carries


class Registration(BaseModel):
    """The body of /dp/register."""

    model_config = ConfigDict(extra="forbid", strict=True)

    rank: int = Field(ge=0)
    url: str = Field(min_length=1, max_length=MAX_URL_CHARS)


def registration_route(frontend) -> APIRouter:
    """The route, over `frontend` (its `replicas`, `child_secret` and `cluster_secret`)."""
    router = APIRouter()

    @router.post("/dp/register")
    async def register(request: Request) -> Response:
        kind = secret_kind(frontend, request.headers.getlist(SECRET_HEADER))
        if kind is None:
            raise ServingError(403, f"/dp/register: {no_secret_refusal(frontend)}", "permission_error",
                               code="dp_secret_required")
        raw = await bounded_body(request, MAX_REGISTRATION_BYTES)
        rank, url = await asyncio.to_thread(parse_registration, raw, frontend.replicas.size)
        refusal = registration_refusal(frontend, rank, kind)
        if refusal:
            raise ServingError(403, f"/dp/register: {refusal}", "permission_error", code="dp_rank_refused")
        frontend.replicas.register(rank, url)
        return JSONResponse({"status": "ok"})

    return router


def secret_kind(frontend, given: list[str]) -> str | None:
    """CHILD or CLUSTER for the one secret header a registration sends, else None. Both secrets are
    compared (in constant time), whichever matches."""
    if len(given) != 1:
        return None
    child, cluster = same_secret(given[0], frontend.child_secret), same_secret(given[0], frontend.cluster_secret)
    return CHILD if child else CLUSTER if cluster else None


def no_secret_refusal(frontend) -> str:
    """Why a registration without a secret this front end knows is refused."""
    if frontend.cluster_secret is None:
        return ("this front end has no --data-parallel-secret, so it accepts no replica but the ones it "
                "started itself; start it with --data-parallel-secret-file FILE and give every replica that "
                f"joins the same (it sends it in {SECRET_HEADER}; an API key is not a secret)")
    return (f"a replica joins with the cluster secret in {SECRET_HEADER} (--data-parallel-secret or "
            "--data-parallel-secret-file, the same as the front end's); an API key is not a secret")


def registration_refusal(frontend, rank: int, kind: str) -> str | None:
    """Why a rank may not be registered with this kind of secret, or None: a rank the front end started
    only by its child (CHILD), any other only with the cluster secret (CLUSTER)."""
    replica = frontend.replicas.replicas[rank]
    if replica.process is not None and kind != CHILD:
        return f"rank {rank} is a replica this front end started; only that process registers it"
    if replica.process is None and kind != CLUSTER:
        return f"rank {rank} is not a replica this front end started: it joins with the cluster secret"
    return None


async def bounded_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused (413) as soon as it passes `max_bytes`."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_registration(raw: bytes, size: int) -> tuple[int, str]:
    """(rank, url) of a registration body (see the module docstring); a ServingError 400 otherwise."""
    body = parse_body(raw, Registration)
    if body.rank >= size:
        raise bad_request(f"{body.rank} is outside --data-parallel-size {size} (ranks 0..{size - 1})", "rank")
    try:
        return body.rank, replica_url(body.url)
    except ValueError as exc:
        raise ServingError(400, str(exc), path="url", names_field=False) from None
