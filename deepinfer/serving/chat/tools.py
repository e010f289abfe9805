"""Function tools of a chat request: checking `tools` / `tool_choice` / `parallel_tool_calls`, the
history's calls as the chat template wants them, and the constraint of a forced call.

The checks take plain JSON values (what a body or `LLM.chat` holds) and raise `FieldError`, a
ValueError naming the field (`tools[1].function.name ...`): the server answers it with a 400
whose param is the field, `LLM.chat` raises it as is.

    tools            [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]
                     names of 1-64 letters, digits, `_`, `-`, each once; parameters a JSON schema of an
                     object (default: no arguments); at most MAX_TOOLS
    tool_choice      "none" | "auto" (default with tools) | "required" |
                     {"type": "function", "function": {"name": one of the tools}}
    parallel_tool_calls  false: a forced answer makes exactly one call (default true: one or more)
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

from deepinfer.json_bounds import parse_nested_json
from deepinfer.sampling_params import short_repr
from deepinfer.serving.chat.tool_parsers import FunctionSpec, ToolParser
from deepinfer.serving.errors import FieldError
from deepinfer.structured_output import StructuredOutputsParams

MAX_TOOLS = 128  # as OpenAI's API
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
_NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """A request's checked tools: `choice` is "none", "auto", "required" or "function" (`named`)."""

    functions: tuple[FunctionSpec, ...]
    template_tools: tuple[dict, ...]  # as the chat template gets them: OpenAI's shape
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def forced_functions(self) -> list[FunctionSpec]:
        return [f for f in self.functions if self.named is None or f.name == self.named]


def tool_plan(tools, tool_choice, parallel_tool_calls=None) -> ToolPlan | None:
    """The checked tools of a request (None: it offers none and forces none); FieldError otherwise."""
    functions = _functions(tools) if tools else []
    choice, named = _choice(tool_choice, {f.name for f in functions}, bool(functions))
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise FieldError("parallel_tool_calls", f"must be true or false, got {short_repr(parallel_tool_calls)}")
    if not functions:
        return None
    template_tools = tuple({"type": "function", "function": spec} for spec in _template_functions(tools))
    return ToolPlan(tuple(functions), template_tools, choice, named,
                    parallel=parallel_tool_calls is not False and named is None)


def _functions(tools) -> list[FunctionSpec]:
    if not isinstance(tools, list):
        raise FieldError("tools", f"must be a list of function tools, got {short_repr(tools)}")
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"has {len(tools)} tools; the limit is {MAX_TOOLS}")
    functions: list[FunctionSpec] = []
    for i, tool in enumerate(tools):
        spec = _function(i, tool)
        if any(f.name == spec.name for f in functions):
            raise FieldError(("tools", i, "function", "name"), f"{spec.name!r} is given twice")
        functions.append(spec)
    return functions


def _function(i: int, tool) -> FunctionSpec:
    where = ("tools", i)
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise FieldError(where, f"must be a function tool ({{\"type\": \"function\", \"function\": {{...}}}}); got "
                         f"type {short_repr(kind)}")
    unknown = sorted(set(tool) - {"type", "function"})
    function = tool.get("function")
    if unknown or not isinstance(function, dict):
        raise FieldError(where, "must hold `type` and a `function` object"
                         + (f"; unknown field {short_repr(unknown[0])}" if unknown else ""))
    unknown = sorted(set(function) - _FUNCTION_FIELDS)
    if unknown:
        raise FieldError((*where, "function"), f"has unknown field {short_repr(unknown[0])}")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FieldError((*where, "function", "name"), f"must be 1-64 letters, digits, underscores or dashes, "
                         f"got {short_repr(name)}")
    # null is absent (vLLM's Optional fields; the `llm` CLI sends "description": null for a bare function)
    description, strict = function.get("description"), function.get("strict")
    if not isinstance(description, (str, type(None))) or not isinstance(strict, (bool, type(None))):
        raise FieldError((*where, "function"), "description must be a string and strict a boolean")
    return FunctionSpec(name, _parameters((*where, "function", "parameters"), function.get("parameters")))


