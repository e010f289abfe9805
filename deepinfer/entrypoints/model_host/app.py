"""The model host's HTTP app: every listed model on one address, each loaded on its first request.

    GET  /v1/models, /v1/models/{id}, /api/tags   every listed model (true file sizes, parameter counts)
    GET  /api/ps                                 the loaded models: size in memory, when each expires
    POST /api/show                               any listed model (its child's answer when loaded)
    POST /api/pull, DELETE /api/delete           `deepinfer pull` / `rm` (an operator key, when keys are set)
    POST the API routes of `deepinfer serve`      passed to the child serving the body's `model`
    GET  /, /dashboard, /metrics, /health        the chat page, the dashboard (?model=NAME), the host's
                                                 metrics and every loaded child's (labelled model=NAME)

A generation body is read whole (bounded by --max-body-bytes), parsed off the event loop (its JSON
depth bounded), and only its `model` and Ollama's `keep_alive` are read here: everything else is the
child's to check, so every API's validation and error shapes are the same as a one-model server's.
An unknown model is a 404 naming it; a body without `model` goes to the one listed model, if only one
is. An Ollama chat or generate without messages or prompt loads the model (and with `keep_alive: 0`
unloads it), as Ollama does. Stored responses (`/v1/responses/{id}`) live in the child that wrote
them: a GET or DELETE asks each loaded model in turn, and they end with their model's unloading.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deepinfer.entrypoints.data_parallel.proxy import ALLOWED_ROUTES
from deepinfer.entrypoints.model_host.host import ModelHost, forward, unloaded_reply
from deepinfer.entrypoints.model_host.host_routes import host_routes
from deepinfer.entrypoints.model_host.runners import keep_alive_seconds
from deepinfer.entrypoints.openai.auth import api_key_dependency
from deepinfer.entrypoints.openai.body import BodySizeLimit
from deepinfer.entrypoints.openai.errors import install_error_handlers
from deepinfer.json_bounds import MAX_JSON_DEPTH, json_depth
from deepinfer.serving.errors import ServingError, bad_request

logger = logging.getLogger("deepinfer.server")
_HOST_ROUTES = {"/v1/models", "/v1/models/{model_id:path}", "/api/tags", "/api/ps", "/api/show", "/api/version",
                "/", "/static/{file_path:path}", "/dashboard", "/dashboard/state",
                "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"}
PASSED_ROUTES = tuple((path, methods) for path, methods in ALLOWED_ROUTES if path not in _HOST_ROUTES)
_LOAD_ONLY = ("/api/chat", "/api/generate")


def build_host_app(host: ModelHost, max_body_bytes: int) -> FastAPI:
    app = FastAPI(title="DeepInfer", docs_url=None, redoc_url=None, lifespan=_lifespan(host))
    app.state.host = host
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    install_error_handlers(app)
    keyed = [Depends(api_key_dependency(host.credentials, x_api_key=True))]
    app.include_router(host_routes(host, keyed))
    app.include_router(_passed_routes(host), dependencies=keyed)
    return app


def _lifespan(host: ModelHost):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        reaper = asyncio.ensure_future(_reap(host))
        try:
            yield
        finally:
            reaper.cancel()
            await host.pool.stop_all()
            await host.client.aclose()

    return lifespan


async def _reap(host: ModelHost) -> None:
    while True:
        await asyncio.sleep(1.0)
        try:
            await host.pool.expire()
        except Exception:  # one bad round must not end the reaper
            logger.exception("the model reaper's round failed")


def _passed_routes(host: ModelHost) -> APIRouter:
    router = APIRouter()

    async def passed(request: Request) -> Response:
        raw = await request.body()
        fields = await asyncio.to_thread(_read_fields, raw, request.url.path)
        model = host.model(fields.get("model"))
        keep_alive = fields.get("keep_alive")
        if request.url.path in _LOAD_ONLY and fields.get("empty") and keep_alive == 0:
            await host.pool.unload(model.name, "keep_alive 0")
            return JSONResponse(unloaded_reply(model.name, request.url.path == "/api/chat"))
        return await forward(host, request, raw, model, keep_alive)

    for path, methods in PASSED_ROUTES:
        router.add_api_route(path, passed, methods=list(methods), include_in_schema=False)
    return router


def _read_fields(raw: bytes, path: str) -> dict:
    """A body's `model`, Ollama's `keep_alive` (seconds) and whether an Ollama chat / generate body
    asks for nothing but a load; a body that is not a bounded JSON object is the child's to refuse
    (only the model must be known: then it is the one listed model, or a 400)."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise bad_request(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    model = body.get("model")
    if model is None and path.startswith("/api/"):
        model = body.get("name")
    if model is not None and not isinstance(model, str):
        raise ServingError(400, f"must be a string, got {type(model).__name__}", path="model")
    fields = {"model": model, "empty": not body.get("messages") and not body.get("prompt") and not body.get("suffix")}
    if path.startswith("/api/") and body.get("keep_alive") is not None:
        try:
            fields["keep_alive"] = keep_alive_seconds(body["keep_alive"])
        except ValueError as exc:
            raise ServingError(400, str(exc), path="keep_alive", names_field=False) from None
    return fields


