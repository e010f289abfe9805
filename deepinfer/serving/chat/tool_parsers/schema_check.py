"""A small JSON-schema check of a call's arguments, for the lenient reading of `tool_choice="auto"`
answers (`lenient.py`): is this JSON value what the function's `parameters` schema describes?

It knows the keywords function schemas use: `type` (one or a list), `enum`, `const`,
`properties`, `required`, `additionalProperties` (boolean or schema), `items`, `minItems` /
`maxItems`, `minLength` / `maxLength`, `minimum` / `maximum` / `exclusiveMinimum` /
`exclusiveMaximum`, `anyOf` / `oneOf` (as "any of") / `allOf`, and local `$ref`s
(`#/$defs/...`, `#/definitions/...`). Other keywords (`pattern`, `format`, ...) are not checked:
an answer is read as a call when nothing the check knows says otherwise. Nesting deeper than
MAX_DEPTH fails the check, and so does a check that takes more than MAX_STEPS schema visits: the
schema is the client's and is never compiled in auto mode, so `$ref`s inside `anyOf`s could make
the walk exponential. Pure Python, no dependency (jsonschema is a test dependency only).
"""

from __future__ import annotations

MAX_DEPTH = 64
MAX_STEPS = 20_000  # schema visits of one check
_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool)
    or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


class _OutOfSteps(Exception):
    pass


class _Root:
    """The schema `$ref`s resolve in, and the visits the check has left."""

    def __init__(self, schema: dict):
        self.schema, self.steps_left = schema, MAX_STEPS


def matches_schema(value, schema: dict) -> bool:
    """Whether `value` (parsed JSON) satisfies `schema`, as far as the keywords above go."""
    try:
        return _matches(value, schema, _Root(schema), 0)
    except _OutOfSteps:
        return False


def _matches(value, schema, root: _Root, depth: int) -> bool:
    root.steps_left -= 1
    if root.steps_left < 0:
        raise _OutOfSteps
    if depth > MAX_DEPTH:
        return False
    if schema is True or schema == {}:
        return True
    if not isinstance(schema, dict):
        return schema is not False
    if "$ref" in schema:
        target = _resolve(root, schema["$ref"])
        if target is None or not _matches(value, target, root, depth + 1):
            return False
    return (_type_ok(value, schema) and _values_ok(value, schema) and _combinators_ok(value, schema, root, depth)
            and _object_ok(value, schema, root, depth) and _array_ok(value, schema, root, depth)
            and _bounds_ok(value, schema))


def _resolve(root: _Root, ref) -> dict | bool | None:
    for prefix in ("#/$defs/", "#/definitions/"):
        if isinstance(ref, str) and ref.startswith(prefix):
            definitions = root.schema.get(prefix[2:-1])
            target = definitions.get(ref[len(prefix):]) if isinstance(definitions, dict) else None
            return target if isinstance(target, (dict, bool)) else None
    return None


def _type_ok(value, schema: dict) -> bool:
    kinds = schema.get("type")
    if kinds is None:
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return any(kind in _TYPES and _TYPES[kind](value) for kind in kinds)


def _values_ok(value, schema: dict) -> bool:
    if "const" in schema and not _same(value, schema["const"]):
        return False
    enum = schema.get("enum")
    return not isinstance(enum, list) or any(_same(value, option) for option in enum)


def _same(a, b) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _combinators_ok(value, schema: dict, root: _Root, depth: int) -> bool:
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and not any(_matches(value, s, root, depth + 1) for s in options):
            return False
    parts = schema.get("allOf")
    return not isinstance(parts, list) or all(_matches(value, s, root, depth + 1) for s in parts)


def _object_ok(value, schema: dict, root: _Root, depth: int) -> bool:
    if not isinstance(value, dict):
        return True
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if any(key not in value for key in required):
        return False
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        sub = properties.get(key, extra)
        if not _matches(item, sub, root, depth + 1):
            return False
    return True


def _array_ok(value, schema: dict, root: _Root, depth: int) -> bool:
    if not isinstance(value, list):
        return True
    if not _size_ok(len(value), schema, "minItems", "maxItems"):
        return False
    items = schema.get("items")
    return items is None or all(_matches(item, items, root, depth + 1) for item in value)


def _bounds_ok(value, schema: dict) -> bool:
    if isinstance(value, str):
        return _size_ok(len(value), schema, "minLength", "maxLength")
    if not _TYPES["number"](value):
        return True
    checks = (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
              ("exclusiveMinimum", lambda b: value > b), ("exclusiveMaximum", lambda b: value < b))
    return all(check(schema[key]) for key, check in checks
               if isinstance(schema.get(key), (int, float)) and not isinstance(schema.get(key), bool))


def _size_ok(size: int, schema: dict, low: str, high: str) -> bool:
    lower, upper = schema.get(low), schema.get(high)
    return (not isinstance(lower, int) or size >= lower) and (not isinstance(upper, int) or size <= upper)
