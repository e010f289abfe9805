"""Turning a request's RequestOutputs into OpenAI responses: whole JSON bodies or SSE chunks.

A formatter knows one endpoint's shapes (text completion or chat completion); `collect()` and
`stream_events()` drive it over a RequestHandle. Neither touches the engine: an abort goes
through the handle, and so through the engine thread.

`finish_reason` is one of OpenAI's values ("stop", "length"). A request that ends otherwise is
an error, never a finish reason: aborted (the server is shutting down) -> 503; its structured
output unable to go on (a StructuredOutputError in the worker: the grammar failed, or it allows
only tokens bad_words ban) -> 400 `structured_output_failed`, the request's own doing; failed by
the engine otherwise (finish_reason "error") or stopped with the engine -> 500 "internal error"
with a request id. A stream reports the same error as an `{"error": ...}` event, then
`data: [DONE]`.
"""

from __future__ import annotations

import abc
import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace

from deepinfer.entrypoints.openai.chat_output import ChatOutputPlan, ChoiceStream
from deepinfer.entrypoints.openai.engine_loop import EngineClosedError, EngineLoop
from deepinfer.entrypoints.openai.errors import APIError, bad_request, internal_error, service_unavailable
from deepinfer.entrypoints.openai.request_stream import RequestHandle
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.structured_output import structured_output_failure

MIN_LOGPROB = -9999.0  # JSON has no -inf


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens found in the prefix cache."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


