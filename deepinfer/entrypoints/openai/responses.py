"""The Responses API over the chat path, its stored responses kept per tenant.

    POST   /v1/responses                        create (whole or streamed)
    GET    /v1/responses/{id}                   a stored response
    GET    /v1/responses/{id}/input_items       its input items (OpenAI's list: limit, order, after)
    DELETE /v1/responses/{id}                   forget it

A request (`responses_protocol.py`) becomes a chat completion request (its input and, with
`previous_response_id`, the stored conversation before it) and goes through the same preparation,
admission and run as /v1/chat/completions (`serving.prepare`, `serving.run`); the answer comes back
as a response object or its stream of events (`responses_output.py`).

Stored responses (`serving.store`): unless `store` is false, a finished response is kept for the
tenant (API key) that made it. Another tenant's response answers as an unknown one does: a 404
`response_not_found` on the GET and DELETE routes, a 400 `previous_response_not_found` as a
`previous_response_id` (as OpenAI answers both); an operator key (`--admin-api-key`) sees all.
"""

from __future__ import annotations

import json
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer.entrypoints.openai.auth import tenant_of
from deepinfer.entrypoints.openai.body import in_pool
from deepinfer.entrypoints.openai.responses_output import (
    ResponseContext,
    ResponseEvents,
    assistant_message,
    input_items,
    new_id,
    output_items,
    reasoning_text,
    status_of,
    usage,
)
from deepinfer.entrypoints.openai.responses_protocol import ResponsesRequest, responses_names
from deepinfer.serving import run
from deepinfer.serving.errors import ServingError, named_by, not_found, same_names
from deepinfer.serving.parse import parse_body
from deepinfer.serving.prepare import Prepared, prepare_chat
from deepinfer.serving.protocol import chat_request
from deepinfer.serving.store import StoredResponse
from deepinfer.serving.tenancy import Tenant

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def responses_routes(state) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/responses")
    async def create(request: Request) -> Response:
        tenant = tenant_of(request)
        body, history, prepared = await in_pool(state, request, _prepare, tenant)
        lora_request = state.lora_request(body.model)
        model = state.settings.model_name if lora_request is None else lora_request.lora_name
        ctx = ResponseContext(new_id("resp"), model, body, prepared.params.temperature, prepared.params.top_p)
        handle = await run.admit(state, ctx.response_id, prepared, tenant)
        keep = _keeper(state, tenant, body, body.conversation_messages(history))
        if body.stream:
            events = ResponseEvents(ctx, prepared.chat.plan.stream(), lambda text: _count(state, text), keep)
            return StreamingResponse(run.stream(state, handle, run.EventStream(events, _sse, _error_event(events))),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        out = await run.whole(state, handle, request.is_disconnected)
        items = output_items(prepared.chat.plan.read(out.outputs[0]), status_of(out))
        response = ctx.envelope(status_of(out), items, usage(out, _count(state, reasoning_text(items))))
        keep(response)
        return JSONResponse(response)

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> dict:
        return _stored(state, tenant_of(request), response_id).response

    @router.get("/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc", after: str | None = None) -> dict:
        items = list(_stored(state, tenant_of(request), response_id).input_items)
        return _page(items[::-1] if order == "desc" else items, limit, after)

    @router.delete("/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> dict:
        if not state.responses.delete(tenant_of(request), response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


def _stored(state, tenant: Tenant, response_id: str) -> StoredResponse:
    found = state.responses.get(tenant, response_id)
    if found is None:
        raise _not_found(response_id)
    return found


def _not_found(response_id: str) -> ServingError:
    return not_found(f"Response with id {json.dumps(response_id[:200])} not found.", "response_id",
                     code="response_not_found")


def _page(items: list[dict], limit: int, after: str | None) -> dict:
    """OpenAI's list of `items` (in their order): `limit` of them, after the item `after`."""
    if after is not None:
        ids = [item.get("id") for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None, "has_more": len(items) > limit}


# -- on a TokenizerPool thread ------------------------------------------------------------------------


def _prepare(tokenizer, state, raw: bytes, tenant: Tenant) -> tuple[ResponsesRequest, list[dict], Prepared]:
    """The request, the stored conversation it continues (the tenant's own), and its preparation."""
    body = parse_body(raw, ResponsesRequest)
    with named_by(same_names):  # already in the Responses API's names
        body.check_supported()
        history = _history(state, tenant, body.previous_response_id)
        chat_body = body.chat_body(history)
    with named_by(responses_names((1 if body.instructions else 0) + len(history))):
        return body, history, prepare_chat(tokenizer, state, chat_request(chat_body))


def _history(state, tenant: Tenant, previous_response_id: str | None) -> list[dict]:
    if previous_response_id is None:
        return []
    found = state.responses.get(tenant, previous_response_id)
    if found is None:
        raise ServingError(400, f"Previous response with id {json.dumps(previous_response_id[:200])} not found.",
                           path="previous_response_id", code="previous_response_not_found", names_field=False)
    return found.conversation


def _keeper(state, tenant: Tenant, body: ResponsesRequest, conversation: list[dict]):
    """What keeps a finished response (unless `store` is false), for `tenant`."""

    def keep(response: dict) -> None:
        if body.store is not False:
            state.responses.put(tenant, response, conversation + [assistant_message(response["output"])],
                                input_items(body.input))

    return keep


def _count(state, text: str) -> int:
    return len(state.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


def _error_event(events: ResponseEvents):
    def event(error: ServingError) -> dict:
        names = error.names or responses_names(0)
        return events.event("error", code=error.code, message=error.message(names), param=error.param(names))

    return event


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
