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

The inputs are prepared and run by `deepinfer.serving.embeddings` (a window at a time, counted
against the client's seats; an input too long for the context is a 400 unless
truncate_prompt_tokens is set). The answer lists the vectors in input order with
`usage.prompt_tokens` (the tokens of every input). An input failed by the engine fails the request
(500, the others aborted); aborted inputs (shutdown) give a 503.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from deepinfer.contracts.pooling import PoolingParams
from deepinfer.entrypoints.openai.body import in_pool
from deepinfer.outputs import EmbeddingRequestOutput
from deepinfer.serving.embeddings import checked_inputs, input_ids, pooled_outputs, pooling_error, resolve_pooling
from deepinfer.serving.errors import Path
from deepinfer.serving.parse import STRICT, Items, parse_body


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings."""

    model_config = STRICT

    input: str | Items[str] | Items[int] | Items[Items[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted and ignored
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # extension: keep the last k tokens (-1: max_model_len)
    normalize: bool | None = None  # extension: None as the model declares

    def inputs(self) -> list[str | list[int]]:
        """Each input as text or token ids; a 400 naming `input` for an empty or too long list."""
        return input_list(self.input, "input")

    def pooling_params(self) -> PoolingParams:
        try:
            return PoolingParams(dimensions=self.dimensions, normalize=self.normalize,
                                 truncate_prompt_tokens=self.truncate_prompt_tokens)
        except ValueError as exc:
            raise pooling_error(exc) from None


def input_list(value, field: str) -> list[str | list[int]]:
    """A string, a list of strings, token ids or lists of token ids as a list of inputs; a 400 naming
    `field` for an empty or too long list, or an empty input."""
    one = isinstance(value, str) or bool(value and isinstance(value[0], int))
    return checked_inputs([value] if one else value, field)


def embeddings_routes(ctx) -> APIRouter:
    """The /v1/embeddings route over the server's `ServingContext`; behind the key check."""
    router = APIRouter(prefix="/v1")

    @router.post("/embeddings")
    async def embeddings(request: Request) -> Response:
        body, prompts, params = await in_pool(ctx, request, _prepare)
        response_id = f"embd-{uuid.uuid4().hex}"
        outputs = await embed(ctx, request, response_id, prompts, params, [("input", i) for i in range(len(prompts))])
        return JSONResponse(_response(body, response_id, ctx.settings.model_name, outputs))

    return router


async def embed(ctx, request: Request, response_id: str, prompts: list[list[int]], params: PoolingParams,
                paths: list[Path]) -> list[EmbeddingRequestOutput]:
    """The inputs' finished outputs, run with the seats of the request's client."""
    return await pooled_outputs(ctx, request.is_disconnected, response_id, prompts, params, paths,
                                request.scope.get("deepinfer.client"))


# -- on a TokenizerPool thread: parse, validate, tokenize --------------------------------------------


def _prepare(tokenizer, ctx, raw: bytes) -> tuple[EmbeddingRequest, list[list[int]], PoolingParams]:
    body = parse_body(raw, EmbeddingRequest)
    ctx.base_model_only(body.model, "embeddings")
    inputs = body.inputs()
    params = resolve_pooling(ctx, body.pooling_params())
    return body, prepared_inputs(tokenizer, ctx, inputs, params, "input"), params


def prepared_inputs(tokenizer, ctx, inputs: list, params: PoolingParams, field: str) -> list[list[int]]:
    return [input_ids(tokenizer, ctx, item, params, (field, i)) for i, item in enumerate(inputs)]


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