class _Formatter(abc.ABC):
    """Shared state of one response: id, model, token strings, usage. An endpoint supplies the
    choice of one streamed chunk and of the whole response."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, tokenizer, num_prompt_tokens: int,
                 num_logprobs: int | None):
        self.response_id, self.model, self.tokenizer = response_id, model, tokenizer
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.num_logprobs = num_logprobs
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held at admission
        self._prompt_logprobs_sent = False
        self._finish_sent: set[int] = set()  # choice indices whose finish_reason was streamed

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        return {"id": self.response_id, "object": self.chunk_object_name if chunk else self.object_name,
                "created": self.created, "model": self.model, "choices": choices}

    def usage_chunk(self) -> dict:
        body = self.envelope([], chunk=True)
        body["usage"] = self.usage()
        return body

    def usage(self) -> dict:
        return usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)

    def start_chunks(self) -> list[dict]:
        return []

    def chunk(self, out: RequestOutput) -> dict | None:
        """The SSE chunk for this step's deltas: a choice per completion (n of them) with new
        text or just finished, each with its index; None when the step added nothing to show."""
        self.num_completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        self.num_cached_tokens = out.num_cached_tokens
        choices = [self.chunk_choice(one) for one in self._news(out)]
        if not choices:
            return None
        return self.add_prompt_logprobs(self.envelope(choices, chunk=True), out)

    def _news(self, out: RequestOutput) -> list[RequestOutput]:
        """`out` narrowed to each completion that has news (one choice each)."""
        news = []
        for c in out.outputs:
            if c.delta_token_ids or c.delta_text or (c.finished and c.index not in self._finish_sent):
                news.append(replace(out, outputs=[c]))
                if c.finished:
                    self._finish_sent.add(c.index)
        return news

    def final(self, out: RequestOutput) -> dict:
        """The whole response of a finished request, with usage."""
        self.num_completion_tokens = sum(len(c.token_ids) for c in out.outputs)  # usage sums the n choices
        self.num_cached_tokens = out.num_cached_tokens
        choices = [self.final_choice(replace(out, outputs=[c])) for c in out.outputs]
        body = self.add_prompt_logprobs(self.envelope(choices, chunk=False), out)
        body["usage"] = self.usage()
        return body

    @abc.abstractmethod
    def chunk_choice(self, out: RequestOutput) -> dict: ...

    @abc.abstractmethod
    def final_choice(self, out: RequestOutput) -> dict: ...

    def _entries(self, out: RequestOutput, num_last: int | None) -> list[tuple[int, dict[int, float]]]:
        """(token id, {id: logprob}) for the last `num_last` tokens (None: all)."""
        c = out.outputs[0]
        if self.num_logprobs is None or c.logprobs is None:
            return []
        ids, entries = c.token_ids, c.logprobs
        if num_last is not None:
            ids, entries = ids[len(ids) - num_last:], entries[len(entries) - num_last:]
        return [(t, {i: lp.logprob for i, lp in entry.items()}) for t, entry in zip(ids, entries, strict=True)]

    def add_prompt_logprobs(self, body: dict, out: RequestOutput) -> dict:
        """A top-level `prompt_logprobs` list, as vLLM renders it (an extension): per prompt token
        None (the first) or {token id: {logprob, rank, decoded_token}}. Sent once per request:
        in the whole response, or in the first streamed chunk after the prompt was scored."""
        if out.prompt_logprobs is None or self._prompt_logprobs_sent:
            return body
        self._prompt_logprobs_sent = True
        body["prompt_logprobs"] = [None if entry is None else {
            str(t): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()} for entry in out.prompt_logprobs]
        return body


class CompletionFormatter(_Formatter):
    """POST /v1/completions: `text` choices and the legacy logprobs shape."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._text_offsets: dict[int, int] = {}  # per choice index: characters streamed so far

    def chunk_choice(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        return {"index": c.index, "text": c.delta_text, "logprobs": self._logprobs(out, len(c.delta_token_ids)),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def final_choice(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        return {"index": c.index, "text": c.text, "logprobs": self._logprobs(out, None),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def _logprobs(self, out: RequestOutput, num_last: int | None) -> dict | None:
        if self.num_logprobs is None:
            return None
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        index = out.outputs[0].index
        for token_id, entry in self._entries(out, num_last):
            text = self.token_text(token_id)
            result["tokens"].append(text)
            result["token_logprobs"].append(max(entry[token_id], MIN_LOGPROB))
            result["top_logprobs"].append({self.token_text(t): max(lp, MIN_LOGPROB)
                                           for t, lp in entry.items()})
            result["text_offset"].append(self._text_offsets.get(index, 0))
            self._text_offsets[index] = self._text_offsets.get(index, 0) + len(text)
        return result


class ChatFormatter(_Formatter):
    """POST /v1/chat/completions: `message` / `delta` choices and the chat logprobs shape. With a
    `plan` that parses (`chat_output.py`), each choice's text is read into reasoning_content,
    content and tool_calls, whole or streamed (one ChoiceStream per choice); a choice that made
    calls and stopped finishes with "tool_calls"."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args, plan: ChatOutputPlan | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._roles_sent: set[int] = set()  # choice indices (beyond 0) whose first delta carried the role
        self.plan = plan if plan is not None and plan.parses else None
        self._streams: dict[int, ChoiceStream] = {}  # per choice index

    def start_chunks(self) -> list[dict]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return [self.envelope([choice], chunk=True)]

    def chunk_choice(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        delta, finish_reason = self._delta(c)
        if c.index and c.index not in self._roles_sent:  # index 0's role went in the first chunk
            self._roles_sent.add(c.index)
            delta = {"role": "assistant", **delta}
        return {"index": c.index, "delta": delta, "logprobs": self._logprobs(out, len(c.delta_token_ids)),
                "finish_reason": finish_reason}

    def _delta(self, c: CompletionOutput) -> tuple[dict, str | None]:
        if self.plan is None:
            return ({"content": c.delta_text} if c.delta_text or not c.finished else {}), c.finish_reason
        stream = self._streams.setdefault(c.index, self.plan.stream())
        parts = stream.feed(c.delta_text, c.finished)
        delta = {"reasoning_content": parts.reasoning_content, "content": parts.content,
                 "tool_calls": parts.tool_calls}
        return {key: value for key, value in delta.items() if value}, tool_finish_reason(c.finish_reason,
                                                                                         stream.num_calls)

    def final_choice(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        message: dict = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        if self.plan is not None:
            parsed = self.plan.parse(c.text)
            message["content"] = parsed.content
            if self.plan.reasoning is not None:
                message["reasoning_content"] = parsed.reasoning_content
            if parsed.tool_calls:
                message["tool_calls"] = [asdict(call) for call in parsed.tool_calls]
            finish_reason = tool_finish_reason(finish_reason, len(parsed.tool_calls))
        return {"index": c.index, "message": message, "logprobs": self._logprobs(out, None),
                "finish_reason": finish_reason}

    def _logprobs(self, out: RequestOutput, num_last: int | None) -> dict | None:
        if self.num_logprobs is None:
            return None
        content = []
        for token_id, entry in self._entries(out, num_last):
            best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:self.num_logprobs]
            item = self._token_logprob(token_id, entry[token_id])
            item["top_logprobs"] = [self._token_logprob(t, lp) for t, lp in best]
            content.append(item)
        return {"content": content, "refusal": None}

    def _token_logprob(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode())}


def tool_finish_reason(finish_reason: str | None, num_calls: int) -> str | None:
    """"tool_calls" for an answer that made calls and stopped (OpenAI's finish reason then)."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def request_failure(out: RequestOutput, response_id: str) -> APIError | None:
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
        return internal_error(out.error, f"generating {response_id} (the engine failed the request)")
    return None


def engine_closed(exc: EngineClosedError, response_id: str, engine_loop: EngineLoop | None) -> APIError:
    """The engine stopped under a request: a 503 while shutting down, a 500 if the engine failed."""
    if engine_loop is not None and engine_loop.error is not None:
        return internal_error(exc, f"generating {response_id} (the engine failed)")
    return service_unavailable("the server is shutting down or its engine stopped; retry later")


async def collect(handle: RequestHandle, formatter: _Formatter, engine_loop: EngineLoop | None = None) -> dict:
    """Run the request to its end; the whole response body (an APIError for a failed request)."""
    last = None
    try:
        async for out in handle:
            last = out
    except EngineClosedError as exc:
        raise engine_closed(exc, formatter.response_id, engine_loop) from None
    failure = request_failure(last, formatter.response_id)
    if failure is not None:
        raise failure
    return formatter.final(last)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_events(handle: RequestHandle, formatter: _Formatter, include_usage: bool,
                        engine_loop: EngineLoop | None = None) -> AsyncIterator[str]:
    """SSE events of one request; a client that goes away (cancellation) aborts the request.
    Whatever happens, the stream ends with `data: [DONE]`."""
    try:
        for chunk in formatter.start_chunks():
            yield sse(chunk)
        async for event in _output_events(handle, formatter, include_usage):
            yield event
    except EngineClosedError as exc:
        yield sse(engine_closed(exc, formatter.response_id, engine_loop).to_dict())
    except Exception as exc:  # a bug while formatting: the client still gets an error, then [DONE]
        yield sse(internal_error(exc, f"streaming {formatter.response_id}").to_dict())
    finally:
        handle.abort()  # a no-op when the request finished
    yield sse("[DONE]")


async def _output_events(handle: RequestHandle, formatter: _Formatter, include_usage: bool
                         ) -> AsyncIterator[str]:
    async for out in handle:
        failure = request_failure(out, formatter.response_id)
        if failure is not None:
            yield sse(failure.to_dict())
            return
        chunk = formatter.chunk(out)
        if chunk is not None:
            if include_usage:
                chunk["usage"] = None
            yield sse(chunk)
    if include_usage:
        yield sse(formatter.usage_chunk())


async def abort_on_disconnect(request, target, poll_s: float = 0.25) -> None:
    """Abort `target` (a request handle, or all inputs of an embeddings request) once the client of
    `request` (a fastapi Request) went away; run as a task, cancelled when the answer is sent."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)
    target.abort()


async def admit(engine_loop: EngineLoop, request_id: str, prompt_ids: list[int], params,
                lora_request=None, client: str | None = None) -> RequestHandle:
    """Hand a prepared request to the engine loop: its handle; a 400 when the engine refuses it
    (ValueError), a 503 when the engine stopped. `client`: whom it counts for in the fair share
    (`auth.client_id`; None: the anonymous client)."""
    scheduling = {} if client is None else {"client_id": client}
    try:
        return await engine_loop.add(request_id, prompt_ids, params, time.monotonic(), lora_request=lora_request,
                                     **scheduling)
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    except EngineClosedError as exc:
        raise engine_closed(exc, request_id, engine_loop) from None


async def final_output(engine_loop: EngineLoop, request, handle: RequestHandle, request_id: str) -> RequestOutput:
    """A whole (not streamed) request's last output, aborted if its client goes away; the APIError
    of a failed request (or of a stopped engine) is raised."""
    watcher = asyncio.create_task(abort_on_disconnect(request, handle))
    last = None
    try:
        async for out in handle:
            last = out
    except EngineClosedError as exc:
        raise engine_closed(exc, request_id, engine_loop) from None
    finally:
        watcher.cancel()
        handle.abort()  # a no-op when finished
    failure = request_failure(last, request_id)
    if failure is not None:
        raise failure
    return last
