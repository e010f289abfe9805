"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A request (`messages_protocol.py`) becomes a chat completion request and goes through the same
prompt, grammar and answer parsing as /v1/chat/completions (tool calls, the reasoning section);
the answer comes back as a message or its stream of events (`messages_output.py`).
count_tokens renders and tokenizes the same prompt: `{"input_tokens": N}`.

Auth: with an API key, a request sends it as `x-api-key: KEY` (what the `anthropic` client does)
or `Authorization: Bearer KEY`. Every error on these routes, wherever it is raised (the route,
auth, admission, the body limit), is answered in Anthropic's shape
`{"type": "error", "error": {"type", "message"}}` by the `AnthropicErrors` middleware; a
stream that fails after its start ends with an `error` event of that shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from deepinfer.entrypoints.openai.auth import api_key_dependency, client_id
from deepinfer.entrypoints.openai.body import parse_json, read_body
from deepinfer.entrypoints.openai.engine_loop import EngineClosedError
from deepinfer.entrypoints.openai.errors import (
    APIError,
    ReshapedErrors,
    bad_request,
    from_validation_errors,
    internal_error,
)
from deepinfer.entrypoints.openai.messages_output import MessageContext, MessageEvents, error_body, new_id
from deepinfer.entrypoints.openai.messages_protocol import CHAT_TO_MESSAGES, CountTokensRequest, MessagesRequest
from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest
from deepinfer.entrypoints.openai.serving import admit, engine_closed, final_output, request_failure
from deepinfer.entrypoints.openai.tools import FieldError

PREFIX = "/v1/messages"


def install_messages_api(app: FastAPI, state, prepare_chat_body: Callable) -> None:
    """Add the routes (behind the API key check) and the error middleware to `app`. Call it after the
    app's other middlewares are added, so that this one sees their errors too."""
    app.include_router(messages_routes(state, prepare_chat_body),
                       dependencies=[Depends(api_key_dependency(state.settings.api_key, x_api_key=True))])
    app.add_middleware(AnthropicErrors)


def messages_routes(state, prepare_chat_body: Callable) -> APIRouter:
    """The routes; `prepare_chat_body(tokenizer, state, ChatCompletionRequest)` -> (ChatPrompt,
    SamplingParams) is the chat path's preparation (run in the tokenizer pool)."""
    router = APIRouter(prefix="/v1")

    @router.post("/messages")
    async def create(request: Request) -> Response:
        state.check_capacity()
        raw = await read_body(request)
        body, chat, params = await state.pool.run(_prepare, state, prepare_chat_body, raw)
        lora_request = state.lora_request(body.model)
        ctx = MessageContext(new_id("msg"), state.response_model(body.model), len(chat.prompt_ids))
        handle = await admit(state.engine_loop, ctx.message_id, chat.prompt_ids, params, lora_request,
                             client_id(request, state.settings.api_key, None))
        if body.stream:
            return StreamingResponse(_stream(state, ctx, handle, MessageEvents(ctx, chat.plan.stream())),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = await final_output(state.engine_loop, request, handle, ctx.message_id)
        return JSONResponse(ctx.message(chat.plan.parse(out.outputs[0].text), out))

    @router.post("/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        state.check_capacity()
        raw = await read_body(request)
        return {"input_tokens": await state.pool.run(_count_tokens, state, raw)}

    return router


# -- on a TokenizerPool thread ------------------------------------------------------------------------


def _prepare(tokenizer, state, prepare_chat_body: Callable, raw: bytes):
    """The request, its chat prompt and its SamplingParams (400s in the Messages API's field names)."""
    body = MessagesRequest.model_validate(parse_json(raw))
    with _renamed_errors():
        return (body, *prepare_chat_body(tokenizer, state, ChatCompletionRequest.model_validate(body.chat_body())))


def _count_tokens(tokenizer, state, raw: bytes) -> int:
    body = CountTokensRequest.model_validate(parse_json(raw))
    with _renamed_errors():
        chat_body = ChatCompletionRequest.model_validate(body.chat_body())
        chat_body.check_supported()
        state.check_model(chat_body.model)
        return len(chat_body.chat_prompt(tokenizer, state.chat_setup).prompt_ids)


@contextmanager
def _renamed_errors():
    """The chat path's errors inside, as 400s that name the Messages API's fields."""
    try:
        yield
    except FieldError as exc:
        raise _renamed(bad_request(str(exc), exc.param)) from None
    except ValidationError as exc:
        raise _renamed(from_validation_errors(exc.errors())) from None
    except APIError as exc:
        raise _renamed(exc) from None


def _renamed(error: APIError) -> APIError:
    param, message = CHAT_TO_MESSAGES.get(error.param, error.param), error.message
    if param in ("tools", "tool_choice"):  # tools[0].function.parameters -> tools[0].input_schema
        message = message.replace(".function.parameters", ".input_schema").replace(".function.", ".")
    if param != error.param:
        message = message.replace(error.param, param, 1)
    if param and param not in message:  # Anthropic's error has no param: the message names the field
        message = f"{param}: {message}"
    error.message, error.param = message, param
    return error


# -- on the event loop --------------------------------------------------------------------------------


async def _stream(state, ctx: MessageContext, handle, events: MessageEvents) -> AsyncIterator[str]:
    """The SSE events; a failure after the start ends the stream with an `error` event."""
    try:
        for event in events.start():
            yield _sse(event)
        async for out in handle:
            failure = request_failure(out, ctx.message_id)
            if failure is not None:
                yield _sse(error_body(failure.status_code, failure.message))
                return
            for event in events.step(out):
                yield _sse(event)
            if out.finished:
                for event in events.finish(out):
                    yield _sse(event)
    except EngineClosedError as exc:
        error = engine_closed(exc, ctx.message_id, state.engine_loop)
        yield _sse(error_body(error.status_code, error.message))
    except Exception as exc:  # a bug while formatting: the client still gets an error event
        error = internal_error(exc, f"streaming {ctx.message_id}")
        yield _sse(error_body(error.status_code, error.message))
    finally:
        handle.abort()


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


# -- auth and errors ----------------------------------------------------------------------------------


class AnthropicErrors(ReshapedErrors):
    """ASGI middleware: an error answer on a /v1/messages route is sent in Anthropic's shape."""

    def __init__(self, app):
        super().__init__(app, PREFIX, error_body)
