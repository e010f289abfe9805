"""Running a prepared request: admit it into the engine loop, then hand its outputs to the API's
encoder. One admission, one stream loop and one whole-answer path serve every API.

    admit(ctx, request_id, prepared, tenant)      -> RequestHandle   (400 / 404 / 503 when refused)
    stream(ctx, handle, encoder)                  -> the encoder's events, whatever happens
    whole(ctx, handle, disconnected)              -> the last RequestOutput (a ServingError if it failed)

A `StreamEncoder` knows one API's event shapes (OpenAI's SSE chunks, Responses' and Anthropic's
typed events, Ollama's NDJSON lines): `start()` before the first output, `step(out)` for each
(its closing events too, once `out.finished`), `failed(error)` once if the request fails (then
nothing more is read), `end()` last (OpenAI's `data: [DONE]`). Neither path touches the engine:
an abort goes through the handle, and so through the engine thread. A client that goes away
aborts its request: a stream by the cancellation of its generator, a whole answer by
`abort_on_disconnect` polling the connection.

A request that ends otherwise than by "stop" or "length" is an error, never a finish reason:
aborted (the server is shutting down) -> 503; its structured output unable to go on -> 400
`structured_output_failed`, the request's own doing; failed by the engine otherwise or stopped
with the engine -> 500 "internal error" with a request id.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from deepinfer.outputs import RequestOutput
from deepinfer.serving.engine_loop import EngineClosedError, EngineLoop
from deepinfer.serving.errors import ServingError, bad_request, from_value_error, internal_error, service_unavailable
from deepinfer.serving.prepare import PARAM_FIELDS, Prepared
from deepinfer.serving.request_stream import RequestHandle
from deepinfer.serving.tenancy import EVERYONE, Tenant, fair_share_client
from deepinfer.structured_output import structured_output_failure


class StreamEncoder(Protocol):
    """One API's stream of events for one request (module docstring)."""

    def start(self) -> list[str]: ...

    def step(self, out: RequestOutput) -> list[str]: ...

    def failed(self, error: ServingError) -> list[str]: ...

    def end(self) -> list[str]: ...


class Events(Protocol):
    """An API's event builder: the opening events, and each step's (its closing ones too, once finished)."""

    def start(self) -> list[dict]: ...

    def step(self, out: RequestOutput) -> list[dict]: ...


class EventStream:
    """The StreamEncoder of an API whose events are typed dicts (Responses, Anthropic, Ollama): each
    rendered by `render`, a failure as the one event `error_event(error)`, nothing after the end."""

    def __init__(self, events: Events, render: Callable[[dict], str], error_event: Callable[[ServingError], dict]):
        self.events, self.render, self.error_event = events, render, error_event

    def start(self) -> list[str]:
        return [self.render(event) for event in self.events.start()]

    def step(self, out: RequestOutput) -> list[str]:
        return [self.render(event) for event in self.events.step(out)]

    def failed(self, error: ServingError) -> list[str]:
        return [self.render(self.error_event(error))]

    def end(self) -> list[str]:
        return []


async def admit(ctx, request_id: str, prepared: Prepared, tenant: Tenant) -> RequestHandle:
    """Hand a prepared request to the engine loop: its handle. The adapter is looked up again (404
    when unloaded meanwhile), the priority checked against the range the client may use, the fair
    share's client and the cache salt set (`cache_salt`), the pictures handed over (`pictures=`, only
    when there are any); the engine's refusal is a 400, a stopped engine a 503."""
    lora = ctx.lora_request(prepared.model)
    ctx.settings.priority_range.check(prepared.priority, tenant)
    scheduling = {"priority": prepared.priority, "client_id": fair_share_client(tenant, prepared.user),
                  "pictures": prepared.pictures}
    salt = cache_salt(ctx, tenant, prepared.cache_salt)
    try:
        return await ctx.engine_loop.add(request_id, prepared.prompt_ids, prepared.params, time.monotonic(),
                                         salt, lora, **{k: v for k, v in scheduling.items() if v})
    except ValueError as exc:
        raise from_value_error(exc, PARAM_FIELDS) from exc
    except EngineClosedError as exc:
        raise engine_closed(exc, request_id, ctx.engine_loop) from None


def cache_salt(ctx, tenant: Tenant, salt: str | None) -> str | None:
    """The prefix cache's salt of a request: with API keys, its tenant's id joined to the salt it
    sent (unless --shared-prefix-cache), so that no tenant hits, or can time, another's prompts."""
    if tenant is EVERYONE or ctx.settings.shared_prefix_cache:
        return salt
    return tenant.id if salt is None else f"{tenant.id}\x1f{salt}"


async def stream(ctx, handle: RequestHandle, encoder: StreamEncoder) -> AsyncIterator[str]:
    """The encoder's events for one request; the request is aborted when the stream stops early."""
    try:
        for event in encoder.start():
            yield event
        async for out in handle:
            failure = request_failure(out, handle.request_id)
            if failure is not None:
                for event in encoder.failed(failure):
                    yield event
                break
            for event in encoder.step(out):
                yield event
    except EngineClosedError as exc:
        for event in encoder.failed(engine_closed(exc, handle.request_id, ctx.engine_loop)):
            yield event
    except Exception as exc:  # a bug while encoding: the client still gets an error event
        for event in encoder.failed(internal_error(exc, f"streaming {handle.request_id}")):
            yield event
    finally:
        handle.abort()  # a no-op when the request finished
    for event in encoder.end():
        yield event


async def whole(ctx, handle: RequestHandle, disconnected: Callable[[], Awaitable[bool]]) -> RequestOutput:
    """A request's last output, aborted if its client goes away (`disconnected()` turns true); the
    ServingError of a failed request (or of a stopped engine) is raised."""
    watcher = asyncio.create_task(abort_on_disconnect(disconnected, handle))
    last = None
    try:
        async for out in handle:
            last = out
    except EngineClosedError as exc:
        raise engine_closed(exc, handle.request_id, ctx.engine_loop) from None
    finally:
        watcher.cancel()
        handle.abort()  # a no-op when finished
    failure = request_failure(last, handle.request_id)
    if failure is not None:
        raise failure
    return last


async def abort_on_disconnect(disconnected: Callable[[], Awaitable[bool]], target, poll_s: float = 0.25) -> None:
    """Abort `target` (a request handle, or an embeddings window) once `disconnected()` turns true;
    run as a task, cancelled when the answer is sent."""
    while not await disconnected():
        await asyncio.sleep(poll_s)
    target.abort()


def request_failure(out: RequestOutput, request_id: str) -> ServingError | None:
    """The error a finished output stands for (None: it finished normally); with n choices, one
    aborted or failed choice fails the request."""
    reasons = {c.finish_reason for c in out.outputs}
    if "abort" in reasons:
        return service_unavailable("the request was aborted: the server is shutting down; retry later",
                                   code="request_aborted")
    if "error" in reasons or (out.finished and out.error is not None):
        reason = structured_output_failure(out.error)
        if reason is not None:  # the engine logged its one line
            return bad_request(f"the structured output could not go on: {reason}", code="structured_output_failed")
        return internal_error(out.error, f"generating {request_id} (the engine failed the request)")
    return None


def engine_closed(exc: EngineClosedError, request_id: str, engine_loop: EngineLoop | None) -> ServingError:
    """The engine stopped under a request: a 503 while shutting down, a 500 if the engine failed."""
    if engine_loop is not None and engine_loop.error is not None:
        return internal_error(exc, f"generating {request_id} (the engine failed)")
    return service_unavailable("the server is shutting down or its engine stopped; retry later")
