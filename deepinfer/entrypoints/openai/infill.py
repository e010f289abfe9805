"""POST /infill: llama.cpp's code-infill route, for editor plugins that speak it (llama.vim,
llama.vscode), over the FIM prompt of fim.py.

The body (unknown fields refused, types strict):

    input_prefix, input_suffix   the code before and after the cursor (default "")
    input_extra                  [{"filename", "text"}]: other files as context, before the prefix
    prompt                       text already typed at the cursor (after the FIM middle token)
    n_predict                    tokens to generate (-1, the default: up to the context)
    temperature, top_k, top_p, min_p, seed, stop, ignore_eos, presence_penalty, frequency_penalty,
    repeat_penalty               sampling, as in llama.cpp (unset: the model's defaults)
    model                        the served name (optional)
    n_indent, samplers, cache_prompt, t_max_prompt_ms, t_max_predict_ms, response_fields, id_slot
                                 accepted and ignored
    stream                       only false: a streamed infill is refused with a 400 naming `stream`

The answer has llama.cpp's /completion shape: {"index", "content", "model", "stop": true,
"stop_type": "eos" | "word" | "limit", "stopping_word", "tokens_predicted", "tokens_evaluated",
"truncated": false}. A model without FIM tokens is a 400 naming `input_suffix`.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from deepinfer.entrypoints.openai.auth import tenant_of
from deepinfer.entrypoints.openai.body import in_pool
from deepinfer.sampling_params import SamplingParams
from deepinfer.serving import run
from deepinfer.serving.errors import bad_request, context_length_exceeded
from deepinfer.serving.fim import fim_prompt, require_fim_tokens
from deepinfer.serving.parse import STRICT, Items, parse_body
from deepinfer.serving.prepare import Prepared

# SamplingParams' field -> the body's name for it, for a refusal's `param`
_PARAM_NAMES = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty", "temperature": "temperature",
                "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed", "stop": "stop",
                "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


class ExtraChunk(BaseModel):
    model_config = STRICT
    filename: str = "tmp"
    text: str


class InfillRequest(BaseModel):
    """POST /infill."""

    model_config = STRICT
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Items[ExtraChunk] = Field(default_factory=list, max_length=256)
    prompt: str = ""
    n_predict: int = Field(-1, ge=-1)
    temperature: float | None = Field(None, ge=0.0)
    top_k: int | None = Field(None, ge=-1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-1, le=2**64 - 1)  # -1: random, as llama.cpp
    stop: Items[str] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = Field(None, gt=0.0)
    stream: bool = False
    # accepted and ignored (editor plugins send them)
    n_indent: int | None = None
    samplers: Items[str] | None = None
    cache_prompt: bool | None = None
    t_max_prompt_ms: int | None = None
    t_max_predict_ms: int | None = None
    response_fields: Items[str] | None = None
    id_slot: int | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        values = dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                      seed=None if self.seed is None or self.seed < 0 else self.seed, stop=self.stop,
                      ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty, repetition_penalty=self.repeat_penalty)
        return {k: v for k, v in values.items() if v is not None}


def infill_routes(state) -> APIRouter:
    """POST /infill over the server's `ServingContext`, behind the same API key."""
    router = APIRouter()

    @router.post("/infill")
    async def infill(request: Request) -> Response:
        prepared = await in_pool(state, request, _prepare)
        handle = await run.admit(state, f"infill-{uuid.uuid4().hex}", prepared, tenant_of(request))
        out = await run.whole(state, handle, request.is_disconnected)
        return JSONResponse(_answer(state, out))

    return router


def _prepare(tokenizer, state, raw: bytes) -> Prepared:
    body = parse_body(raw, InfillRequest)
    if body.stream:
        raise bad_request("is not supported on /infill; send stream: false", "stream")
    state.base_model_only(body.model, "infills")
    tokens = require_fim_tokens(tokenizer, state.engine.source.hf_config, "input_suffix")
    if tokenizer is None:
        raise bad_request("this model ships no tokenizer, so its input cannot be tokenized", "input_prefix")
    for name, text in (("input_prefix", body.input_prefix), ("input_suffix", body.input_suffix),
                       ("prompt", body.prompt)):
        state.bounds.check_text(text, name)
    for i, chunk in enumerate(body.input_extra):
        state.bounds.check_text(chunk.text, ("input_extra", i, "text"))
    extra = [(chunk.filename, chunk.text) for chunk in body.input_extra]
    prompt_ids = fim_prompt(tokenizer, tokens, body.input_prefix, body.input_suffix, extra, body.prompt)
    return Prepared(prompt_ids, _sampling_params(state, body, len(prompt_ids)))


def _sampling_params(state, body: InfillRequest, num_prompt_tokens: int) -> SamplingParams:
    limit = state.max_model_len
    if num_prompt_tokens >= limit:
        raise context_length_exceeded(num_prompt_tokens, limit, "input_prefix")
    room = limit - num_prompt_tokens
    if body.n_predict > room:
        raise context_length_exceeded(num_prompt_tokens, limit, "n_predict", body.n_predict)
    max_tokens = room if body.n_predict <= 0 else body.n_predict
    defaults = {k: v for k, v in state.sampling_defaults.items() if k != "max_tokens"}
    try:
        return SamplingParams(**{**defaults, **body.sampling_kwargs(), "max_tokens": max_tokens})
    except ValueError as exc:
        field, _, problem = str(exc).partition(" ")
        raise (bad_request(problem, _PARAM_NAMES[field]) if field in _PARAM_NAMES else bad_request(str(exc))) from None


def _answer(state, out) -> dict:
    """llama.cpp's /completion answer for one finished request."""
    choice = out.outputs[0]
    stop_type = {"length": "limit"}.get(choice.finish_reason, "eos")
    stopping_word = choice.stop_reason if isinstance(choice.stop_reason, str) else ""
    if stopping_word:
        stop_type = "word"
    return {"index": 0, "content": choice.text, "model": state.settings.model_name, "stop": True,
            "stop_type": stop_type, "stopping_word": stopping_word, "tokens_predicted": len(choice.token_ids),
            "tokens_evaluated": len(out.prompt_token_ids), "truncated": False}
