"""The routes a model host answers itself: listings, /api/ps, /api/show, pull and delete, its pages and
metrics, and the stored-response routes that ask each loaded model (see `app.py`)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from deepinfer.entrypoints.data_parallel.metrics import merged_text, replica_families
from deepinfer.entrypoints.model_host.catalog import HostedModel
from deepinfer.entrypoints.model_host.host import ModelHost, forward, model_card, ollama_card
from deepinfer.entrypoints.model_host.host_metrics import HostMetrics
from deepinfer.entrypoints.model_host.pulls import delete_model, pull_lines
from deepinfer.entrypoints.openai.auth import api_key_dependency
from deepinfer.entrypoints.openai.dashboard import STATIC_DIR, page_headers
from deepinfer.entrypoints.openai.ollama import NEVER_EXPIRES
from deepinfer.entrypoints.openai.ollama_output import OLLAMA_VERSION, model_entry, show_reply
from deepinfer.serving.errors import ServingError, bad_request

MAX_NAME_CHARS = 512


def host_routes(host: ModelHost, keyed: list) -> APIRouter:
    router = APIRouter()
    router.include_router(_public_routes(host))
    router.include_router(_listing_routes(host), dependencies=keyed)
    admin = [Depends(api_key_dependency(host.credentials, admin_only=True))]
    router.include_router(_admin_routes(host), dependencies=admin)
    router.include_router(_response_routes(host), dependencies=keyed)
    return router


def _public_routes(host: ModelHost) -> APIRouter:
    router = APIRouter()
    metrics = HostMetrics(host.pool)

    @router.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @router.get("/metrics")
    async def metrics_route() -> Response:
        texts = await _children_metrics(host)
        families, _ = replica_families(texts, label="model")
        return Response(merged_text(metrics.registry(), families), media_type=metrics.content_type)

    @router.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers=page_headers())

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return FileResponse(STATIC_DIR / "dashboard.html", headers=page_headers())

    router.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return router


async def _children_metrics(host: ModelHost) -> dict[str, str]:
    async def one(runner) -> tuple[str, str | None]:
        try:
            answer = await host.pool.client.get(f"{runner.url}/metrics")
            return runner.name, answer.text if answer.status_code == 200 else None
        except Exception:  # a child going away meanwhile: its samples are left out
            return runner.name, None

    found = await asyncio.gather(*(one(r) for r in host.pool.loaded() if r.ready.is_set()))
    return {name: text for name, text in found if text is not None}


def _listing_routes(host: ModelHost) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict:
        cards = await asyncio.to_thread(lambda: [model_card(host, m) for m in host.catalog.all()])
        return {"object": "list", "data": cards}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        found = host.model(model_id[:MAX_NAME_CHARS])
        return await asyncio.to_thread(model_card, host, found)

    @router.get("/api/version")
    async def version() -> dict:
        return {"version": OLLAMA_VERSION}

    @router.get("/api/tags")
    async def tags() -> dict:
        cards = await asyncio.to_thread(lambda: [ollama_card(host, m) for m in host.catalog.all()])
        return {"models": [model_entry(card["name"], card) for card in cards]}

    @router.get("/api/ps")
    async def ps() -> dict:
        return {"models": await asyncio.to_thread(_loaded_entries, host)}

    @router.post("/api/show")
    async def show(request: Request) -> Response:
        raw = await request.body()
        found = host.model(await asyncio.to_thread(_name_field, raw))
        runner = host.pool.runners.get(found.name)
        if runner is not None and runner.loaded:
            return await forward(host, request, raw, found)
        return JSONResponse(await asyncio.to_thread(_show_unloaded, host, found))

    @router.get("/dashboard/state")
    async def dashboard_state(request: Request) -> Response:
        name = request.query_params.get("model")
        loaded = [r for r in host.pool.loaded() if r.ready.is_set()]
        if name is None and loaded:
            name = min(loaded, key=lambda r: r.name).name
        if name is None:
            raise ServingError(404, "no model is loaded: send it a request first", path="model")
        runner = host.pool.runners.get(host.model(name[:MAX_NAME_CHARS]).name)
        if runner is None or not runner.loaded:
            raise ServingError(404, f"model {name[:200]!r} is not loaded: send it a request first", path="model")
        return await forward(host, request, b"", host.model(name), touch=False)

    return router


def _loaded_entries(host: ModelHost) -> list[dict]:
    entries = []
    for runner in host.pool.loaded():
        model = host.catalog.find(runner.name)
        if model is None or not runner.ready.is_set():
            continue
        card = ollama_card(host, model)
        entry = model_entry(card["name"], card)
        expires = runner.expires_at if runner.in_flight == 0 else float("inf")
        entry |= {"size": runner.memory(), "size_vram": 0, "expires_at": _expiry_text(expires)}
        if host.catalog.facts(model).context_length:
            entry["context_length"] = host.catalog.facts(model).context_length
        entries.append(entry)
    return entries


def _expiry_text(monotonic_at: float) -> str:
    if monotonic_at == float("inf"):
        return NEVER_EXPIRES
    wall = time.time() + max(0.0, monotonic_at - time.monotonic())
    return datetime.fromtimestamp(wall, UTC).isoformat().replace("+00:00", "Z")


def _name_field(raw: bytes) -> str:
    """The `model` (or `name`) of a small Ollama body such as /api/show's."""
    try:
        body = json.loads(raw) if raw.strip() else None
    except ValueError as exc:
        raise bad_request(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object with `model`")
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise ServingError(400, f"is required (a string), got {name!r}"[:200], path="model")
    return name[:MAX_NAME_CHARS]


def _show_unloaded(host: ModelHost, model: HostedModel) -> dict:
    """/api/show of a model that is not loaded: what its files say."""
    card = ollama_card(host, model)
    facts = host.catalog.facts(model)
    capabilities = ["completion"] + (["tools"] if "tools" in facts.chat_template else []) + (
        ["embedding"] if facts.pooling else [])
    info = {"general.architecture": facts.family, "general.parameter_count": facts.parameter_count}
    if facts.context_length:
        info[f"{facts.family}.context_length"] = facts.context_length
    return show_reply(card, facts.chat_template, capabilities, {}, info)


def _admin_routes(host: ModelHost) -> APIRouter:
    router = APIRouter()

    @router.post("/api/pull")
    async def pull(request: Request) -> Response:
        raw = await request.body()
        name = await asyncio.to_thread(_name_field, raw)
        stream = await asyncio.to_thread(lambda: json.loads(raw).get("stream", True) is not False)
        lines = pull_lines(host, name)
        if stream:
            return StreamingResponse(lines, media_type="application/x-ndjson")
        last = None
        async for line in lines:
            last = json.loads(line)
        status = 200 if last and last.get("status") == "success" else 500
        return JSONResponse(last or {}, status_code=status)

    @router.delete("/api/delete")
    async def delete(request: Request) -> Response:
        name = await asyncio.to_thread(_name_field, await request.body())
        found = host.model(name)
        await host.pool.unload(found.name, "deleted")
        await asyncio.to_thread(delete_model, host, found)
        return Response(status_code=200)

    return router


def _response_routes(host: ModelHost) -> APIRouter:
    """GET / DELETE /v1/responses/{id} (and its input items): the first loaded model that has it."""
    router = APIRouter()

    async def stored(request: Request, response_id: str) -> Response:
        for runner in [r for r in host.pool.loaded() if r.ready.is_set()]:
            model = host.catalog.find(runner.name)
            if model is None:
                continue
            answer = await forward(host, request, b"", model, touch=False)
            if answer.status_code != 404:
                return answer
            await _drain(answer)
        raise ServingError(404, f"no stored response {response_id[:100]!r} (stored responses live as long as "
                                "their model stays loaded)", path="response_id")

    router.add_api_route("/v1/responses/{response_id}", stored, methods=["GET", "DELETE"], include_in_schema=False)
    router.add_api_route("/v1/responses/{response_id}/input_items", stored, methods=["GET"], include_in_schema=False)
    return router


async def _drain(answer: StreamingResponse) -> None:
    async for _ in answer.body_iterator:
        pass

