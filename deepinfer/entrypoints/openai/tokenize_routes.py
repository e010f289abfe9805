"""vLLM's tokenizer routes, and the model card of /v1/models.

    POST /tokenize     {"model"?, "prompt", "add_special_tokens"?: true}
                       {"model"?, "messages", "add_generation_prompt"?: true, "tools"?,
                        "chat_template_kwargs"?, "add_special_tokens"?: false}
                       -> {"count", "max_model_len", "tokens", "token_strs"}   (token_strs with
                          "return_token_strs": true, else null)
    POST /detokenize   {"model"?, "tokens": [int]} -> {"prompt"}

A chat is rendered exactly as /v1/chat/completions renders it (with its tools), so `count` is the
prompt's length there. Both routes are admitted as a generation request is (the same capacity
check: 429 while the queue is full, 503 while shutting down; bodies parsed and tokenized in the
tokenizer pool, a big body in its lane) and take the same input limits: a text (or rendered chat)
with more characters than the context can hold in tokens is a 400 before it is tokenized, and more
than max_model_len tokens (tokenized, or sent to /detokenize) is a 400 (`context_length_exceeded`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from deepinfer.entrypoints.openai.body import in_pool
from deepinfer.serving.chat.prompt import TemplateRefused, load_checked, prompt_ids, render_chat
from deepinfer.serving.chat.tools import tool_plan
from deepinfer.serving.errors import FieldError, bad_request, from_field_error
from deepinfer.serving.parse import STRICT, Entries, Items, parse_body
from deepinfer.serving.pictures import picture_parts
from deepinfer.serving.protocol import ChatMessage


class TokenizeRequest(BaseModel):
    """One of `prompt` (text) or `messages` (a chat)."""

    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    messages: Items[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: true for a prompt, false for a chat (as vLLM)
    return_token_strs: bool = False
    tools: Items[Any] | None = None
    chat_template_kwargs: Entries[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: Items[int]


def model_card(state) -> dict:
    name = state.settings.model_name
    return {"id": name, "object": "model", "created": state.created, "owned_by": "deepinfer",
            "root": name, "max_model_len": state.max_model_len, "vocab_size": state.vocab_size}


def tokenize_routes(state) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return await in_pool(state, request, _tokenize)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return {"prompt": await in_pool(state, request, _detokenize)}

    return router


def _tokenize(tokenizer, state, raw: bytes) -> dict:
    body = parse_body(raw, TokenizeRequest)
    ids = _token_ids(tokenizer, state, body)
    state.bounds.check_tokens(len(ids), "prompt" if body.prompt is not None else "messages")
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


def _token_ids(tokenizer, state, body: TokenizeRequest) -> list[int]:
    state.check_model(body.model)
    if tokenizer is None:
        raise bad_request("this model ships no tokenizer")
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send one of prompt (text) or messages (a chat)", "prompt")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        state.bounds.check_text(body.prompt, "prompt")
        return list(tokenizer(body.prompt, add_special_tokens=special)["input_ids"])
    messages, refs = picture_parts([m.template_dict() for m in body.messages])
    try:
        pictures = load_checked(state.chat_setup, refs)
        text = render_chat(tokenizer, messages, tool_plan(body.tools, None),
                           template_kwargs=body.chat_template_kwargs,
                           add_generation_prompt=body.add_generation_prompt)
    except FieldError as exc:
        raise from_field_error(exc) from None
    except TemplateRefused:
        raise bad_request("the model's chat template refused the messages (check their roles, order and "
                          "content)", "messages") from None
    state.bounds.check_text(text, "messages")
    try:  # with pictures: the ids with their placeholders expanded, as the model reads them
        return prompt_ids(tokenizer, state.chat_setup, text, pictures, bool(body.add_special_tokens))[0]
    except FieldError as exc:
        raise from_field_error(exc) from None


def _detokenize(tokenizer, state, raw: bytes) -> str:
    body = parse_body(raw, DetokenizeRequest)
    state.check_model(body.model)
    if tokenizer is None:
        raise bad_request("this model ships no tokenizer")
    state.bounds.check_tokens(len(body.tokens), "tokens")
    bad = next((t for t in body.tokens if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise bad_request(f"{bad} is outside the vocabulary [0, {state.vocab_size})", "tokens")
    return tokenizer.decode(body.tokens)
