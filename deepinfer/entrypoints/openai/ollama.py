"""Ollama's API over the OpenAI path, so that apps that speak only Ollama connect:

    GET  /api/version       {"version"}
    GET  /api/tags          the served model and its LoRA adapters (name:latest, size, digest, details)
    POST /api/show          a model's details, parameters, chat template and capabilities
    POST /api/chat          chat through the model's chat template, tools and format included
    POST /api/generate      a prompt through the chat template, or raw (and with a suffix: FIM, if served)
    POST /api/embed         embeddings of a string or a list of them (`/api/embeddings` {prompt}: one)

A body (`ollama_protocol.py`) becomes a chat, completion or embeddings request and goes through the
same preparation (in the tokenizer pool), admission and engine loop as the /v1 routes; the answer
comes back whole or as NDJSON lines (`stream` defaults to true, as in Ollama; `ollama_output.py`).
A model is named by its served name or `name:latest`; another name is a 404 `model "x" not found,
try pulling it first`. Every error on /api, wherever it is raised (the route, auth, admission, the
body limit), is answered in Ollama's shape `{"error": "message"}` by the `OllamaErrors`
middleware, its message naming the field; a stream that fails after its start ends with such a line.
Auth: with an API key, `Authorization: Bearer KEY` as on /v1.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from deepinfer.engine.pooling import DEFAULT_SOURCE
from deepinfer.entrypoints.openai import embeddings
from deepinfer.entrypoints.openai.auth import client_id
from deepinfer.entrypoints.openai.body import parse_json, read_body
from deepinfer.entrypoints.openai.engine_loop import EngineClosedError
from deepinfer.entrypoints.openai.errors import (
    APIError,
    ReshapedErrors,
    bad_request,
    from_validation_errors,
    internal_error,
)
from deepinfer.entrypoints.openai.ollama_output import (
    OLLAMA_VERSION,
    OllamaReply,
    adapter_card,
    base_card,
    error_line,
    loaded_reply,
    model_entry,
    ndjson,
    show_reply,
)
from deepinfer.entrypoints.openai.ollama_protocol import (
    OLLAMA_NAMES,
    ChatBody,
    EmbedBody,
    GenerateBody,
    LegacyEmbedBody,
    NameBody,
)
from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest
from deepinfer.entrypoints.openai.serving import admit, engine_closed, final_output, request_failure
from deepinfer.entrypoints.openai.tools import FieldError

PREFIX = "/api"


def install_ollama_api(app: FastAPI, state, prepare_chat_body: Callable, prepare_completion: Callable,
                       auth: Callable) -> None:
    """Add the routes (behind the `auth` dependency) and the error middleware to `app`; call it after
    the app's other middlewares are added. `prepare_chat_body(tokenizer, state, ChatCompletionRequest)`
    and `prepare_completion(tokenizer, state, raw)` are the chat and completion paths' preparations."""
    app.include_router(ollama_routes(state, prepare_chat_body, prepare_completion), dependencies=[Depends(auth)])
    app.add_middleware(OllamaErrors)


def ollama_routes(state, prepare_chat_body: Callable, prepare_completion: Callable) -> APIRouter:
    router = APIRouter(prefix=PREFIX)
    base = base_card(state.engine_loop.engine, state.settings.model_name)

    def cards() -> list[dict]:
        return [base] + [adapter_card(base, a.lora_name, a.lora_path) for a in state.adapters.all()]

    @router.get("/version")
    async def version() -> dict:
        return {"version": OLLAMA_VERSION}

    @router.get("/tags")
    async def tags() -> dict:
        return {"models": [model_entry(card["name"], card) for card in cards()]}

    @router.post("/show")
    async def show(request: Request) -> dict:
        body = NameBody.model_validate(parse_json(await read_body(request)))
        with _renamed_errors():
            name = resolve_model(state, body.model_name())
        card = next(card for card in cards() if card["name"] == name)
        return _show(state, card)

    @router.post("/chat")
    async def chat(request: Request) -> Response:
        state.check_capacity()
        raw = await read_body(request)
        body, model, chat, params = await state.pool.run(_prepare_chat, state, prepare_chat_body, raw)
        if chat is None:
            return JSONResponse(loaded_reply(model, True))
        reply = OllamaReply(model, True, chat.plan, len(chat.prompt_ids))
        return await _answer(state, request, body.stream, model, chat.prompt_ids, params, reply)

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        state.check_capacity()
        raw = await read_body(request)
        body, model, prompt_ids, params, plan = await state.pool.run(
            _prepare_generate, state, prepare_chat_body, prepare_completion, raw)
        if prompt_ids is None:
            return JSONResponse(loaded_reply(model, False))
        reply = OllamaReply(model, False, plan, len(prompt_ids))
        return await _answer(state, request, body.stream, model, prompt_ids, params, reply)

    @router.post("/embed")
    async def embed(request: Request) -> dict:
        body = EmbedBody.model_validate(parse_json(await read_body(request)))
        with _renamed_errors():
            found = await _embeddings(state, request, body.embeddings_body(resolve_model(state, body.model)))
        return {"model": body.model, "embeddings": [item["embedding"] for item in found["data"]],
                "prompt_eval_count": found["usage"]["prompt_tokens"]}

    @router.post("/embeddings")
    async def legacy_embeddings(request: Request) -> dict:
        body = LegacyEmbedBody.model_validate(parse_json(await read_body(request)))
        with _renamed_errors():
            found = await _embeddings(state, request, {"model": resolve_model(state, body.model), "input": body.prompt})
        return {"embedding": found["data"][0]["embedding"]}

    return router


