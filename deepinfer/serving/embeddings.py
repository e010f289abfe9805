"""Embedding requests: their inputs prepared (in the tokenizer pool) and run a window at a time.

Every API that embeds (/v1/embeddings, Ollama's /api/embed and /api/embeddings, rerank, score) hands
its inputs here as texts or token-id lists, each with the field path a refusal names (`input[3]`,
`documents[0]`, ...). Every input becomes one embedding request (`engine/pooling.py`): each joins
the running batch like a prompt and ends with its vector.

Bounded work per client: an input whose tokens do not fit the context is refused (by its length
before it is tokenized) unless the request asks to truncate it; a request has at most `window` of
its inputs in the engine at a time (INPUT_WINDOW, at most max_num_seqs), and every input beyond its
first takes a seat of its client (`admission.ClientSeats`): the window only grows while the client
has seats free. So one client's embeddings hold at most its share of the engine's queue, and
another client's request queued meanwhile runs after at most a window of them.
"""

from __future__ import annotations

import asyncio
import time

from deepinfer.contracts.pooling import PoolingParams
from deepinfer.engine.pooling import truncated
from deepinfer.outputs import EmbeddingRequestOutput
from deepinfer.serving.admission import ClientSeats
from deepinfer.serving.engine_loop import EngineClosedError
from deepinfer.serving.errors import Path, ServingError, bad_request, internal_error, service_unavailable
from deepinfer.serving.request_stream import RequestHandle
from deepinfer.serving.run import abort_on_disconnect, engine_closed

MAX_INPUTS = 2048  # as OpenAI
INPUT_WINDOW = 32  # inputs of one request in the engine at a time (at most max_num_seqs)
_PARAMS = ("dimensions", "normalize", "truncate_prompt_tokens")


def resolve_pooling(ctx, params: PoolingParams) -> PoolingParams:
    """`params` completed as the model pools; a 400 naming the field (else `model`) when refused. One
    rule for every route that embeds: a model that declares no pooling, served without --pooling, is
    the same 400 naming `model` (and --pooling) on each of them (engine/pooling.py)."""
    try:
        return ctx.engine.pooling.resolve(params)
    except ValueError as exc:
        raise pooling_error(exc) from None


def pooling_error(exc: ValueError) -> ServingError:
    """A 400 for a PoolingParams refusal, naming the field its message starts with (else `model`:
    the model cannot give this embedding)."""
    message = str(exc)
    field = next((name for name in _PARAMS if message.startswith(name)), None)
    if field is None:
        return bad_request(message, "model")
    return bad_request(message[len(field):].lstrip(": "), field)


def input_ids(tokenizer, ctx, item: str | list[int], params: PoolingParams, path: Path) -> list[int]:
    """One input's token ids (cut to truncate_prompt_tokens); a 400 naming `path` when it cannot run."""
    if isinstance(item, str):
        if tokenizer is None:
            raise bad_request("this model ships no tokenizer; send the inputs as lists of token ids", path[:1])
        if params.truncate_prompt_tokens is None:
            ctx.bounds.check_text(item, path)
        ids = list(tokenizer(item, add_special_tokens=True)["input_ids"])
    else:
        bad = next((t for t in item if not 0 <= t < ctx.vocab_size), None)
        if bad is not None:
            raise bad_request(f"holds token id {bad}, outside the vocabulary [0, {ctx.vocab_size})", path)
        ids = list(item)
    ids = truncated(ids, params, ctx.max_model_len)
    if not ids:
        raise bad_request("has no tokens", path)
    if len(ids) > ctx.max_model_len:
        raise bad_request(f"has {len(ids)} tokens, but this model's maximum context length is {ctx.max_model_len} "
                          f"tokens; shorten it or ask for truncation", path, code="context_length_exceeded")
    return ids


def checked_inputs(inputs: list, field: str, limit: int = MAX_INPUTS, one: bool = False) -> list:
    """`inputs` when there are 1 to `limit` of them and none is empty; a 400 naming `field` (and the
    index of an empty one, unless the field holds `one` input) otherwise."""
    if not inputs:
        raise bad_request("must not be empty", field)
    if len(inputs) > limit:
        raise bad_request(f"has {len(inputs)} entries; the limit is {limit}", field)
    empty = next((i for i, item in enumerate(inputs) if not item), None)
    if empty is not None:
        raise bad_request("is empty; every input needs at least one token", field if one else (field, empty))
    return list(inputs)