def _parameters(where: tuple, schema) -> dict:
    """The arguments' schema: an object schema (None: no arguments)."""
    if schema is None:
        return dict(_NO_ARGUMENTS)
    if not isinstance(schema, dict):
        raise FieldError(where, f"must be a JSON schema object, got {short_repr(schema)}")
    kind = schema.get("type", "object")
    if kind != "object":
        raise FieldError(where, f"must describe an object (the arguments), got type {short_repr(kind)}")
    return copy.deepcopy(schema)


def _template_functions(tools: list) -> list[dict]:
    return [{k: copy.deepcopy(v) for k, v in tool["function"].items() if v is not None} for tool in tools]


def _choice(tool_choice, names: set[str], has_tools: bool) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if has_tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise FieldError("tool_choice", f"must be 'none', 'auto', 'required' or a function, "
                             f"got {short_repr(tool_choice)}")
        if tool_choice != "none" and not has_tools:
            raise FieldError("tool_choice", f"{tool_choice!r} needs tools; the request has none")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise FieldError("tool_choice", f"must be 'none', 'auto', 'required' or "
                         f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {short_repr(tool_choice)}")
    if name not in names:
        raise FieldError("tool_choice", f"names the function {short_repr(name)}, which is not in tools")
    return "function", name


# -- the history: assistant calls and tool results ----------------------------------------------


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates want them: an assistant call's `arguments` as an object (the
    Hugging Face convention; OpenAI sends JSON text, read under the body's bounds by
    `parse_nested_json`). FieldError naming the call for arguments that are not JSON or nest too deep."""
    result = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            message = {**message, "tool_calls": [_template_call(i, j, call) for j, call in enumerate(calls)]}
        result.append(message)
    return result


def _template_call(i: int, j: int, call) -> dict:
    where = ("messages", i, "tool_calls", j)
    if isinstance(call, dict) and call.get("type", "function") != "function":
        raise FieldError((*where, "type"), f"must be 'function', got {short_repr(call.get('type'))}")
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise FieldError(where, "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = parse_nested_json(arguments, "") if arguments.strip() else {}
        except ValueError as exc:
            raise FieldError((*where, "function", "arguments"), str(exc).lstrip(": ")) from None
    elif arguments is None:
        arguments = {}
    return {"type": "function", **call, "function": {**function, "arguments": arguments}}


def with_text_arguments(messages: list[dict]) -> list[dict]:
    """The messages with calls' arguments as JSON text again (templates that concatenate them)."""
    result = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            message = {**message, "tool_calls": [
                {**call, "function": {**call["function"], "arguments": _as_text(call["function"]["arguments"])}}
                for call in calls]}
        result.append(message)
    return result


def _as_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


# -- a forced call ------------------------------------------------------------------------------


def forced_call_grammar(plan: ToolPlan, parser: ToolParser) -> str:
    """The Lark of the call(s) `plan` forces, in `parser`'s format; FieldError naming the function
    whose arguments' schema llguidance refuses."""
    functions = plan.forced_functions()
    for fn in functions:
        try:
            StructuredOutputsParams(json=fn.parameters)
        except ValueError as exc:
            raise schema_refused(plan, fn.name, exc) from None
    return parser.call_grammar(functions, plan.parallel)


def schema_refused(plan: ToolPlan, name: str, exc: ValueError) -> FieldError:
    """The refusal of function `name`'s argument schema (StructuredOutputsParams' message, which starts
    with `structured_output.json`) at the tool's `function.parameters`."""
    index = next(i for i, f in enumerate(plan.functions) if f.name == name)
    problem = str(exc).removeprefix("structured_output.json").lstrip(": ")
    return FieldError(("tools", index, "function", "parameters"), problem)