def resolve_model(state, name: str) -> str:
    """The served model (or adapter) `name` or `name:latest` stands for; Ollama's 404 otherwise."""
    served = {state.settings.model_name, *(a.lora_name for a in state.adapters.all())}
    for candidate in (name, name.removesuffix(":latest")):
        if candidate in served:
            return candidate
    raise APIError(404, f"model {json.dumps(name)} not found, try pulling it first", "not_found_error",
                   param="model", code="model_not_found")


def _show(state, card: dict) -> dict:
    setup, tokenizer = state.chat_setup, state.tokenizer
    template = (tokenizer.chat_template if tokenizer is not None else None) or ""
    capabilities = ["completion"] + (["tools"] if setup.tool_parser is not None else []) + (
        ["thinking"] if setup.reasoning is not None else [])
    if state.engine_loop.engine.pooling.source != DEFAULT_SOURCE:
        capabilities.append("embedding")  # a sentence-transformers checkpoint
    family = card["details"]["family"]
    model_info = {"general.architecture": family, "general.parameter_count": card["details"]["parameter_size"],
                  f"{family}.context_length": state.max_model_len, "general.vocab_size": state.vocab_size}
    return show_reply(card, template if isinstance(template, str) else "", capabilities,
                      dict(state.sampling_defaults), model_info)


# -- on a TokenizerPool thread ------------------------------------------------------------------------


def _prepare_chat(tokenizer, state, prepare_chat_body: Callable, raw: bytes):
    """(body, model, ChatPrompt, SamplingParams); no prompt for a request without messages."""
    body = ChatBody.model_validate(parse_json(raw))
    with _renamed_errors():
        model = resolve_model(state, body.model)
        if not body.messages:
            return body, model, None, None
        chat_body = ChatCompletionRequest.model_validate(body.chat_body(model, state.chat_setup.reasoning is not None))
        return (body, model, *prepare_chat_body(tokenizer, state, chat_body))


def _prepare_generate(tokenizer, state, prepare_chat_body: Callable, prepare_completion: Callable, raw: bytes):
    """(body, model, prompt ids, SamplingParams, reading plan): through the chat template, or raw."""
    body = GenerateBody.model_validate(parse_json(raw))
    with _renamed_errors():
        body.check_supported()
        model = resolve_model(state, body.model)
        if not body.prompt and not body.suffix:
            return body, model, None, None, None
        if body.templated:
            thinking = state.chat_setup.reasoning is not None
            chat, params = prepare_chat_body(tokenizer, state,
                                             ChatCompletionRequest.model_validate(body.chat_body(model, thinking)))
            return body, model, chat.prompt_ids, params, chat.plan
        completion = body.completion_body(model)
        _, prompt_ids, params = prepare_completion(tokenizer, state, json.dumps(completion).encode())
        if "max_tokens" not in completion:  # Ollama's default: up to the context (the completion path's: 16)
            params.max_tokens = state.max_model_len - len(prompt_ids)
        return body, model, prompt_ids, params, None


@contextmanager
def _renamed_errors():
    """The OpenAI path's errors inside, as errors naming Ollama's fields."""
    try:
        yield
    except FieldError as exc:
        raise _renamed(bad_request(str(exc), exc.param)) from None
    except ValidationError as exc:
        raise _renamed(from_validation_errors(exc.errors())) from None
    except APIError as exc:
        raise _renamed(exc) from None


def _renamed(error: APIError) -> APIError:
    old = error.param or ""
    param = OLLAMA_NAMES.get(old, old)
    message = error.message.replace(old, param, 1) if old and param != old else error.message
    if param and param not in message:  # Ollama's error is a message only: it names the field
        message = f"{param}: {message}"
    error.message, error.param = message, param or None
    return error


# -- on the event loop --------------------------------------------------------------------------------


async def _answer(state, request: Request, stream: bool | None, model: str, prompt_ids: list[int], params,
                  reply: OllamaReply) -> Response:
    request_id = f"ollama-{uuid.uuid4().hex}"
    handle = await admit(state.engine_loop, request_id, prompt_ids, params, state.lora_request(model),
                         client_id(request, state.settings.api_key, None))
    if stream is not False:
        return StreamingResponse(_lines(state, reply, handle, request_id), media_type="application/x-ndjson",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    out = await final_output(state.engine_loop, request, handle, request_id)
    return JSONResponse(reply.whole(out))


async def _lines(state, reply: OllamaReply, handle, request_id: str) -> AsyncIterator[str]:
    """The NDJSON lines; a failure after the start ends the stream with an error line."""
    try:
        async for out in handle:
            failure = request_failure(out, request_id)
            if failure is not None:
                yield ndjson(error_line(failure.message))
                return
            for line in reply.step(out):
                yield ndjson(line)
    except EngineClosedError as exc:
        yield ndjson(error_line(engine_closed(exc, request_id, state.engine_loop).message))
    except Exception as exc:  # a bug while formatting: the client still gets an error line
        yield ndjson(error_line(internal_error(exc, f"streaming {request_id}").message))
    finally:
        handle.abort()


async def _embeddings(state, request: Request, openai_body: dict) -> dict:
    """The /v1/embeddings answer (as a dict) of an OpenAI embeddings body: the same preparation,
    windows and failures (embeddings.py)."""
    state.check_capacity()
    raw = json.dumps(openai_body).encode()
    body, prompts, params = await state.pool.run(embeddings._prepare, state, raw)
    return json.loads((await embeddings._embed(state, request, body, prompts, params)).body)


# -- errors -------------------------------------------------------------------------------------------


class OllamaErrors(ReshapedErrors):
    """ASGI middleware: an error answer on an /api route is sent in Ollama's shape `{"error": "message"}`."""

    def __init__(self, app):
        super().__init__(app, PREFIX, lambda status, message: error_line(message))
