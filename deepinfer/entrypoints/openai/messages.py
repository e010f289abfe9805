"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A request (`messages_protocol.py`) becomes a chat completion request and goes through the same
preparation as /v1/chat/completions (`serving.prepare`: prompt, grammar, tool calls, the reasoning
section), admission and run (`serving.run`); the answer comes back as a message or its stream of
events (`messages_output.py`). count_tokens renders and tokenizes the same prompt:
`{"input_tokens": N}`.

Auth: with an API key, a request sends it as `x-api-key: KEY` (what the `anthropic` client sends)
or `Authorization: Bearer KEY`. Every error on these routes, wherever it is raised (the route,
auth, admission, the body limit), is answered in Anthropic's shape
`{"type": "error", "error": {"type", "message"}}` with the Messages API's field names
(`errors.error_response`); a stream that fails after its start ends with an `error` event.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer.entrypoints.openai.auth import api_key_dependency, tenant_of
from deepinfer.entrypoints.openai.body import in_pool
from deepinfer.entrypoints.openai.errors import anthropic_error
from deepinfer.entrypoints.openai.messages_output import MessageContext, MessageEvents, new_id
from deepinfer.entrypoints.openai.messages_protocol import CountTokensRequest, MessagesRequest, messages_names
from deepinfer.serving import run
from deepinfer.serving.errors import named_by, same_names
from deepinfer.serving.parse import parse_body
from deepinfer.serving.prepare import Prepared, prepare_chat
from deepinfer.serving.protocol import ChatCompletionRequest
from deepinfer.serving.protocol import chat_request as chat_request_of

PREFIX = "/v1/messages"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def install_messages_api(app: FastAPI, state) -> None:
    """Add the routes, behind the key check (which takes `x-api-key` here too)."""
    app.include_router(messages_routes(state),
                       dependencies=[Depends(api_key_dependency(state.credentials, x_api_key=True))])


def messages_routes(state) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/messages")
    async def create(request: Request) -> Response:
        body, prepared = await in_pool(state, request, _prepare)
        ctx = MessageContext(new_id("msg"), state.response_model(body.model), len(prepared.prompt_ids))
        handle = await run.admit(state, ctx.message_id, prepared, tenant_of(request))
        if body.stream:
            events = run.EventStream(MessageEvents(ctx, prepared.chat.plan.stream()), _sse, _error_event)
            return StreamingResponse(run.stream(state, handle, events), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        out = await run.whole(state, handle, request.is_disconnected)
        return JSONResponse(ctx.message(prepared.chat.plan.read(out.outputs[0]), out))

    @router.post("/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        return {"input_tokens": await in_pool(state, request, _count_tokens)}

    return router


# -- on a TokenizerPool thread ------------------------------------------------------------------------


def _prepare(tokenizer, state, raw: bytes) -> tuple[MessagesRequest, Prepared]:
    """The request and its preparation on the chat path."""
    body = parse_body(raw, MessagesRequest)
    return body, prepare_chat(tokenizer, state, chat_request(body))


def _count_tokens(tokenizer, state, raw: bytes) -> int:
    chat_body = chat_request(parse_body(raw, CountTokensRequest))
    chat_body.check_supported()
    state.check_model(chat_body.model)
    return len(chat_body.chat_prompt(tokenizer, state.chat_setup).prompt_ids)


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages body is; its own refusals keep the Messages API's names."""
    with named_by(same_names):  # already in the Messages API's names
        chat_body = body.chat_body()
    return chat_request_of(chat_body)


# -- on the event loop --------------------------------------------------------------------------------


def _error_event(error) -> dict:
    return anthropic_error(error.status_code, error.message(error.names or messages_names))


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
