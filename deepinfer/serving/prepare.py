"""Preparing a parsed request for the engine, on a tokenizer pool thread: the second step of its life.

Every API maps its body onto one of two requests (`serving/protocol.py`, OpenAI's shapes), and
every one of them is prepared here, the same way:

    CompletionRequest      prompt (text, token ids, or fill-in-the-middle with `suffix`)
    ChatCompletionRequest  the chat template rendered with the history, tools and reasoning section

    -> Prepared: prompt ids, SamplingParams checked (max_tokens against the context, every list
       within its limit, bad words tokenized, the structured output compiled completely: a forced
       tool call's grammar, or the request's own), and what admission reads (model, salt, priority).

Whatever is refused is a 400 naming the field. The engine thread then compiles and tokenizes
nothing of it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.contracts.multimodal import PictureInput
from deepinfer.sampling_params import SamplingParams, check_token_ids_in_vocab
from deepinfer.serving.chat.diagnostics import forced_call_error
from deepinfer.serving.chat.prompt import ChatPrompt
from deepinfer.serving.errors import bad_request, context_length_exceeded, from_value_error
from deepinfer.serving.fim import completion_fim_prompt
from deepinfer.serving.protocol import ChatCompletionRequest, CompletionRequest, structured_output_error

PARAM_FIELDS = frozenset(SamplingParams().__dict__) | {"prompt", "cache_salt", "priority"}


@dataclass
class Prepared:
    """A request ready for admission: its prompt and params, and what it is admitted with."""

    prompt_ids: list[int]
    params: SamplingParams
    model: str | None = None  # as the body names it: the base model or a LoRA adapter
    cache_salt: str | None = None
    priority: int = 0
    user: str | None = None  # the body's `user` (the fair share's client without keys)
    chat: ChatPrompt | None = None  # a chat's prompt, grammar and reading plan

    @classmethod
    def of(cls, body, prompt_ids: list[int], params: SamplingParams, chat: ChatPrompt | None = None) -> Prepared:
        return cls(prompt_ids, params, body.model, body.cache_salt, body.priority, body.user, chat)

    @property
    def pictures(self) -> tuple[PictureInput, ...]:
        """The prompt's pictures (their placeholder runs in `prompt_ids`), for the engine."""
        return self.chat.pictures if self.chat is not None else ()


def prepare_completion(tokenizer, ctx, body: CompletionRequest) -> Prepared:
    """A completion request's prompt ids and params."""
    body.check_supported()
    ctx.check_model(body.model)
    prompt_ids = completion_prompt(tokenizer, ctx, body)
    return Prepared.of(body, prompt_ids, prepared_params(tokenizer, ctx, body, prompt_ids, "prompt"))


def completion_prompt(tokenizer, ctx, body: CompletionRequest) -> list[int]:
    prompt = body.prompt_input()
    if body.suffix:  # fill-in-the-middle: the prompt is the text before the cursor
        return completion_fim_prompt(tokenizer, ctx, prompt, body.suffix)
    if isinstance(prompt, list):
        return prompt
    if tokenizer is None:
        raise bad_request("this model ships no tokenizer; send the prompt as a list of token ids", "prompt")
    ctx.bounds.check_text(prompt, "prompt")  # before tokenizing: a text that cannot fit is refused at once
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def prepare_chat(tokenizer, ctx, body: ChatCompletionRequest) -> Prepared:
    """A chat request's prompt, reading plan and params (its grammar in them)."""
    body.check_supported()
    ctx.check_model(body.model)
    chat = body.chat_prompt(tokenizer, ctx.chat_setup)
    params = prepared_params(tokenizer, ctx, body, chat.prompt_ids, "messages", chat)
    return Prepared.of(body, chat.prompt_ids, params, chat)


def prepared_params(tokenizer, ctx, body, prompt_ids: list[int], path: str,
                    chat: ChatPrompt | None = None) -> SamplingParams:
    """The request's SamplingParams, ready for admission: checked, bad words tokenized, structured
    output compiled (a 400 naming the field for anything refused). A chat's grammar (a forced tool
    call, or the structured output after the reasoning section) replaces the body's."""
    params = sampling_params(ctx, body, len(prompt_ids), path)
    try:
        if chat is not None:  # checked again with the chat's grammar (min_tokens cannot go with one)
            params.structured_output = chat.structured_output or params.structured_output
            params.skip_special_tokens = params.skip_special_tokens and not chat.keep_special_tokens
            params.validate()
        params.set_bad_words_tokens(tokenizer)
    except ValueError as exc:
        raise from_value_error(exc, PARAM_FIELDS) from exc
    if params.structured_output is not None:
        try:
            ctx.grammars.prepare(params.structured_output, params.first_banned_token_ids())
        except ValueError as exc:
            if chat is not None and chat.forced_call:
                raise forced_call_error(ctx.grammars, chat.tools, chat.plan.tool_parser, exc) from None
            raise structured_output_error(body, exc) from None
    return params


def sampling_params(ctx, body, num_prompt_tokens: int, path: str) -> SamplingParams:
    """SamplingParams with max_tokens checked against the context (400 when it cannot fit)."""
    limit, requested = ctx.max_model_len, body.requested_max_tokens()
    if num_prompt_tokens >= limit:
        raise context_length_exceeded(num_prompt_tokens, limit, path)
    if requested is not None and num_prompt_tokens + requested > limit:
        raise context_length_exceeded(num_prompt_tokens, limit, path, requested)
    if requested is None:
        requested = body.default_max_tokens(limit - num_prompt_tokens)
    try:
        params = SamplingParams(**{**ctx.sampling_defaults, **body.sampling_kwargs(requested)})
        check_token_ids_in_vocab(params, ctx.vocab_size)
        return params
    except ValueError as exc:
        raise from_value_error(exc, PARAM_FIELDS) from exc