def input_window(ctx) -> int:
    """How many inputs of one request may be in the engine at a time."""
    return max(1, min(INPUT_WINDOW, ctx.engine.config.scheduler.max_num_seqs))


async def pooled_outputs(ctx, disconnected, response_id: str, prompts: list[list[int]], params: PoolingParams,
                         paths: list[Path], client: str | None = None) -> list[EmbeddingRequestOutput]:
    """Every prompt's finished embedding output, in order (a window of them in the engine at a time,
    grown with the seats of `client`; all aborted when `disconnected()` turns true). 503 when aborted
    by a shutdown, 500 when the engine failed one."""
    seats = ctx.seats if client is not None else None
    window = InputWindow(ctx.engine_loop, response_id, params, input_window(ctx), paths, seats, client)
    watcher = asyncio.create_task(abort_on_disconnect(disconnected, window))
    try:
        outputs = await window.run(prompts)
    except EngineClosedError as exc:
        raise engine_closed(exc, response_id, ctx.engine_loop) from None
    finally:
        watcher.cancel()
    failure = _failure(outputs, response_id)
    if failure is not None:
        raise failure
    return outputs


class InputWindow:
    """Runs one request's inputs through the engine, at most `size` of them admitted and unfinished at
    a time, every one beyond the first holding a seat of `client` in `seats` (None: no seats counted).
    A refused input aborts the others and is a 400 naming its path (`paths[i]`)."""

    def __init__(self, engine_loop, response_id: str, params: PoolingParams, size: int, paths: list[Path],
                 seats: ClientSeats | None = None, client: str | None = None):
        self.engine_loop, self.response_id, self.params, self.paths = engine_loop, response_id, params, paths
        self.seats, self.client = seats, client
        self.handles: dict[int, RequestHandle] = {}  # the admitted, unfinished inputs
        self.aborted = False
        self._slots = asyncio.Semaphore(size)
        self._running = 0  # inputs holding a slot
        self._freed = asyncio.Condition()

    async def run(self, prompts: list[list[int]]) -> list[EmbeddingRequestOutput | None]:
        """Every input's final output in input order (None: aborted before it was admitted)."""
        tasks = [asyncio.create_task(self._one(i, ids)) for i, ids in enumerate(prompts)]
        try:
            return await asyncio.gather(*tasks)
        finally:
            self.abort()  # a no-op when every input finished
            for task in tasks:
                task.cancel()

    async def _one(self, index: int, ids: list[int]) -> EmbeddingRequestOutput | None:
        async with self._slots:
            seated = await self._seat()
            try:
                return None if self.aborted else await self._embed(index, ids)
            finally:
                await self._unseat(seated)

    async def _embed(self, index: int, ids: list[int]) -> EmbeddingRequestOutput:
        try:
            handle = await self.engine_loop.add(f"{self.response_id}-{index}", ids, self.params, time.monotonic())
        except ValueError as exc:
            raise bad_request(str(exc), self.paths[index]) from exc
        self.handles[index] = handle
        if self.aborted:  # aborted while this input was being added
            handle.abort()
        try:
            return await _final(handle)
        finally:
            del self.handles[index]

    async def _seat(self) -> bool:
        """Wait until this input may run: the first running input uses its request's own seat, every
        other one takes a seat of the client. True when it took one (to give back)."""
        async with self._freed:
            while True:
                if self._running == 0 or self.seats is None:
                    self._running += 1
                    return False
                if self.seats.try_take(self.client):
                    self._running += 1
                    return True
                await self._freed.wait()

    async def _unseat(self, seated: bool) -> None:
        async with self._freed:
            self._running -= 1
            if seated:
                self.seats.give_back(self.client)
            self._freed.notify_all()

    def abort(self) -> None:
        """Abort the admitted inputs and admit no more."""
        self.aborted = True
        for handle in list(self.handles.values()):
            handle.abort()


async def _final(handle: RequestHandle) -> EmbeddingRequestOutput:
    last = None
    async for out in handle:
        last = out
    return last


def _failure(outputs: list[EmbeddingRequestOutput | None], response_id: str) -> ServingError | None:
    reasons = {None if out is None else out.finish_reason for out in outputs}
    if "abort" in reasons or None in reasons:
        return service_unavailable("the request was aborted: the server is shutting down; retry later",
                                   code="request_aborted")
    failed = next((out for out in outputs if out.finish_reason == "error" or out.error is not None), None)
    if failed is not None:
        return internal_error(failed.error, f"embedding {response_id} (the engine failed an input)")
    return None
