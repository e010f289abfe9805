"""What the server says about its own choices: the start-up line on tool calls, and the error of a
forced call the server cannot constrain on this model.

    tool calls: the chat template takes tools in the hermes format (<tool_call>, a special token); parser: hermes
    tool calls: the chat template has no tool support; requests with tools are refused unless tool_choice is "none"

A forced call (`tool_choice` "required" or a named function) whose grammar llguidance refuses after
every function's schema was accepted on its own (tools.py checks those) fails because of the format
the server built from the model's chat template, not because of the request: the 400 says so, with
param `tool_choice` and code `unsupported_tool_choice`, as vLLM answers a choice a model cannot honour.
"""

from __future__ import annotations

import re

from deepinfer.serving.chat.tool_parsers import ToolParser, chat_template_text, detect_tool_parser
from deepinfer.serving.chat.tools import schema_refused
from deepinfer.serving.errors import FieldError, ServingError, from_field_error
from deepinfer.structured_output import StructuredOutputsParams

_TOOLS_VARIABLE = re.compile(r"\btools\b")
_REFUSED = 'requests with tools are refused unless tool_choice is "none"'


def tool_call_summary(tokenizer, requested: str, parser: ToolParser | None) -> str:
    """One line: the chat template's tool format (as `auto` detects it) and the parser the server
    uses (`requested`: the --tool-call-parser value; `parser`: what it made, None for no parser)."""
    template = chat_template_text(tokenizer)
    return f"tool calls: {_template_part(template, parser)}; {_parser_part(template, requested, parser)}"


def _template_part(template: str, parser: ToolParser | None) -> str:
    if not template:
        return "the model has no chat template (chat requests are refused; give one with --chat-template)"
    detected = detect_tool_parser(template)
    takes_tools = template_takes_tools(template)
    if detected is not None:
        fmt = _format(detected.name, detected.markers[0], parser)
        return f"the chat template takes tools in {fmt}" if takes_tools else \
            f"the chat template writes calls in {fmt} but never reads `tools`"
    if takes_tools:
        return "the chat template takes tools but writes calls in no format the server knows"
    return "the chat template has no tool support"


def _format(name: str, marker: str, parser: ToolParser | None) -> str:
    special = parser is not None and parser.name == name and marker in parser.special_ids
    return f"the {name} format ({marker}{', a special token' if special else ''})"


def _parser_part(template: str, requested: str, parser: ToolParser | None) -> str:
    if parser is None:
        return _REFUSED
    if requested == "auto":
        return f"parser: {parser.name}"
    detected = detect_tool_parser(template)
    other = f"; the template writes {detected.name}" if detected is not None and detected.name != parser.name else ""
    return f"parser: {parser.name} (--tool-call-parser{other})"


def template_takes_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (jinja's view; a word match when it does
    not parse, e.g. with an extension tag only transformers knows)."""
    try:
        from jinja2 import Environment, meta

        parsed = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except Exception:  # noqa: BLE001 — any parse failure: fall back to the word
        return bool(_TOOLS_VARIABLE.search(template))
    return "tools" in meta.find_undeclared_variables(parsed)


def forced_call_refused(parser: ToolParser | None, exc: Exception) -> ServingError:
    """The 400 of a forced call whose grammar (built by the server from the chat template's format)
    llguidance refused: the model's template is the reason, the param is tool_choice."""
    fmt = f"in the {parser.name} format " if parser is not None else ""
    return ServingError(400, f"the server cannot force a tool call with this model's chat template (the grammar "
                        f"of a call {fmt}was refused: {exc}); send tool_choice \"auto\" or \"none\"",
                        path="tool_choice", code="unsupported_tool_choice")


def forced_call_error(grammars, tools, parser: ToolParser | None, exc: Exception) -> ServingError:
    """The 400 of a forced call whose grammar was refused. The client's fault (naming the function's
    `tools[i].function.parameters`) when one forced function's argument schema is refused on its own;
    else the template's (`forced_call_refused`)."""
    for fn in tools.forced_functions() if tools is not None else ():
        try:
            grammars.prepare(StructuredOutputsParams(json=fn.parameters))
        except ValueError as own:
            refused: FieldError = schema_refused(tools, fn.name, own)
            return from_field_error(refused)
    return forced_call_refused(parser, exc)
