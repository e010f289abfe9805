"""POST /v1/responses (and GET /v1/responses/{id}): the Responses API over the chat path.

A request (`responses_protocol.py`) becomes a chat completion request (its input and, with
`previous_response_id`, the stored conversation before it) and goes through the same prompt,
grammar and answer parsing as /v1/chat/completions; the answer comes back as a response object
or its stream of events (`responses_output.py`).

Stored responses: unless `store` is false, a finished response and its conversation are kept in
memory, in an LRU of at most MAX_STORED_RESPONSES responses and MAX_STORED_CHARS characters of
JSON (the least recently used go first; a restart forgets them all). An unknown (or forgotten)
`previous_response_id` is a 400 with code `previous_response_not_found`, as OpenAI answers.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from deepinfer.entrypoints.openai.auth import client_id
from deepinfer.entrypoints.openai.body import parse_json, read_body
from deepinfer.entrypoints.openai.engine_loop import EngineClosedError
from deepinfer.entrypoints.openai.errors import APIError, bad_request, from_validation_errors, internal_error
from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest
from deepinfer.entrypoints.openai.responses_output import (
    ResponseContext,
    ResponseEvents,
    assistant_message,
    new_id,
    output_items,
    reasoning_text,
    status_of,
    usage,
)
from deepinfer.entrypoints.openai.responses_protocol import CHAT_TO_RESPONSES, ResponsesRequest
from deepinfer.entrypoints.openai.serving import admit, engine_closed, final_output, request_failure
from deepinfer.entrypoints.openai.tools import FieldError

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 << 20


class ResponseStore:
    """Finished responses and their conversations, by id: an LRU bounded in count and characters.
    Thread-safe (read in the tokenizer pool, written on the event loop)."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        with self._lock:
            self._entries[response["id"]] = (response, conversation, size)
            self._chars += size
            while self._entries and (len(self._entries) > self.max_responses or self._chars > self.max_chars):
                self._chars -= self._entries.popitem(last=False)[1][2]

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
            return entry[0], entry[1]


def responses_routes(state, prepare_chat_body: Callable) -> APIRouter:
    """The routes; `prepare_chat_body(tokenizer, state, ChatCompletionRequest)` -> (ChatPrompt,
    SamplingParams) is the chat path's preparation (run in the tokenizer pool)."""
    router = APIRouter(prefix="/v1")
    store = ResponseStore()

    @router.post("/responses")
    async def create(request: Request) -> Response:
        state.check_capacity()
        raw = await read_body(request)
        body, history, chat, params = await state.pool.run(_prepare, state, store, prepare_chat_body, raw)
        lora_request = state.lora_request(body.model)
        ctx = ResponseContext(new_id("resp"), _model_name(state, lora_request), body, params.temperature,
                              params.top_p)
        handle = await admit(state.engine_loop, ctx.response_id, chat.prompt_ids, params, lora_request,
                             client_id(request, state.settings.api_key, body.user))
        conversation = body.conversation_messages(history)
        if body.stream:
            events = _stream(state, store, ctx, handle, chat.plan.stream(), conversation)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = await final_output(state.engine_loop, request, handle, ctx.response_id)
        items = output_items(chat.plan.parse(out.outputs[0].text), status_of(out))
        response = ctx.envelope(status_of(out), items, usage(out, _count(state, reasoning_text(items))))
        _keep(store, body, response, conversation, items)
        return JSONResponse(response)

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str) -> dict:
        found = store.get(response_id)
        if found is None:
            raise APIError(404, f"Response with id {response_id!r} not found.", "invalid_request_error",
                           param="response_id", code="response_not_found")
        return found[0]

    return router


def _prepare(tokenizer, state, store: ResponseStore, prepare_chat_body: Callable, raw: bytes):
    """On a pool thread: the request, the stored conversation it continues, its chat prompt and params."""
    body = ResponsesRequest.model_validate(parse_json(raw))
    try:
        body.check_supported()
        history = _history(store, body.previous_response_id)
        chat_body = ChatCompletionRequest.model_validate(body.chat_body(history))
        return (body, history, *prepare_chat_body(tokenizer, state, chat_body))
    except FieldError as exc:
        raise bad_request(str(exc), exc.param) from None
    except ValidationError as exc:
        raise _renamed(from_validation_errors(exc.errors())) from None
    except APIError as exc:
        raise _renamed(exc) from None


def _model_name(state, lora_request) -> str:
    """The name a response reports: the adapter's when it runs with one, else the served base name."""
    return state.settings.model_name if lora_request is None else lora_request.lora_name


def _history(store: ResponseStore, previous_response_id: str | None) -> list[dict]:
    if previous_response_id is None:
        return []
    found = store.get(previous_response_id)
    if found is None:
        raise APIError(400, f"Previous response with id {previous_response_id!r} not found.",
                       param="previous_response_id", code="previous_response_not_found")
    return found[1]


def _renamed(error: APIError) -> APIError:
    """A chat path's error in the Responses API's field names."""
    param = CHAT_TO_RESPONSES.get(error.param, error.param)
    if param != error.param:
        error.message = error.message.replace(error.param, param, 1)
        error.param = param
    return error


def _keep(store: ResponseStore, body: ResponsesRequest, response: dict, conversation: list[dict],
          items: list[dict]) -> None:
    if body.store is not False:
        store.put(response, conversation + [assistant_message(items)])


def _count(state, text: str) -> int:
    return len(state.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


async def _stream(state, store: ResponseStore, ctx: ResponseContext, handle, choice_stream,
                  conversation: list[dict]) -> AsyncIterator[str]:
    """The SSE events; an error (the request failed, the engine stopped) ends the stream with an
    `error` event."""
    events = ResponseEvents(ctx, choice_stream)
    try:
        for event in events.start():
            yield _sse(event)
        async for out in handle:
            failure = request_failure(out, ctx.response_id)
            if failure is not None:
                yield _sse(_error_event(events, failure))
                return
            for event in events.step(out):
                yield _sse(event)
            if out.finished:
                closing, response = events.finish(out, lambda text: _count(state, text))
                for event in closing:
                    yield _sse(event)
                _keep(store, ctx.body, response, conversation, response["output"])
    except EngineClosedError as exc:
        yield _sse(_error_event(events, engine_closed(exc, ctx.response_id, state.engine_loop)))
    except Exception as exc:  # a bug while formatting: the client still gets an error event
        yield _sse(_error_event(events, internal_error(exc, f"streaming {ctx.response_id}")))
    finally:
        handle.abort()


def _error_event(events: ResponseEvents, error: APIError) -> dict:
    return events.event("error", code=error.code, message=error.message, param=error.param)


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
