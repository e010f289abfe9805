"""Tool-call parsers, one per wire format, and the choice of one for a model.

    hermes        <tool_call>{"name": ..., "arguments": ...}</tool_call>        Hermes, Qwen 2.5 / 3
    llama3_json   {"name": ..., "parameters": ...} (after <|python_tag|>)      Llama 3.1 / 3.2 / 3.3
    mistral       [TOOL_CALLS][{"name": ..., "arguments": ...}]                 Mistral, Mixtral
                  (or [TOOL_CALLS]name[ARGS]{...} per call, when the template writes [ARGS])
    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>... DeepSeek V3 / R1

`--tool-call-parser auto` (the default) picks the format the model's chat template writes (its
markers, checked in DETECTION_ORDER); a name picks that parser whatever the template says.
With `tool_choice` "auto" the chosen parser is wrapped in `LenientToolParser` (`lenient.py`):
a fenced or bare JSON call of one of the request's tools counts too. Markers that are one added
token of the tokenizer are referred to by id in grammars (`special_token_ids`).
"""

from __future__ import annotations

from deepinfer.serving.chat.tool_parsers.base import FunctionSpec, ParsedToolCalls, ToolParser
from deepinfer.serving.chat.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from deepinfer.serving.chat.tool_parsers.hermes import HermesToolParser
from deepinfer.serving.chat.tool_parsers.llama3 import Llama3JsonToolParser
from deepinfer.serving.chat.tool_parsers.mistral import MistralToolParser
from deepinfer.serving.chat.tool_parsers.stream import ToolCallStream

# the most specific markers first: a template may mention another format's markers in passing
DETECTION_ORDER: tuple[type[ToolParser], ...] = (DeepSeekV3ToolParser, MistralToolParser, HermesToolParser,
                                                Llama3JsonToolParser)
TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in DETECTION_ORDER}
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS)

__all__ = ["DETECTION_ORDER", "TOOL_PARSERS", "TOOL_PARSER_CHOICES", "FunctionSpec", "ParsedToolCalls",
           "ToolCallStream", "ToolParser", "chat_template_text", "detect_tool_parser", "make_tool_parser",
           "skipped_when_decoded", "special_token_ids"]


def chat_template_text(tokenizer) -> str:
    """The tokenizer's chat template(s) as one text ("" without one; a dict of named templates joined)."""
    template = tokenizer.chat_template if tokenizer is not None else None
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def detect_tool_parser(chat_template: str) -> type[ToolParser] | None:
    """The format a chat template writes tool calls in, or None when none is recognised."""
    return next((cls for cls in DETECTION_ORDER if cls.detect(chat_template)), None)


def special_token_ids(tokenizer, texts) -> dict[str, int]:
    """{text: id} for those of `texts` that are one added token of `tokenizer`, special or not
    (a GGUF's USER_DEFINED tokens, Qwen's `<tool_call>` and `<think>`, are added but not special).
    llguidance lexes every added token as a special token, which no string literal matches, so
    grammars refer to these by id (`<[id]>`)."""
    if tokenizer is None:
        return {}
    decoder = tokenizer.added_tokens_decoder or {}
    added = {token.content: token_id for token_id, token in decoder.items()}
    return {text: added[text] for text in texts if text in added}


def skipped_when_decoded(tokenizer, token_ids) -> bool:
    """Whether decoding drops any of `token_ids` (a special token) unless special tokens are kept."""
    if tokenizer is None:
        return False
    decoder = tokenizer.added_tokens_decoder or {}
    special = set(tokenizer.all_special_ids)
    return any(t in special or (t in decoder and decoder[t].special) for t in token_ids)


def make_tool_parser(name: str, tokenizer) -> ToolParser | None:
    """The parser `--tool-call-parser NAME` asks for on this tokenizer: `auto` detects it from the
    chat template (None when no format is recognised). ValueError naming the flag for an unknown name."""
    template = chat_template_text(tokenizer)
    if name == "auto":
        cls = detect_tool_parser(template)
    elif name in TOOL_PARSERS:
        cls = TOOL_PARSERS[name]
    else:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSER_CHOICES)}, got {name!r}")
    if cls is None:
        return None
    return cls(special_token_ids(tokenizer, cls.markers), template)
