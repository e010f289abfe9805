"""Request bodies of the OpenAI API as pydantic models, and their mapping to SamplingParams.

Unknown fields are refused, as OpenAI's API does (a 400 naming the field: a misspelled
`max_tokns` never silently falls back to a default); every field the official `openai` client
sends is declared. Fields that change nothing here are accepted and ignored (`metadata`,
`store`, `service_tier`, `prediction`, `prompt_cache_key`, `safety_identifier`); `user` names the
client for the scheduler's fair share when the server checks no API keys. Chat messages
keep their extra fields (they reach the chat template). Function `tools`, `tool_choice` and
`parallel_tool_calls` are checked in `tools.py`; `chat_template_kwargs` (an extension, as in
vLLM) reach the chat template (e.g. `{"enable_thinking": false}`).
`cache_salt` (an extension, as in vLLM) keeps a request's prefix
cache apart from requests with another salt; `priority` (vLLM's extension: lower is served first)
needs `--scheduling-policy priority` unless it is 0. vLLM's sampling extensions `min_tokens`,
`include_stop_str_in_output`, `skip_special_tokens` (default true; false shows special tokens in the
text, though never the one that ended the generation), `spaces_between_special_tokens`, `bad_words` and
`prompt_logprobs` (a top-level list in the response) are accepted beside OpenAI's `logit_bias`.
Fields that would change the meaning of a request but that the server does not implement (echo,
the legacy `functions`, ...) are parsed loosely and refused by `check_supported()` with a 400 that
names them, so a client never gets a silently different answer.

Types are strict, as in OpenAI's API: a boolean is not an integer (`max_tokens: true` is a 400),
a string is not a boolean or a number (`stream: "yes"`, `temperature: "0.5"`), a float is not
an integer; an integer is a float. Numbers must be finite.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from deepinfer.serving.chat.diagnostics import forced_call_refused
from deepinfer.serving.chat.prompt import ChatPrompt, ChatSetup, TemplateRefused, prepare_chat
from deepinfer.serving.chat.tools import FieldError, ToolPlan, tool_plan
from deepinfer.serving.errors import ServingError, bad_request, from_field_error, same_names, short_repr
from deepinfer.serving.parse import STRICT, Entries, Items, validate
from deepinfer.serving.pictures import PictureError
from deepinfer.structured_output import StructuredOutputsParams

# torch.Generator.manual_seed takes any 64-bit seed, signed or unsigned; top_k becomes an int64
SEED_MIN, SEED_MAX, INT64_MAX = -(2**63), 2**64 - 1, 2**63 - 1


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # accepted and ignored (no obfuscation padding is sent)


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (None: the default)."""

    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | Items[str] | None = None
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the client, for the fair share (without API keys)
    # accepted and ignored: they change nothing in how this server answers
    metadata: Entries[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    ignore_eos: bool | None = False  # extension (as in vLLM): keep generating past EOS
    cache_salt: str | None = None  # extension (as in vLLM): only requests with an equal salt share cached prefixes
    priority: int = Field(0, ge=-INT64_MAX - 1, le=INT64_MAX)  # extension (as in vLLM): lower is served first
    logit_bias: Entries[str, float] | None = None  # token id (a string, as JSON keys are) -> bias in [-100, 100]
    # extensions (as in vLLM); SamplingParams checks their values
    min_tokens: int | None = Field(None, ge=0)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None  # default true: special tokens are not shown in the text
    spaces_between_special_tokens: bool | None = None
    bad_words: Items[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # Structured output: OpenAI's response_format ({"type": "text" | "json_object" | "json_schema"}),
    # vLLM's structured_outputs ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) and
    # its older guided_* spellings; at most one of them (see `structured_output_of`).
    response_format: Entries[str, Any] | None = None
    structured_outputs: Entries[str, Any] | None = None
    guided_json: Entries[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Items[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def default_max_tokens(self, room: int) -> int:
        """max_tokens when the request sets none (`room`: what the context leaves): up to the context."""
        return room

    def num_logprobs(self) -> int | None:
        """None: no logprobs; n >= 0: the sampled token's logprob plus the top n."""
        return None

    def check_supported(self) -> None:
        """Raise a 400 for a field whose meaning the server does not implement."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("is only allowed when stream is true", "stream_options")

    def sampling_kwargs(self, max_tokens: int) -> dict:
        """Keyword arguments for SamplingParams (its own validation still applies)."""
        values = dict(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                      top_k=self.top_k, min_p=self.min_p, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty,
                      repetition_penalty=self.repetition_penalty, seed=self.seed,
                      ignore_eos=self.ignore_eos, logprobs=self.num_logprobs(),
                      stop=[self.stop] if isinstance(self.stop, str) else self.stop,
                      structured_output=structured_output_of(self), logit_bias=self.logit_bias,
                      min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
                      skip_special_tokens=self.skip_special_tokens,
                      spaces_between_special_tokens=self.spaces_between_special_tokens,
                      bad_words=self.bad_words, prompt_logprobs=self.prompt_logprobs)
        values.update(self.sample_counts())
        return {k: v for k, v in values.items() if v is not None}  # None: SamplingParams' default

    def sample_counts(self) -> dict:
        """n: choices returned (SamplingParams checks its range)."""
        return {"n": self.n}


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: str | Items[int] | Items[str] | Items[Items[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)
    echo: bool | None = False
    suffix: str | None = None  # fill-in-the-middle: the text after the cursor (fim.py; a 400 without FIM tokens)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def default_max_tokens(self, room: int) -> int:
        """OpenAI's default for a completion: 16 tokens."""
        return min(16, room)

    def sample_counts(self) -> dict:
        """n, and best_of: sequences drawn, the n of highest cumulative logprob returned (>= n)."""
        return {"n": self.n, "best_of": self.best_of}

    def check_supported(self) -> None:
        super().check_supported()
        _refuse_if(bool(self.stream) and (self.best_of or 1) > 1, "best_of",
                   "cannot be used with stream: the best choices are known only at the end", code=None)
        _refuse_if(bool(self.echo), "echo", "is not supported")

    def prompt_input(self) -> str | list[int]:
        """The one prompt as text or token ids; batches of prompts are refused."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise bad_request("must not be empty", "prompt")
        if all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if len(prompt) > 1:
            raise bad_request(f"a list of {len(prompt)} prompts is not supported; send one prompt per request",
                              "prompt")
        return prompt[0]


class TextPart(BaseModel):
    """A content part: text, or a picture (`image_url`: `{"url": data URL | http(s) URL | file:// URL,
    "detail"?}` or the URL string; `detail` is ignored); a part of another type is refused by its type."""
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    type: str
    text: str | None = None
    image_url: str | Entries[str, Any] | None = None

    def template_part(self) -> dict:
        if self.type == "image_url":
            return {"type": "image_url", "image_url": self.image_url}
        return {"type": "text", "text": self.text}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # name, ... reach the template
    role: str
    content: str | Items[TextPart] | None = None

    def template_dict(self) -> dict:
        """The message as the chat template wants it: content as one string, or (with pictures) a
        list of text and image_url parts (`pictures.picture_parts` turns them into the template's)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            for part in self.content:
                _refuse_if(not (part.type == "text" and part.text is not None)
                           and not (part.type == "image_url" and part.image_url is not None), "messages",
                           f"content part of type {part.type!r} is not supported; only text and image_url",
                           code="unsupported_content")
            if any(part.type == "image_url" for part in self.content):
                message["content"] = [part.template_part() for part in self.content]
            else:
                message["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            message["content"] = ""
        return message


PICTURE_PATHS = "__picture_paths__"  # a converted body's key: its pictures' paths in the client's names


def chat_request(body: dict) -> ChatCompletionRequest:
    """A chat request from a body another API was converted into (Anthropic, Responses, Ollama): its
    pictures keep the paths of the client's body (`PICTURE_PATHS`, taken out before validation)."""
    paths = body.pop(PICTURE_PATHS, None)
    request = validate(ChatCompletionRequest, body)
    request._picture_paths = paths
    return request


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: Items[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Items[Any] | None = None
    tool_choice: Any = None
    functions: Items[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: Entries[str, Any] | None = None
    prediction: Entries[str, Any] | None = None  # accepted and ignored (a speed hint; the answer is the same)
    modalities: Items[str] | None = None
    audio: Entries[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Entries[str, Any] | None = None
    _picture_paths: list | None = PrivateAttr(None)  # set by chat_request (another API's names)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        _refuse_if(bool(self.functions), "functions", "are not supported; send them as tools")
        _refuse_if(self.function_call not in (None, "none"), "function_call", "is not supported")
        _refuse_if(self.top_logprobs is not None and not self.logprobs, "top_logprobs",
                   "requires logprobs to be true", code=None)
        _refuse_if(self.modalities not in (None, ["text"]), "modalities", "only the text modality is supported")
        for name, value in (("audio", self.audio), ("reasoning_effort", self.reasoning_effort),
                            ("verbosity", self.verbosity), ("web_search_options", self.web_search_options)):
            _refuse_if(value is not None, name, "is not supported with this model")

    def template_messages(self) -> list[dict]:
        return [m.template_dict() for m in self.messages]

    def tool_plan(self) -> ToolPlan | None:
        """The checked tools (a 400 naming the field for a bad one)."""
        try:
            return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        except FieldError as exc:
            raise from_field_error(exc) from None

    def chat_prompt(self, tokenizer, setup: ChatSetup) -> ChatPrompt:
        """The rendered prompt, the answer's grammar and the plan for reading it (`chat_prompt.py`);
        400s naming the field."""
        tools = self.tool_plan()
        structured = structured_output_of(self) if setup.reasoning is not None else None
        try:
            return prepare_chat(tokenizer, setup, self.template_messages(), tools, structured,
                                template_kwargs=self.chat_template_kwargs, picture_paths=self._picture_paths)
        except PictureError as exc:  # its path is in the client's own names already
            error = from_field_error(exc)
            error.names = same_names
            raise error from None
        except FieldError as exc:
            raise from_field_error(exc) from None
        except TemplateRefused as exc:
            logging.getLogger("deepinfer.server").info("the chat template refused a conversation: %s", exc)
            raise bad_request("the model's chat template refused the messages (check their roles, order "
                              "and content)", "messages") from None
        except ValueError as exc:  # the grammar: a forced call's, or one after the reasoning section
            if tools is not None and tools.forced:
                raise forced_call_refused(setup.tool_parser, exc) from None
            raise structured_output_error(self, exc) from None


def _refuse_if(condition: bool, path, problem: str, code: str | None = "unsupported_parameter") -> None:
    if condition:
        raise ServingError(400, problem, path=path, code=code)


def _guided_specs(body: _GenerationRequest) -> list[tuple[str, tuple, dict]]:
    """vLLM's guided_* fields the request sets, as structured_spec's entries."""
    given = (("guided_json", "json", body.guided_json), ("guided_regex", "regex", body.guided_regex),
             ("guided_choice", "choice", body.guided_choice), ("guided_grammar", "grammar", body.guided_grammar))
    return [(name, (name,), {key: value}) for name, key, value in given if value is not None]


def structured_output_of(body: _GenerationRequest) -> StructuredOutputsParams | None:
    """The request's output constraint, or None; a 400 naming the param when it is malformed,
    invalid (a bad schema, regex or grammar, or over a limit) or given twice."""
    spec = structured_spec(body)
    if spec is None:
        return None
    try:
        return StructuredOutputsParams.from_value(spec[2])
    except ValueError as exc:
        raise structured_output_error(body, exc) from None


def structured_spec(body: _GenerationRequest) -> tuple[str, tuple, dict] | None:
    """(param, the path it names, structured_outputs dict) of the request's one constraint."""
    specs = _response_format_spec(body.response_format)
    if body.structured_outputs is not None:
        specs.append(("structured_outputs", ("structured_outputs",), dict(body.structured_outputs)))
    specs += _guided_specs(body)
    if len(specs) > 1:
        raise bad_request(f"both it and {specs[0][0]} constrain the output; send one of them", specs[1][0])
    return specs[0] if specs else None


def structured_output_error(body: _GenerationRequest, exc: ValueError) -> ServingError:
    """A 400 for the structured output's ValueError at the field the client used (`guided_grammar`,
    `structured_outputs.regex`, `response_format.json_schema.schema`, ...). StructuredOutputsParams'
    messages start with the spec's own name (`structured_output.regex ...`), which the path replaces."""
    param, path, spec = structured_spec(body)
    kind = next(iter(spec))
    own = "structured_output" if param == "structured_outputs" else f"structured_output.{kind}"
    message = str(exc)
    if message.startswith(own + "."):  # a part of the spec: structured_output.json_object -> its key
        part, _, rest = message[len("structured_output."):].partition(" ")
        return bad_request(rest, (*path, part) if param == "structured_outputs" else path)
    return bad_request(message[len(own):].lstrip(": ") if message.startswith(own) else message, path)


def _response_format_spec(response_format: dict | None) -> list[tuple[str, tuple, dict]]:
    """OpenAI's response_format -> [(param, shown name, structured_outputs dict)] (empty for text)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", ("response_format",), {"json_object": True})]
    if kind != "json_schema":
        raise bad_request(f"must be 'text', 'json_object' or 'json_schema', got {short_repr(kind)}",
                          ("response_format", "type"))
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
        raise bad_request("must be an object with a 'schema' object (a JSON schema)",
                          ("response_format", "json_schema"))
    return [("response_format", ("response_format", "json_schema", "schema"), {"json": json_schema["schema"]})]
