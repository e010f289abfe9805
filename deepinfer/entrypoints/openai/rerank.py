"""POST /v1/rerank (also /rerank, /v2/rerank) and POST /v1/score (also /score), as vLLM serves them,
over the embedding path of embeddings.py.

The model is a bi-encoder: every text is embedded on its own (tokenized with the same limits,
admitted a window at a time, as /v1/embeddings does) and the score of a pair is the cosine
similarity of the two vectors. A model that declares no pooling (a generative checkpoint without a
sentence-transformers modules.json or GGUF pooling_type, served without --pooling) is refused with the
400 naming `model` that /v1/embeddings and /api/embed give it, as is one whose embeddings cannot be
computed here.

Rerank (Jina/Cohere shape):

    {"model"?, "query": str, "documents": [str | {"text": str}], "top_n"?: int >= 1,
     "return_documents"?: bool (default true, as Jina and vLLM)}
    -> {"id", "model", "usage": {"total_tokens"},
        "results": [{"index", "relevance_score", "document"?: {"text"}}]}   best first, top_n kept

Score (vLLM's): text_1 and text_2 are a string or a list of strings; one text_1 pairs with every
text_2 (1:N), else the lists pair up by position (N:N, equal lengths).

    -> {"id", "object": "list", "model", "created", "data": [{"index", "object": "score", "score"}],
        "usage": {"prompt_tokens", "total_tokens"}}
"""

from __future__ import annotations

import math
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from deepinfer.contracts.pooling import PoolingParams
from deepinfer.entrypoints.openai.body import in_pool
from deepinfer.entrypoints.openai.embeddings import embed
from deepinfer.serving.embeddings import MAX_INPUTS, checked_inputs, input_ids, resolve_pooling
from deepinfer.serving.errors import Path, bad_request
from deepinfer.serving.parse import STRICT, Items, parse_body

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
SCORE_PATHS = ("/v1/score", "/score")


class RerankDocument(BaseModel):
    model_config = STRICT
    text: str


class RerankRequest(BaseModel):
    """POST /v1/rerank."""

    model_config = STRICT
    model: str | None = None
    query: str
    documents: Items[str | RerankDocument]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True

    def texts(self) -> list[str]:
        """The query, then every document's text; a 400 naming the field of an empty one."""
        documents = [d if isinstance(d, str) else d.text for d in self.documents]
        checked_inputs([self.query], "query", one=True)
        checked_inputs(documents, "documents", limit=MAX_INPUTS - 1)
        return [self.query, *documents]


class ScoreRequest(BaseModel):
    """POST /v1/score."""

    model_config = STRICT
    model: str | None = None
    text_1: str | Items[str]
    text_2: str | Items[str]

    def pairs(self) -> tuple[list[str], list[str]]:
        """(text_1 list, text_2 list) checked for emptiness and pairing; a 400 naming the field."""
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        checked_inputs(first, "text_1", limit=MAX_INPUTS // 2, one=isinstance(self.text_1, str))
        checked_inputs(second, "text_2", limit=MAX_INPUTS // 2, one=isinstance(self.text_2, str))
        if len(first) != 1 and len(first) != len(second):
            raise bad_request(f"has {len(second)} entries but text_1 has {len(first)}: give one text_1 (scored "
                              f"against every text_2) or as many as text_2 (paired by position)", "text_2")
        return first, second


def rerank_routes(state) -> APIRouter:
    """The rerank and score routes over the server's `ServingContext`, behind the same API key."""
    router = APIRouter()

    async def rerank(request: Request) -> Response:
        body, names, prompts, params = await in_pool(state, request, _prepare_rerank)
        response_id = f"rerank-{uuid.uuid4().hex}"
        vectors, num_tokens = await _vectors(state, request, response_id, prompts, params, names)
        return JSONResponse(_rerank_response(state, response_id, body, vectors, num_tokens))

    async def score(request: Request) -> Response:
        body, names, prompts, params = await in_pool(state, request, _prepare_score)
        response_id = f"score-{uuid.uuid4().hex}"
        vectors, num_tokens = await _vectors(state, request, response_id, prompts, params, names)
        return JSONResponse(_score_response(state, response_id, body, vectors, num_tokens))

    for path in RERANK_PATHS:
        router.add_api_route(path, rerank, methods=["POST"])
    for path in SCORE_PATHS:
        router.add_api_route(path, score, methods=["POST"])
    return router


# -- on a TokenizerPool thread: parse, validate, tokenize --------------------------------------------


def _prepare_rerank(tokenizer, state, raw: bytes):
    body = parse_body(raw, RerankRequest)
    params = _embedding_params(state, body.model)
    texts = body.texts()
    names = [("query",)] + [("documents", i) for i in range(len(texts) - 1)]
    return body, names, _tokenized(tokenizer, state, texts, names, params), params


def _prepare_score(tokenizer, state, raw: bytes):
    body = parse_body(raw, ScoreRequest)
    params = _embedding_params(state, body.model)
    first, second = body.pairs()
    names = [("text_1", i) for i in range(len(first))] + [("text_2", i) for i in range(len(second))]
    return body, names, _tokenized(tokenizer, state, first + second, names, params), params


def _embedding_params(state, model: str | None) -> PoolingParams:
    """The pooling every text of the request gets; a 400 naming `model` when it cannot embed."""
    state.base_model_only(model, "scores")
    return resolve_pooling(state, PoolingParams())


def _tokenized(tokenizer, state, texts: list[str], names: list[Path], params: PoolingParams) -> list[list[int]]:
    if tokenizer is None:
        raise bad_request("this model ships no tokenizer, so its texts cannot be scored", "model")
    return [input_ids(tokenizer, state, text, params, name) for text, name in zip(texts, names, strict=True)]


# -- on the event loop: embed, score, answer ---------------------------------------------------------


async def _vectors(state, request: Request, response_id: str, prompts: list[list[int]], params: PoolingParams,
                   names: list[Path]) -> tuple[list[list[float]], int]:
    """Every text's vector in order, and the tokens of all of them."""
    outputs = await embed(state, request, response_id, prompts, params, names)
    return [out.outputs.embedding for out in outputs], sum(len(out.prompt_token_ids) for out in outputs)


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two vectors (0.0 when either is all zeros)."""
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0


def _rerank_response(state, response_id: str, body: RerankRequest, vectors: list[list[float]], num_tokens: int) -> dict:
    query, documents = vectors[0], vectors[1:]
    scored = sorted(((cosine(query, v), i) for i, v in enumerate(documents)), key=lambda pair: (-pair[0], pair[1]))
    results = []
    for score, index in scored[:body.top_n]:
        result = {"index": index, "relevance_score": score}
        if body.return_documents:
            document = body.documents[index]
            result["document"] = {"text": document if isinstance(document, str) else document.text}
        results.append(result)
    return {"id": response_id, "model": state.settings.model_name,
            "usage": {"total_tokens": num_tokens}, "results": results}


def _score_response(state, response_id: str, body: ScoreRequest, vectors: list[list[float]], num_tokens: int) -> dict:
    num_first = 1 if isinstance(body.text_1, str) else len(body.text_1)
    first, second = vectors[:num_first], vectors[num_first:]
    scores = [cosine(first[0 if num_first == 1 else i], v) for i, v in enumerate(second)]
    return {"id": response_id, "object": "list", "created": int(time.time()),
            "model": state.settings.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
