"""POST /v1/embeddings: OpenAI's embeddings endpoint over the engine's embedding requests.

The body (unknown fields refused, types strict, as for the other routes):

    input            a string, a list of strings, a list of token ids (one input), or a list of
                     lists of token ids; at most MAX_INPUTS inputs, none empty
    model            the served name (optional)
    encoding_format  "float" (default) or "base64": the vector's little-endian float32 bytes, as OpenAI
    dimensions       keep the first n values (renormalised when the model normalises); only for a
                     model whose config declares Matryoshka embeddings (`is_matryoshka` or
                     `matryoshka_dimensions`, as in vLLM), else a 400 naming `dimensions`
    user             accepted and ignored
    truncate_prompt_tokens, normalize   extensions, as in vLLM (`PoolingParams`)

Every input becomes one embedding request (`engine/pooling.py`): each joins the running batch like
a prompt, chunked as the token budget says, and ends with its vector. A request has at most
`window` of its inputs in the engine at a time (INPUT_WINDOW, at most max_num_seqs): the next
input goes in when one finishes, so one request of 2,048 inputs holds a window's share of the
waiting queue, not all of it, and another client's request queued meanwhile runs after at most a
window of them. The body is parsed, checked and tokenized in the tokenizer pool before anything
reaches the engine: a bad input is a 400 naming `input` and its index (a text input that cannot
fit the context in tokens is refused by its length before it is tokenized, unless
truncate_prompt_tokens is set), and nothing of the request is admitted. The answer lists the vectors
in input order with `usage.prompt_tokens` (the tokens of every input). An input failed by the engine
fails the request (500, the others aborted); aborted inputs (shutdown) give a 503.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from deepinfer.contracts.pooling import PoolingParams
from deepinfer.engine.pooling import truncated
from deepinfer.entrypoints.openai.body import parse_json, read_body
from deepinfer.entrypoints.openai.engine_loop import EngineClosedError
from deepinfer.entrypoints.openai.errors import APIError, bad_request, internal_error, service_unavailable
from deepinfer.entrypoints.openai.request_stream import RequestHandle
from deepinfer.entrypoints.openai.serving import abort_on_disconnect, engine_closed
from deepinfer.outputs import EmbeddingRequestOutput

MAX_INPUTS = 2048  # as OpenAI
INPUT_WINDOW = 32  # inputs of one request in the engine at a time (at most max_num_seqs)
_PARAMS = ("dimensions", "normalize", "truncate_prompt_tokens")


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted and ignored
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # extension: keep the last k tokens (-1: max_model_len)
    normalize: bool | None = None  # extension: None as the model declares

    def inputs(self) -> list[str | list[int]]:
        """Each input as text or token ids; a 400 naming `input` for an empty or too long list."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        if not value:
            raise bad_request("input must not be empty: give a string, a list of strings or of token ids", "input")
        if len(value) > MAX_INPUTS:
            raise bad_request(f"input has {len(value)} entries; the limit is {MAX_INPUTS}", "input")
        for i, item in enumerate(value):
            if not item:
                raise bad_request(f"input[{i}] is empty; every input needs at least one token", "input")
        return list(value)

    def pooling_params(self) -> PoolingParams:
        try:
            return PoolingParams(dimensions=self.dimensions, normalize=self.normalize,
                                 truncate_prompt_tokens=self.truncate_prompt_tokens)
        except ValueError as exc:
            raise _param_error(exc) from None


def embeddings_routes(state) -> APIRouter:
    """The /v1/embeddings route over the server's `ServerState` (its engine loop, tokenizer pool,
    settings); mounted with the other /v1 routes, behind the same API key."""
    router = APIRouter(prefix="/v1")

    @router.post("/embeddings")
    async def embeddings(request: Request) -> Response:
        state.check_capacity()
        raw = await read_body(request)
        body, prompts, params = await state.pool.run(_prepare, state, raw)
        return await _embed(state, request, body, prompts, params)

    return router


# -- on a TokenizerPool thread: parse, validate, tokenize --------------------------------------------


def _prepare(tokenizer, state, raw: bytes) -> tuple[EmbeddingRequest, list[list[int]], PoolingParams]:
    body = EmbeddingRequest.model_validate(parse_json(raw))
    if state.lora_request(body.model) is not None:
        raise bad_request(f"model {body.model!r} is a LoRA adapter; embeddings come from the base model only",
                          "model")
    inputs = body.inputs()
    params = resolve_pooling(state, body.pooling_params())
    prompts = [token_ids(tokenizer, state, item, params, f"input[{i}]") for i, item in enumerate(inputs)]
    return body, prompts, params


def resolve_pooling(state, params: PoolingParams) -> PoolingParams:
    """`params` completed as the model pools; a 400 naming the field (else `model`) when refused."""
    try:
        return state.engine_loop.engine.pooling.resolve(params)
    except ValueError as exc:
        raise _param_error(exc) from None


