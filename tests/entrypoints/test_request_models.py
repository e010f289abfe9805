"""Every request body the server validates stops at a container's first bad item.

pydantic validates every item of a list (and every value of a dict) and keeps an error object per
bad one, unless the field is fail-fast: a 7.5 MB body of 1.5 million wrong-typed items then costs
4.5 million error objects and seconds of the GIL (a union type tries each branch). So every list and
dict of every request model must be `Items[...]` / `Entries[...]` (`deepinfer.serving.parse`). The
models are found by importing every module of the server and of the serving package, not listed by
hand, so a new route's model is checked too.
"""

from __future__ import annotations

import importlib
import pkgutil
import types
import typing

import pytest
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

import deepinfer.entrypoints.openai
import deepinfer.serving
from deepinfer.serving.parse import STRICT, Entries, Items, parse_body


def _request_models() -> list[type[BaseModel]]:
    found = []
    for package in (deepinfer.serving, deepinfer.entrypoints.openai):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            found += [value for value in vars(module).values() if isinstance(value, type)
                      and issubclass(value, BaseModel) and value.__module__ == module.__name__]
    return sorted(set(found), key=lambda m: (m.__module__, m.__name__))


MODELS = _request_models()


def _unbounded(annotation, fail_fast: bool = False) -> list[str]:
    """The list and dict types inside `annotation` that are not fail-fast."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        marked = any(isinstance(m, FieldInfo) and _is_fail_fast(m) or type(m).__name__ == "FailFast"
                     for m in annotation.__metadata__)
        return _unbounded(args[0], marked)
    found = [] if origin not in (list, dict) or fail_fast else [repr(annotation)]
    if origin in (typing.Union, types.UnionType, list, dict):
        for arg in args:
            found += _unbounded(arg)
    return found


def _is_fail_fast(info: FieldInfo) -> bool:
    return any(type(m).__name__ == "FailFast" and m.fail_fast for m in info.metadata)


def test_the_server_has_request_models():
    names = {m.__name__ for m in MODELS}
    assert {"ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest", "MessagesRequest",
            "ResponsesRequest", "ChatBody", "RerankRequest", "InfillRequest", "TokenizeRequest"} <= names, names


@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"{m.__module__.rsplit('.', 1)[-1]}.{m.__name__}")
def test_every_list_and_dict_field_is_fail_fast(model):
    for name, field in model.model_fields.items():
        annotation = typing.Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        assert not _unbounded(annotation), f"{model.__name__}.{name}: {_unbounded(annotation)}"


def test_the_check_can_fail():
    class Loose(BaseModel):
        model_config = STRICT
        items: list[int]
        bounded: Items[Items[int]] | Entries[str, list[str]]

    assert _unbounded(Loose.model_fields["items"].annotation) == ["list[int]"]
    assert _unbounded(Loose.model_fields["bounded"].annotation) == ["list[str]"]


def test_a_million_wrong_items_give_a_few_errors():
    """The reason: the validation error of a 1.5-million-item wrong-typed list counts a few errors."""
    class Body(BaseModel):
        model_config = STRICT
        input: str | Items[str] | Items[int] | Items[Items[int]]

    with pytest.raises(ValidationError) as loose:
        Body.model_validate({"input": [None] * 100})
    assert loose.value.error_count() <= 4
    error = None
    try:
        parse_body(b'{"input": [' + b"null," * 1_500_000 + b"null]}", Body)
    except Exception as exc:  # noqa: BLE001 - the ServingError is the point
        error = exc
    assert error is not None and error.status_code == 400 and error.path[0] == "input", error
