"""A chat request made ready for the engine: its prompt (the chat template rendered with the
history and the tools, then tokenized), the grammar its answer follows, and the plan for reading
that answer (`ChatOutputPlan`). Used by /v1/chat/completions, /v1/responses, /tokenize and
`LLM.chat`; pure Python apart from the tokenizer.

The grammar: a forced tool call (`tool_choice` "required" or a function), in the tool parser's
format; else the request's own structured output. With a reasoning parser, either begins after
the reasoning section. Special tokens stay in the decoded answer when the formats' markers are
special tokens (Mistral's `[TOOL_CALLS]`, say), so that the parsers see them. With
`tool_choice` "auto" answers are read leniently: a fenced or bare JSON
call of one of the tools counts as a call (`tool_parsers/lenient.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.contracts.multimodal import PictureInput
from deepinfer.sampling_params import short_repr
from deepinfer.serving.chat.constraints import constrained, forced_call
from deepinfer.serving.chat.output import ChatOutputPlan
from deepinfer.serving.chat.reasoning import ReasoningParser
from deepinfer.serving.chat.tool_parsers import ToolParser, skipped_when_decoded
from deepinfer.serving.chat.tool_parsers.lenient import LenientToolParser
from deepinfer.serving.chat.tools import (
    ToolPlan,
    forced_call_grammar,
    template_messages,
    with_text_arguments,
)
from deepinfer.serving.errors import FieldError
from deepinfer.serving.pictures import (
    MediaPolicy,
    Picture,
    PictureError,
    PictureRef,
    load_pictures,
    picture_parts,
)
from deepinfer.structured_output import StructuredOutputsParams

# apply_chat_template's own arguments: chat_template_kwargs may not set them
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


class TemplateRefused(ValueError):
    """The chat template raised on these messages (roles, order, content, ...)."""


@dataclass(frozen=True)
class ChatSetup:
    """How a server (or `LLM.chat`) reads answers: the tool parser (None: the chat template writes
    no format it knows, and tools can only be sent with tool_choice "none") and the reasoning parser."""

    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    vision: object = None  # a VisionProcessor (`serving/vision.py`); None: a text model
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where pictures may come from, how large


@dataclass
class ChatPrompt:
    prompt_text: str
    prompt_ids: list[int]
    plan: ChatOutputPlan
    structured_output: StructuredOutputsParams | None  # the answer's grammar (None: free text)
    forced_call: bool  # the grammar is a forced tool call
    keep_special_tokens: bool
    tools: ToolPlan | None = None  # the request's checked tools
    pictures: tuple[PictureInput, ...] = ()  # the prompt's pictures, their placeholder runs expanded


def prepare_chat(tokenizer, setup: ChatSetup, messages: list[dict], tools: ToolPlan | None,
                 structured_output: StructuredOutputsParams | None = None, *,
                 template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                 picture_paths: list | None = None) -> ChatPrompt:
    """The prompt, grammar and reading plan of one chat request. FieldError for bad tools or
    messages (PictureError for a bad picture), TemplateRefused when the chat template raises,
    ValueError (`structured_output...`) when the grammar is refused. Picture parts (`pictures.py`)
    are loaded and their placeholders expanded by the model's processor (`setup.vision`)."""
    parser = _tool_parser(setup, tools)
    messages, refs = picture_parts(messages, picture_paths)
    loaded = load_checked(setup, refs)  # a bad picture is refused before the template runs
    text = render_chat(tokenizer, messages, tools, template_kwargs=template_kwargs,
                       add_generation_prompt=add_generation_prompt)
    ids, pictures = prompt_ids(tokenizer, setup, text, loaded)
    reasoning = setup.reasoning
    inside = reasoning is not None and reasoning.inside_at_start(text)
    forced = tools is not None and tools.forced
    if forced:
        structured_output = forced_call(forced_call_grammar(tools, parser), reasoning, inside)
    else:
        structured_output = constrained(structured_output, reasoning, inside)
    reader = parser
    if parser is not None and tools.choice == "auto":
        reader = LenientToolParser(parser, tools.functions)  # fenced or bare JSON calls too
    plan = ChatOutputPlan(reader, reasoning, inside)
    marker_ids = [*(parser.special_ids.values() if parser is not None else ()),
                  *((reasoning.special_ids or {}).values() if reasoning is not None else ())]
    keep = skipped_when_decoded(tokenizer, marker_ids)  # the parsers must see their markers
    return ChatPrompt(text, ids, plan, structured_output, forced, keep, tools, pictures)


def load_checked(setup: ChatSetup, refs: list[PictureRef]) -> list[Picture]:
    """The pictures loaded and checked (`pictures.py`); PictureError naming the first bad one, or the
    first of any when the model reads text only."""
    if refs and setup.vision is None:
        raise PictureError(refs[0].path, "this model has no vision encoder: it reads text only; send no pictures")
    return load_pictures(refs, setup.media) if refs else []


def prompt_ids(tokenizer, setup: ChatSetup, text: str, pictures: list[Picture],
               add_special_tokens: bool = False) -> tuple[list[int], tuple[PictureInput, ...]]:
    """A rendered chat's ids and its pictures' PictureInputs (their placeholder runs expanded)."""
    if not pictures:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]), ()
    return setup.vision.process(tokenizer, text, pictures, add_special_tokens)


def _tool_parser(setup: ChatSetup, tools: ToolPlan | None) -> ToolParser | None:
    if tools is None or not tools.parses_calls:
        return None
    if setup.tool_parser is None:
        raise FieldError("tools", "this model's chat template writes tool calls in no format the server knows; "
                         "start it with --tool-call-parser NAME (hermes, llama3_json, mistral, deepseek_v3), or "
                         "send tool_choice 'none'")
    return setup.tool_parser


def render_chat(tokenizer, messages: list[dict], tools: ToolPlan | None, *, template_kwargs: dict | None = None,
                add_generation_prompt: bool = True) -> str:
    """The chat template's text for `messages` (and `tools`). Calls in the history go in with their
    arguments as objects; a template that fails on that gets them as JSON text (DeepSeek's
    templates concatenate them)."""
    if tokenizer is None or not tokenizer.chat_template:
        raise FieldError("messages", "this model has no chat template; use /v1/completions")
    kwargs = _template_kwargs(template_kwargs)
    if tools is not None:
        kwargs["tools"] = list(tools.template_tools)
    messages = template_messages(messages)
    try:
        return _apply(tokenizer, messages, add_generation_prompt, kwargs)
    except TemplateRefused:
        if not any(m.get("tool_calls") for m in messages):
            raise
        return _apply(tokenizer, with_text_arguments(messages), add_generation_prompt, kwargs)


def _apply(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **kwargs)
    except Exception as exc:  # the template refused the conversation (roles, order, content, ...)
        raise TemplateRefused(f"{type(exc).__name__}: {exc}") from None


def _template_kwargs(values: dict | None) -> dict:
    if values is None:
        return {}
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise FieldError("chat_template_kwargs", f"must be an object, got {short_repr(values)}")
    reserved = sorted(set(values) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise FieldError("chat_template_kwargs", f"may not set {reserved[0]!r}")
    return dict(values)
