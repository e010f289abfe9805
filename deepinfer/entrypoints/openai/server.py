"""The OpenAI-compatible HTTP server: app factory and routes.

    GET  /                       the chat page (static files under /static; its API calls carry the key)
    GET  /health                 200 while the engine runs and the server takes requests
    GET  /metrics                Prometheus text; GET /dashboard plots it live (dashboard.py)
    GET  /v1/models              the one served model (its served name, never a path)
    GET  /v1/models/{id}         that model's card (404 for another id)
    POST /v1/completions         text completion, whole or streamed (SSE)
    POST /v1/chat/completions    chat completion through the model's chat template, with tool calls
                                 and reasoning parsed out of the answer (chat_prompt.py, chat_output.py)
    POST /v1/responses           the Responses API over the same chat path (responses.py)
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

Every /v1 (and /api) route checks `Authorization: Bearer KEY` when an API key is set (exactly one such
header; /v1/messages also takes `x-api-key: KEY`). Admission is by work (admission.py): each client
(its peer address) has at most `max_requests_per_client` requests in flight, and the
one over it gets the 429; the waiting
queue (engine and tokenizer pool together) is bounded by `max_waiting` for generation, embeddings
and the tokenizer routes alike; a text prompt whose characters cannot fit the context in tokens is
a 400 before it is tokenized. A request's body is parsed, validated and tokenized (or
chat-templated) in a worker pool (tokenizer_pool.py), never on the event loop, so `/health` and
streams stay responsive while a large prompt is tokenized; bodies over 1 MiB go to a lane of their
own, so they never hold the workers small requests need. There too, before admission, its sampling params
are built and checked (every per-request list within its limit), its bad words tokenized and its
structured output compiled completely (`GrammarCompiler`, within llguidance's limits and a time
budget): whatever llguidance refuses is a 400 naming the param. The token ids and the prepared
params (with the compiled grammar, which the worker copies) then go to the engine thread, which
compiles and tokenizes nothing of them again.

A generation body may carry `priority` (as vLLM: lower first; non-zero needs `--scheduling-policy
priority`, else a 400) and `cache_salt` (a string, as in vLLM): only requests with an equal
salt share cached prefixes; `usage.prompt_tokens_details.cached_tokens` reports the prompt
tokens found cached. When the app's lifespan ends, the engine thread is stopped and then the
engine closed (the KV cache directory gets what it still lacks).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from deepinfer.entrypoints.openai.admission import ClientShares, PromptBounds
from deepinfer.entrypoints.openai.auth import api_key_dependency, client_id
from deepinfer.entrypoints.openai.body import BodySizeLimit, parse_json, read_body
from deepinfer.entrypoints.openai.chat_prompt import ChatPrompt, ChatSetup
from deepinfer.entrypoints.openai.dashboard import dashboard_routes
from deepinfer.entrypoints.openai.diagnostics import forced_call_error, tool_call_summary
from deepinfer.entrypoints.openai.embeddings import embeddings_routes
from deepinfer.entrypoints.openai.engine_loop import EngineClosedError, EngineLoop
from deepinfer.entrypoints.openai.errors import (
    APIError,
    bad_request,
    context_length_exceeded,
    from_value_error,
    install_error_handlers,
    service_unavailable,
)
from deepinfer.entrypoints.openai.fim import completion_fim_prompt
from deepinfer.entrypoints.openai.infill import infill_routes
from deepinfer.entrypoints.openai.lora_routes import ServedAdapters, adapter_card, lora_routes, model_not_found
from deepinfer.entrypoints.openai.messages import install_messages_api
from deepinfer.entrypoints.openai.metrics import ServerMetrics
from deepinfer.entrypoints.openai.ollama import install_ollama_api
from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, structured_output_error
from deepinfer.entrypoints.openai.reasoning import make_reasoning_parser
from deepinfer.entrypoints.openai.rerank import rerank_routes
from deepinfer.entrypoints.openai.responses import responses_routes
from deepinfer.entrypoints.openai.serving import (
    ChatFormatter,
    CompletionFormatter,
    abort_on_disconnect,
    collect,
    engine_closed,
    stream_events,
)
from deepinfer.entrypoints.openai.tokenize_routes import model_card, tokenize_routes
from deepinfer.entrypoints.openai.tokenizer_pool import TokenizerPool
from deepinfer.entrypoints.openai.tool_parsers import make_tool_parser
from deepinfer.sampling_params import SamplingParams, check_token_ids_in_vocab, model_sampling_defaults
from deepinfer.structured_output import GrammarCompiler

logger = logging.getLogger("deepinfer.server")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_PARAM_FIELDS = frozenset(SamplingParams().__dict__) | {"prompt", "cache_salt", "priority"}


@dataclass
class ServerSettings:
    """What `deepinfer serve` adds to the engine's own configuration."""

    model_name: str
    api_key: str | None = None  # accepted keys, comma-separated (None: no key checked)
    max_waiting: int = 256  # waiting requests above this get a 429
    max_body_bytes: int = 8 << 20
    retry_after_s: int = 1
    tokenizer_workers: int = 2  # threads that parse, tokenize and chat-template request bodies
    max_requests_per_client: int | None = None  # in flight per client; None: max_num_seqs + max_waiting // 2
    tool_call_parser: str = "auto"  # the tool-call format (tool_parsers: auto = the chat template's)
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3: <think> sections -> reasoning_content
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) of the LoRA adapters served from the start
    allow_runtime_lora_updating: bool = False  # the load / unload adapter routes
    lora_dirs: tuple[str, ...] = ()  # the only directories the load route reads adapters from


