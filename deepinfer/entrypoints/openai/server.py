"""The OpenAI-compatible HTTP server: app factory and routes.

    GET  /                       the chat page (static files under /static; its API calls carry the key)
    GET  /health                 200 while the engine runs and the server takes requests
    GET  /metrics                Prometheus text; GET /dashboard plots it live (dashboard.py)
    GET  /v1/models              the one served model (its served name, never a path)
    GET  /v1/models/{id}         that model's card (404 for another id)
    POST /v1/completions         text completion, whole or streamed (SSE)
    POST /v1/chat/completions    chat completion through the model's chat template, with tool calls
                                 and reasoning parsed out of the answer (chat_prompt.py, chat_output.py)
    POST /v1/responses           the Responses API over the same chat path, stored per tenant (responses.py;
                                 GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items)
    POST /v1/messages, /v1/messages/count_tokens   Anthropic's Messages API over the same chat path (messages.py)
    POST /tokenize, /detokenize  vLLM's tokenizer routes (tokenize_routes.py)
    POST /v1/embeddings          embeddings of one input or a batch (embeddings.py)
    GET  /api/version, /api/tags; POST /api/show, /api/chat, /api/generate, /api/embed, /api/embeddings
                                 Ollama's API over the same paths, NDJSON streams (ollama.py)
    POST /v1/rerank, /v1/score   rerank documents / score text pairs by embedding cosine (rerank.py;
                                 also /rerank, /v2/rerank and /score, as vLLM)
    POST /infill                 llama.cpp's code infill from the model's FIM tokens (infill.py, fim.py);
                                 /v1/completions takes `suffix` for the same
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   with --allow-runtime-lora-updating (lora_routes.py)

With --enable-lora, each LoRA adapter (--lora-modules name=path, or loaded at run time) is a model
of its own in /v1/models, chosen by a request's `model` field (lora_routes.py).

Every request lives the same life below HTTP (`deepinfer.serving`): its body parsed, bounded, in a
worker pool, never on the event loop (`serving.parse`); prepared there too (`serving.prepare`: the
prompt tokenized or chat-templated, sampling params checked, structured output compiled); admitted
(`serving.admission`: the waiting queue bounded by `max_waiting`, each client's seats, the priority
range); run by the one engine thread (`serving.engine_loop`) and encoded by its API's encoder through
one stream loop (`serving.run`). Each route module here is that API's thin layer: its bodies, its
answers and its error shape (`errors.py`).

Every route but /health, /metrics and the static pages checks the API key when keys are set
(`--api-key`, `--admin-api-key`; `auth.py`, `serving.tenancy`): the key is the tenant, whose stored
responses and dashboard views are its own. A generation body may carry `priority` (as vLLM: lower
first; within `--priority-range`, non-zero needs `--scheduling-policy priority`) and `cache_salt`
(only requests with an equal salt, and with API keys of the same tenant, share cached prefixes).
When the app's lifespan ends, the engine thread is stopped and then the engine closed (the KV
cache directory gets what it still lacks).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from deepinfer.entrypoints.openai.admission import ClientShares, scope_client
from deepinfer.entrypoints.openai.auth import api_key_dependency, tenant_of
from deepinfer.entrypoints.openai.body import BodySizeLimit, in_pool
from deepinfer.entrypoints.openai.dashboard import dashboard_routes
from deepinfer.entrypoints.openai.embeddings import embeddings_routes
from deepinfer.entrypoints.openai.errors import install_error_handlers
from deepinfer.entrypoints.openai.infill import infill_routes
from deepinfer.entrypoints.openai.lora_routes import adapter_card, lora_routes
from deepinfer.entrypoints.openai.messages import install_messages_api
from deepinfer.entrypoints.openai.ollama import install_ollama_api
from deepinfer.entrypoints.openai.openai_output import ChatFormatter, CompletionFormatter, OpenAIStream
from deepinfer.entrypoints.openai.rerank import rerank_routes
from deepinfer.entrypoints.openai.responses import responses_routes
from deepinfer.entrypoints.openai.tokenize_routes import model_card, tokenize_routes
from deepinfer.serving import run
from deepinfer.serving.chat.diagnostics import tool_call_summary
from deepinfer.serving.context import ServerSettings, ServingContext, sampling_defaults
from deepinfer.serving.metrics import ServerMetrics
from deepinfer.serving.parse import parse_body
from deepinfer.serving.prepare import Prepared, prepare_chat, prepare_completion
from deepinfer.serving.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["ServerSettings", "build_app", "sampling_defaults"]
logger = logging.getLogger("deepinfer.server")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(engine, settings: ServerSettings,
              on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; the engine thread runs while the app's lifespan does.
    `on_fatal(exc)` is called (on the engine thread) if the engine dies of a fatal fault."""
    state = ServingContext(engine, settings, ServerMetrics(), on_fatal)
    logger.info("%s", tool_call_summary(state.tokenizer, settings.tool_call_parser, state.chat_setup.tool_parser))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.engine_loop.stop)
            state.pool.shutdown()
            # once the engine thread is gone: save what the KV cache directory lacks (the launcher
            # ends the process with os._exit, so no atexit handler would)
            await asyncio.to_thread(state.engine_loop.close_engine)

    app = FastAPI(title="DeepInfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    client_of = functools.partial(scope_client, state.credentials, settings.data_parallel_secret)
    app.add_middleware(ClientShares, seats=state.seats, client_of=client_of,
                       accepting=lambda: state.engine_loop.accepting)
    install_error_handlers(app, on_error=lambda request, status: _count_error(state, request))
    _include_routes(app, state)
    return app


def _include_routes(app: FastAPI, state: ServingContext) -> None:
    keyed = [Depends(api_key_dependency(state.credentials))]
    app.include_router(_public_routes(state))
    for router in (_v1_routes(state), embeddings_routes(state), rerank_routes(state), infill_routes(state),
                   tokenize_routes(state), responses_routes(state)):
        app.include_router(router, dependencies=keyed)
    install_messages_api(app, state)
    install_ollama_api(app, state)
    if state.settings.allow_runtime_lora_updating:
        app.include_router(lora_routes(state), dependencies=[Depends(api_key_dependency(state.credentials,
                                                                                        admin_only=True))])
    app.include_router(_chat_page_route())
    app.include_router(dashboard_routes(state, api_key_dependency(state.credentials)))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


STATIC_DIR = Path(__file__).with_name("static")
# The page loads its own script and style only, and talks to this server only: an answer that
# somehow reached the DOM as HTML could neither run inline script nor send data elsewhere.
_CHAT_PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                  "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


def _chat_page_route() -> APIRouter:
    """GET /: the chat page. Public (it is static); its calls to /v1 send the key the user enters."""
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Content-Security-Policy": _CHAT_PAGE_CSP})

    return router


def _count_error(state: ServingContext, request: Request) -> None:
    if request.url.path in GENERATION_PATHS:
        state.metrics.record_error()


def _public_routes(state: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if not state.engine_loop.accepting:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    return router


def _v1_routes(state: ServingContext) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(state)] + [adapter_card(state, a) for a in state.adapters.all()]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        adapter = state.lora_request(model_id)
        return model_card(state) if adapter is None else adapter_card(state, adapter)

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        body, prepared = await in_pool(state, request, _prepare, CompletionRequest)
        return await _generate(state, request, body, prepared, CompletionFormatter, f"cmpl-{uuid.uuid4().hex}")

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body, prepared = await in_pool(state, request, _prepare, ChatCompletionRequest)
        formatter = functools.partial(ChatFormatter, plan=prepared.chat.plan)
        return await _generate(state, request, body, prepared, formatter, f"chatcmpl-{uuid.uuid4().hex}")

    return router


def _prepare(tokenizer, state: ServingContext, raw: bytes, kind: type) -> tuple:
    """On a pool thread: the body parsed and prepared (a completion or a chat)."""
    body = parse_body(raw, kind)
    prepare = prepare_chat if kind is ChatCompletionRequest else prepare_completion
    return body, prepare(tokenizer, state, body)


async def _generate(state: ServingContext, request: Request, body, prepared: Prepared, formatter_cls,
                    response_id: str) -> Response:
    """Admit the prepared request; answer whole or as an SSE stream."""
    handle = await run.admit(state, response_id, prepared, tenant_of(request))
    formatter = formatter_cls(response_id, state.response_model(body.model), state.tokenizer,
                              len(prepared.prompt_ids), prepared.params.logprobs)
    if body.stream:
        events = OpenAIStream(formatter, body.include_usage)
        return StreamingResponse(run.stream(state, handle, events), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    return JSONResponse(formatter.final(await run.whole(state, handle, request.is_disconnected)))