def token_ids(tokenizer, state, item: str | list[int], params: PoolingParams, name: str) -> list[int]:
    """One input's token ids (cut to truncate_prompt_tokens); a 400 naming the field of `name`
    ("input[3]" -> `input`) when it cannot run."""
    param = name.split("[", 1)[0]
    if isinstance(item, str):
        if tokenizer is None:
            raise bad_request("this model ships no tokenizer; send the inputs as lists of token ids", param)
        if params.truncate_prompt_tokens is None:
            state.bounds.check_text(item, param, name)
        ids = list(tokenizer(item, add_special_tokens=True)["input_ids"])
    else:
        bad = next((t for t in item if not 0 <= t < state.vocab_size), None)
        if bad is not None:
            raise bad_request(f"{name} holds token id {bad}, outside the vocabulary [0, "
                              f"{state.vocab_size})", param)
        ids = list(item)
    ids = truncated(ids, params, state.max_model_len)
    if not ids:
        raise bad_request(f"{name} has no tokens", param)
    if len(ids) > state.max_model_len:
        raise bad_request(f"{name} has {len(ids)} tokens, but this model's maximum context length "
                          f"is {state.max_model_len} tokens; shorten it or pass truncate_prompt_tokens", param,
                          code="context_length_exceeded")
    return ids


def _param_error(exc: ValueError) -> APIError:
    """A 400 for a PoolingParams refusal, naming the field its message starts with (else `model`:
    the model cannot give this embedding)."""
    message = str(exc)
    param = next((name for name in _PARAMS if message.startswith(name)), "model")
    return bad_request(message, param)


# -- on the event loop: admit, collect, answer ----------------------------------------------------


async def _embed(state, request: Request, body: EmbeddingRequest, prompts: list[list[int]],
                 params: PoolingParams) -> Response:
    """Run the inputs (a window at a time), wait for their vectors, answer in input order."""
    response_id = f"embd-{uuid.uuid4().hex}"
    outputs = await pooled_outputs(state, request, response_id, prompts, params)
    return JSONResponse(_response(body, response_id, state.settings.model_name, outputs))


async def pooled_outputs(state, request: Request, response_id: str, prompts: list[list[int]],
                         params: PoolingParams, names: list[str] | None = None) -> list[EmbeddingRequestOutput]:
    """Every prompt's finished embedding output, in order (a window of them in the engine at a
    time; all aborted when the client leaves). `names` label the prompts in a refusal (default
    `input[i]`); 503 when aborted by a shutdown, 500 when the engine failed one."""
    window = InputWindow(state.engine_loop, response_id, params, input_window(state), names)
    watcher = asyncio.create_task(abort_on_disconnect(request, window))
    try:
        outputs = await window.run(prompts)
    except EngineClosedError as exc:
        raise engine_closed(exc, response_id, state.engine_loop) from None
    finally:
        watcher.cancel()
    failure = _failure(outputs, response_id)
    if failure is not None:
        raise failure
    return outputs


def input_window(state) -> int:
    """How many inputs of one request may be in the engine at a time."""
    return max(1, min(INPUT_WINDOW, state.engine_loop.engine.config.scheduler.max_num_seqs))


class InputWindow:
    """Runs one request's inputs through the engine, at most `size` of them admitted and unfinished
    at a time. A refused input aborts the others and is a 400 naming its field and index
    (`names[i]`, default `input[i]`)."""

    def __init__(self, engine_loop, response_id: str, params: PoolingParams, size: int,
                 names: list[str] | None = None):
        self.engine_loop, self.response_id, self.params = engine_loop, response_id, params
        self.names = names
        self.handles: dict[int, RequestHandle] = {}  # the admitted, unfinished inputs
        self.aborted = False
        self._slots = asyncio.Semaphore(size)

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
            if self.aborted:
                return None
            try:
                handle = await self.engine_loop.add(f"{self.response_id}-{index}", ids, self.params,
                                                    time.monotonic())
            except ValueError as exc:
                name = f"input[{index}]" if self.names is None else self.names[index]
                raise bad_request(f"{name}: {exc}", name.split("[", 1)[0]) from exc
            self.handles[index] = handle
            if self.aborted:  # aborted while this input was being added
                handle.abort()
            try:
                return await _final(handle)
            finally:
                del self.handles[index]

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


def _failure(outputs: list[EmbeddingRequestOutput | None], response_id: str) -> APIError | None:
    reasons = {None if out is None else out.finish_reason for out in outputs}
    if "abort" in reasons or None in reasons:
        return service_unavailable("the request was aborted: the server is shutting down; retry later",
                                   code="request_aborted")
    failed = next((out for out in outputs if out.finish_reason == "error" or out.error is not None), None)
    if failed is not None:
        return internal_error(failed.error, f"embedding {response_id} (the engine failed an input)")
    return None


def _response(body: EmbeddingRequest, response_id: str, model: str, outputs: list[EmbeddingRequestOutput]) -> dict:
    data = [{"object": "embedding", "index": i, "embedding": encode(out.outputs.embedding, body.encoding_format)}
            for i, out in enumerate(outputs)]
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {"id": response_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as JSON numbers, or as base64 of its little-endian float32 bytes (OpenAI's format)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
