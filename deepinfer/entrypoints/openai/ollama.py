"""Ollama's API over the OpenAI path, so that apps that speak only Ollama connect:

    GET  /api/version       {"version"}
    GET  /api/tags          the served model and its LoRA adapters (name:latest, size, digest, details)
    GET  /api/ps            the served model, loaded for good (its process's resident memory)
    POST /api/show          a model's details, parameters, chat template and capabilities
    POST /api/chat          chat through the model's chat template, tools and format included
    POST /api/generate      a prompt through the chat template, or raw (and with a suffix: FIM, if served)
    POST /api/embed         embeddings of a string or a list of them (`/api/embeddings` {prompt}: one)

A body (`ollama_protocol.py`) becomes a chat or completion request (or embedding inputs) and goes
through the same preparation, admission and run as the /v1 routes (`serving.prepare`, `serving.run`,
`serving.embeddings`); the answer comes back whole or as NDJSON lines (`stream` defaults to true, as
in Ollama; `ollama_output.py`).
A model is named by its served name or `name:latest`; another name is a 404 `model "x" not found,
try pulling it first`. Every error on /api, wherever it is raised (the route, auth, admission, the
body limit), is answered in Ollama's shape `{"error": "message"}` with Ollama's field names
(`errors.error_response`); a stream that fails after its start ends with such a line.
Auth: with an API key, `Authorization: Bearer KEY` as on /v1.
"""

from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer.contracts.pooling import PoolingParams
from deepinfer.entrypoints.openai.auth import api_key_dependency, tenant_of
from deepinfer.entrypoints.openai.body import in_pool, read_body
from deepinfer.entrypoints.openai.embeddings import embed, prepared_inputs
from deepinfer.entrypoints.openai.errors import ollama_error
from deepinfer.entrypoints.openai.ollama_output import (
    OLLAMA_VERSION,
    OllamaReply,
    adapter_card,
    base_card,
    loaded_reply,
    model_entry,
    ndjson,
    show_reply,
)
from deepinfer.entrypoints.openai.ollama_protocol import (
    ChatBody,
    EmbedBody,
    GenerateBody,
    LegacyEmbedBody,
    NameBody,
    ollama_names,
)
from deepinfer.serving import run
from deepinfer.serving.embeddings import input_ids, resolve_pooling
from deepinfer.serving.errors import named_by, not_found, same_names
from deepinfer.serving.parse import parse_body, validate
from deepinfer.serving.prepare import Prepared, prepare_chat, prepare_completion
from deepinfer.serving.protocol import CompletionRequest, chat_request

PREFIX = "/api"
NDJSON_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def install_ollama_api(app: FastAPI, state) -> None:
    """Add the routes, behind the key check."""
    app.include_router(ollama_routes(state), dependencies=[Depends(api_key_dependency(state.credentials))])


def ollama_routes(state) -> APIRouter:
    router = APIRouter(prefix=PREFIX)
    base = base_card(state.engine, state.settings.model_name)

    def cards() -> list[dict]:
        return [base] + [adapter_card(base, a.lora_name, a.lora_path) for a in state.adapters.all()]

    @router.get("/version")
    async def version() -> dict:
        return {"version": OLLAMA_VERSION}

    @router.get("/tags")
    async def tags() -> dict:
        return {"models": [model_entry(card["name"], card) for card in cards()]}

    @router.get("/ps")
    async def ps() -> dict:
        return {"models": [_loaded_entry(state, base)]}

    @router.post("/show")
    async def show(request: Request) -> dict:
        body = await state.pool.parse(await read_body(request), NameBody)
        with named_by(same_names):
            name = resolve_model(state, body.model_name())
        return _show(state, next(card for card in cards() if card["name"] == name))

    @router.post("/chat")
    async def chat(request: Request) -> Response:
        body, model, prepared = await in_pool(state, request, _prepare_chat)
        if prepared is None:
            return JSONResponse(loaded_reply(model, True))
        reply = OllamaReply(model, True, prepared.chat.plan, len(prepared.prompt_ids))
        return await _answer(state, request, body.stream, prepared, reply)

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        body, model, prepared = await in_pool(state, request, _prepare_generate)
        if prepared is None:
            return JSONResponse(loaded_reply(model, False))
        plan = prepared.chat.plan if prepared.chat is not None else None
        return await _answer(state, request, body.stream, prepared, OllamaReply(model, False, plan,
                                                                                len(prepared.prompt_ids)))

    @router.post("/embed")
    async def embed_route(request: Request) -> dict:
        body, prompts, params = await in_pool(state, request, _prepare_embed)
        outputs = await embed(state, request, f"embed-{uuid.uuid4().hex}", prompts, params,
                              [("input", i) for i in range(len(prompts))])
        return {"model": body.model, "embeddings": [out.outputs.embedding for out in outputs],
                "prompt_eval_count": sum(len(out.prompt_token_ids) for out in outputs)}

    @router.post("/embeddings")
    async def legacy_embeddings(request: Request) -> dict:
        _, prompts, params = await in_pool(state, request, _prepare_legacy_embed)
        outputs = await embed(state, request, f"embed-{uuid.uuid4().hex}", prompts, params, [("prompt",)])
        return {"embedding": outputs[0].outputs.embedding}

    return router