class ServerState:
    """Everything a route needs: the engine loop, tokenizers of its own, settings, metrics."""

    def __init__(self, engine, settings: ServerSettings, metrics: ServerMetrics,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.settings, self.metrics = settings, metrics
        self.engine_loop = EngineLoop(engine, metrics, on_fatal=on_fatal)
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # the engine thread keeps the original
        self.pool = TokenizerPool(self.tokenizer, max(1, settings.tokenizer_workers),
                                  retry_after_s=settings.retry_after_s)
        self.max_model_len = engine.max_model_len
        self.bounds = PromptBounds(self.tokenizer, self.max_model_len)
        self.max_requests_per_client = settings.max_requests_per_client or (
            engine.config.scheduler.max_num_seqs + max(1, settings.max_waiting // 2))
        self.vocab_size = engine.source.hf_config.vocab_size
        # compiles structured output in the pool threads, with a tokenizer copy of its own
        self.grammars = GrammarCompiler(copy.deepcopy(engine.tokenizer), self.vocab_size, engine.eos_token_ids)
        self.sampling_defaults = sampling_defaults(engine.source)
        self.created = int(time.time())
        self.chat_setup = ChatSetup(make_tool_parser(settings.tool_call_parser, self.tokenizer),
                                    make_reasoning_parser(settings.reasoning_parser, self.tokenizer))
        self.adapters = ServedAdapters(settings.model_name, engine.adapters, settings.lora_dirs)
        for name, path in settings.lora_modules:  # a bad adapter stops the start-up, naming it
            self.adapters.add(name, path)

    def check_capacity(self) -> None:
        """503 while shutting down, 429 while the waiting queue (incl. requests being tokenized) is full."""
        if not self.engine_loop.accepting:
            raise service_unavailable("the server is shutting down or its engine stopped; retry later")
        waiting, limit = self.engine_loop.num_waiting + self.pool.pending, self.settings.max_waiting
        if waiting >= limit:
            raise APIError(429, f"the server is busy: {waiting} requests are waiting (limit "
                           f"{limit}); retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.settings.retry_after_s)})

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name and self.adapters.get(model) is None:
            if self.adapters.all():
                raise model_not_found(model, self.settings.model_name)
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.settings.model_name}`", param="model", code="model_not_found")

    def lora_request(self, model: str | None):
        """The LoRARequest of the adapter `model` names (None: the base model); 404 for an unknown name."""
        self.check_model(model)
        return self.adapters.get(model)

    def response_model(self, model: str | None) -> str:
        """The model name an answer reports: the adapter's, else the served base name."""
        return model if self.adapters.get(model) is not None else self.settings.model_name


def build_app(engine, settings: ServerSettings,
              on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; the engine thread runs while the app's lifespan does.
    `on_fatal(exc)` is called (on the engine thread) if the engine dies of a fatal fault."""
    state = ServerState(engine, settings, ServerMetrics(), on_fatal)
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
    app.add_middleware(ClientShares, limit=state.max_requests_per_client,
                       retry_after_s=settings.retry_after_s, accepting=lambda: state.engine_loop.accepting)
    install_error_handlers(app, on_error=lambda request, status: _count_error(state, request))
    app.include_router(_public_routes(state))
    app.include_router(_v1_routes(state), dependencies=[Depends(api_key_dependency(settings.api_key))])
    app.include_router(embeddings_routes(state), dependencies=[Depends(api_key_dependency(settings.api_key))])
    app.include_router(rerank_routes(state), dependencies=[Depends(api_key_dependency(settings.api_key))])
    app.include_router(infill_routes(state), dependencies=[Depends(api_key_dependency(settings.api_key))])
    app.include_router(tokenize_routes(state), dependencies=[Depends(api_key_dependency(settings.api_key))])
    app.include_router(responses_routes(state, prepare_chat_body),
                       dependencies=[Depends(api_key_dependency(settings.api_key))])
    install_messages_api(app, state, prepare_chat_body)  # after the middlewares: it reshapes their errors too
    install_ollama_api(app, state, prepare_chat_body, _prepare_completion, api_key_dependency(settings.api_key))
    if settings.allow_runtime_lora_updating:
        app.include_router(lora_routes(state), dependencies=[Depends(api_key_dependency(settings.api_key))])
    app.include_router(_chat_page_route())
    app.include_router(dashboard_routes(state, api_key_dependency(settings.api_key)))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


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


def _count_error(state: ServerState, request: Request) -> None:
    if request.url.path in GENERATION_PATHS:
        state.metrics.record_error()


def _public_routes(state: ServerState) -> APIRouter:
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


def _v1_routes(state: ServerState) -> APIRouter:
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
        state.check_capacity()
        raw = await read_body(request)
        body, prompt_ids, params = await state.pool.run(_prepare_completion, state, raw)
        return await _generate(state, request, body, prompt_ids, params,
                               CompletionFormatter, f"cmpl-{uuid.uuid4().hex}")

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        state.check_capacity()
        raw = await read_body(request)
        body, chat, params = await state.pool.run(_prepare_chat, state, raw)
        return await _generate(state, request, body, chat.prompt_ids, params,
                               functools.partial(ChatFormatter, plan=chat.plan), f"chatcmpl-{uuid.uuid4().hex}")

    return router


# -- on a TokenizerPool thread: parse, validate, tokenize ---------------------------------------------


def _prepare_completion(tokenizer, state: ServerState, raw: bytes
                        ) -> tuple[CompletionRequest, list[int], SamplingParams]:
    body, prompt_ids = _completion_prompt(tokenizer, state, raw)
    return body, prompt_ids, _prepared_params(tokenizer, state, body, prompt_ids, "prompt")


def _completion_prompt(tokenizer, state: ServerState, raw: bytes) -> tuple[CompletionRequest, list[int]]:
    body = CompletionRequest.model_validate(parse_json(raw))
    body.check_supported()
    state.check_model(body.model)
    prompt = body.prompt_input()
    if body.suffix:  # fill-in-the-middle: the prompt is the text before the cursor
        return body, completion_fim_prompt(tokenizer, state, prompt, body.suffix)
    if isinstance(prompt, list):
        return body, prompt
    if tokenizer is None:
        raise bad_request("this model ships no tokenizer; send the prompt as a list of token ids", "prompt")
    state.bounds.check_text(prompt, "prompt")  # before tokenizing: a text that cannot fit is refused at once
    return body, list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def _prepare_chat(tokenizer, state: ServerState, raw: bytes
                  ) -> tuple[ChatCompletionRequest, ChatPrompt, SamplingParams]:
    body = ChatCompletionRequest.model_validate(parse_json(raw))
    return body, *prepare_chat_body(tokenizer, state, body)


def prepare_chat_body(tokenizer, state: ServerState, body: ChatCompletionRequest) -> tuple[ChatPrompt, SamplingParams]:
    """A parsed chat request's prompt and reading plan, and its SamplingParams ready for admission."""
    body.check_supported()
    state.check_model(body.model)
    chat = body.chat_prompt(tokenizer, state.chat_setup)
    return chat, _prepared_params(tokenizer, state, body, chat.prompt_ids, "messages", chat)


def _prepared_params(tokenizer, state: ServerState, body, prompt_ids: list[int], param: str,
                     chat: ChatPrompt | None = None) -> SamplingParams:
    """The request's SamplingParams, ready for admission: checked, bad words tokenized, structured
    output compiled (a 400 naming the param for anything refused). A chat's grammar (a forced tool
    call, or the structured output after the reasoning section) replaces the body's."""
    params = _sampling_params(state, body, len(prompt_ids), param)
    try:
        if chat is not None:  # checked again with the chat's grammar (min_tokens cannot go with one)
            params.structured_output = chat.structured_output or params.structured_output
            params.skip_special_tokens = not chat.keep_special_tokens
            params.validate()
        params.set_bad_words_tokens(tokenizer)
    except ValueError as exc:
        raise from_value_error(exc, _PARAM_FIELDS) from exc
    if params.structured_output is not None:
        try:
            state.grammars.prepare(params.structured_output, params.first_banned_token_ids())
        except ValueError as exc:
            if chat is not None and chat.forced_call:
                raise forced_call_error(state.grammars, chat.tools, chat.plan.tool_parser, exc) from None
            raise structured_output_error(body, exc) from None
    return params


def sampling_defaults(source) -> dict:
    """What a request's unset sampling fields take: the checkpoint's generation config (as vLLM's
    `--generation-config auto`), else FALLBACK_SAMPLING, as everywhere (`model_sampling_defaults`).
    max_new_tokens is left out: an unset max_tokens runs to the context. ValueError naming the
    file's bad value at start-up."""
    defaults = model_sampling_defaults(source.generation_config)
    defaults.pop("max_tokens", None)
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"generation config of {source.path!r}: {exc}") from None
    return defaults


def _sampling_params(state: ServerState, body, num_prompt_tokens: int, param: str) -> SamplingParams:
    """SamplingParams with max_tokens checked against the context (400 when it cannot fit)."""
    limit, requested = state.max_model_len, body.requested_max_tokens()
    if num_prompt_tokens >= limit:
        raise context_length_exceeded(num_prompt_tokens, limit, param)
    if requested is not None and num_prompt_tokens + requested > limit:
        raise context_length_exceeded(num_prompt_tokens, limit, param, requested)
    if requested is None:
        requested = 16 if isinstance(body, CompletionRequest) else limit - num_prompt_tokens
    try:
        params = SamplingParams(**{**state.sampling_defaults, **body.sampling_kwargs(requested)})
        check_token_ids_in_vocab(params, state.vocab_size)
        return params
    except ValueError as exc:
        raise from_value_error(exc, _PARAM_FIELDS) from exc


async def _generate(state: ServerState, request: Request, body, prompt_ids: list[int], params: SamplingParams,
                    formatter_cls, response_id: str) -> Response:
    """Hand the request (prepared in the pool) to the engine thread; answer whole or as an SSE stream."""
    arrival = time.monotonic()
    lora = state.lora_request(body.model)  # 404 when the adapter was unloaded meanwhile
    try:
        scheduling = {"priority": body.priority, "client_id": client_id(request, state.settings.api_key, body.user)}
        handle = await state.engine_loop.add(response_id, prompt_ids, params, arrival, body.cache_salt, lora,
                                             **{k: v for k, v in scheduling.items() if v})
    except ValueError as exc:
        raise from_value_error(exc, _PARAM_FIELDS) from exc
    except EngineClosedError as exc:
        raise engine_closed(exc, response_id, state.engine_loop) from None
    formatter = formatter_cls(response_id, state.response_model(body.model), state.tokenizer,
                              len(prompt_ids), params.logprobs)
    if body.stream:
        return StreamingResponse(stream_events(handle, formatter, body.include_usage, state.engine_loop),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(abort_on_disconnect(request, handle))
    try:
        return JSONResponse(await collect(handle, formatter, state.engine_loop))
    finally:
        watcher.cancel()
        handle.abort()  # a no-op when finished
