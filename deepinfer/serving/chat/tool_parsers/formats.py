"""The pieces tool-call formats are built of: calls that follow a marker (`scan_sections`), calls written
as JSON objects `{"name": ..., "arguments": {...}}` (`scan_call_object`), and the grammar of such a call
(`call_object_schema`, `json_rule`)."""

from __future__ import annotations

import copy
import json

from deepinfer.engine.detokenizer import partial_stop_len
from deepinfer.serving.chat.tool_parsers.base import CallScan, FunctionSpec, Scan
from deepinfer.serving.chat.tool_parsers.json_scan import Invalid, scan_object

# the arguments' JSON is generated as json.dumps writes it: a small model given free whitespace
# may write newlines until max_tokens
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def scan_call_object(text: str, pos: int, arguments_keys: tuple[str, ...]) -> tuple[CallScan, int | None]:
    """The call written as a JSON object `{"name": ..., <an arguments key>: {...}}` at `pos` ('{'):
    the call so far and the index past its closing brace (None while open). Invalid for another
    key, a name that is not a non-empty string, or a closed object without a name; a closed
    object without arguments has `{}`."""
    scan = scan_object(text, pos)
    if any(key != "name" and key not in arguments_keys for key in scan.keys):
        raise Invalid
    call = CallScan()
    if "name" in scan.members:
        call.name = json.loads(text[slice(*scan.members["name"])])
        if not isinstance(call.name, str) or not call.name:
            raise Invalid
    for key in arguments_keys:
        if key in scan.members:
            call.arguments = text[slice(*scan.members[key])]
        elif scan.open_key == key:
            call.arguments = text[scan.open_start:]
    if scan.end is not None:
        if call.name is None:
            raise Invalid
        call.arguments = call.arguments or "{}"
    return call, scan.end


def call_object_schema(fn: FunctionSpec, arguments_key: str) -> dict:
    """The schema of `{"name": fn.name, arguments_key: <arguments>}`, name first; the arguments'
    `$defs` move to the root, where their `#/$defs/...` references point."""
    arguments = copy.deepcopy(fn.parameters)
    schema = {"type": "object", "properties": {"name": {"const": fn.name}, arguments_key: arguments},
              "required": ["name", arguments_key], "additionalProperties": False}
    for key in ("$defs", "definitions"):
        if key in arguments:
            schema[key] = arguments.pop(key)
    return styled(schema)


def styled(schema: dict) -> dict:
    """`schema` with the JSON_STYLE options (llguidance's `x-guidance`) at its root."""
    return {**schema, "x-guidance": JSON_STYLE}


def json_rule(schema: dict) -> str:
    return "%json " + json.dumps(schema)


def scan_sections(text: str, final: bool, marker: str, section) -> Scan:
    """The scan of a format whose calls follow `marker`: the text before each marker is content, and
    `section(text, pos past the marker, final, scan)` adds the calls after it and returns the index past
    them (None while they are still being written; Invalid when they are not calls). The text after the
    last section is content, less what may be the start of another marker while more may come."""
    scan, pos = Scan(), 0
    while True:
        start = text.find(marker, pos)
        if start < 0:
            tail = text[pos:]
            scan.content += tail if final else tail[:len(tail) - partial_stop_len(tail, (marker,))]
            return scan
        scan.content += text[pos:start]
        try:
            pos = section(text, start + len(marker), final, scan)
        except Invalid:
            scan.failed_at = start
            return scan
        if pos is None:  # the section is still being written
            return scan