NEVER_EXPIRES = "2318-08-22T00:00:00Z"  # what Ollama reports for a model kept loaded (keep_alive -1)


def _loaded_entry(state, base: dict) -> dict:
    """/api/ps's entry for the served model, loaded for as long as the server runs (Ollama's "never"
    expiry), its size the process's resident memory."""
    return model_entry(base["name"], base) | {"size": _resident_bytes(), "size_vram": 0,
                                              "expires_at": NEVER_EXPIRES, "context_length": state.max_model_len}


def _resident_bytes() -> int:
    """This process's resident memory (the model's weights, KV cache and runtime), 0 when unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def resolve_model(state, name: str) -> str:
    """The served model (or adapter) `name` or `name:latest` stands for; Ollama's 404 otherwise."""
    served = {state.settings.model_name, *(a.lora_name for a in state.adapters.all())}
    for candidate in (name, name.removesuffix(":latest")):
        if candidate in served:
            return candidate
    error = not_found(f"model {json.dumps(name[:200])} not found, try pulling it first", "model",
                      code="model_not_found")
    error.names_field = False  # Ollama's own words
    raise error


def _show(state, card: dict) -> dict:
    setup, tokenizer = state.chat_setup, state.tokenizer
    template = (tokenizer.chat_template if tokenizer is not None else None) or ""
    capabilities = ["completion"] + (["tools"] if setup.tool_parser is not None else []) + (
        ["thinking"] if setup.reasoning is not None else [])
    if state.engine.pooling.serves:
        capabilities.append("embedding")  # it declares a pooling, or --pooling names one
    family = card["details"]["family"]
    model_info = {"general.architecture": family, "general.parameter_count": card["details"]["parameter_size"],
                  f"{family}.context_length": state.max_model_len, "general.vocab_size": state.vocab_size}
    return show_reply(card, template if isinstance(template, str) else "", capabilities,
                      dict(state.sampling_defaults), model_info)


# -- on a TokenizerPool thread ------------------------------------------------------------------------


def _prepare_chat(tokenizer, state, raw: bytes) -> tuple[ChatBody, str, Prepared | None]:
    """(body, model, its preparation on the chat path); None for a request without messages."""
    body = parse_body(raw, ChatBody)
    with named_by(same_names):  # Ollama's own fields
        model = resolve_model(state, body.model)
        chat_body = body.chat_body(model, state.chat_setup.reasoning is not None) if body.messages else None
    if chat_body is None:
        return body, model, None
    return body, model, prepare_chat(tokenizer, state, chat_request(chat_body))


def _prepare_generate(tokenizer, state, raw: bytes) -> tuple[GenerateBody, str, Prepared | None]:
    """(body, model, preparation): through the chat template, or raw on the completion path."""
    body = parse_body(raw, GenerateBody)
    with named_by(same_names):
        body.check_supported()
        model = resolve_model(state, body.model)
    if not body.prompt and not body.suffix:
        return body, model, None
    if body.templated:
        with named_by(same_names):
            chat_body = body.chat_body(model, state.chat_setup.reasoning is not None)
        return body, model, prepare_chat(tokenizer, state, chat_request(chat_body))
    with named_by(same_names):
        completion = body.completion_body(model)
    prepared = prepare_completion(tokenizer, state, validate(CompletionRequest, completion))
    if "max_tokens" not in completion:  # Ollama's default: up to the context (the completion path's: 16)
        prepared.params.max_tokens = state.max_model_len - len(prepared.prompt_ids)
    return body, model, prepared


def _embedding_model(state, name: str) -> str:
    """The served model `name` stands for, when it can embed (not an adapter)."""
    with named_by(same_names):
        model = resolve_model(state, name)
    state.base_model_only(model, "embeddings")
    return model


def _prepare_embed(tokenizer, state, raw: bytes):
    body = parse_body(raw, EmbedBody)
    _embedding_model(state, body.model)
    with named_by(same_names):
        inputs, params = body.inputs(), body.pooling_params()
    params = resolve_pooling(state, params)
    return body, prepared_inputs(tokenizer, state, inputs, params, "input"), params


def _prepare_legacy_embed(tokenizer, state, raw: bytes):
    body = parse_body(raw, LegacyEmbedBody)
    _embedding_model(state, body.model)
    params = resolve_pooling(state, PoolingParams())
    return body, [input_ids(tokenizer, state, body.prompt, params, ("prompt",))], params


# -- on the event loop --------------------------------------------------------------------------------


async def _answer(state, request: Request, stream: bool | None, prepared: Prepared, reply: OllamaReply) -> Response:
    handle = await run.admit(state, f"ollama-{uuid.uuid4().hex}", prepared, tenant_of(request))
    if stream is not False:
        lines = run.EventStream(reply, ndjson, lambda error: ollama_error(error.message(error.names or ollama_names)))
        return StreamingResponse(run.stream(state, handle, lines), media_type="application/x-ndjson",
                                 headers=NDJSON_HEADERS)
    out = await run.whole(state, handle, request.is_disconnected)
    return JSONResponse(reply.whole(out))
