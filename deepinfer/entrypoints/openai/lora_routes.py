"""LoRA adapters served by name, as vLLM serves them.

Each adapter is a model of its own in `/v1/models` (`parent`: the base model's name) and is chosen by
a request's `model` field. `--lora-modules name=path ...` registers adapters at start-up; with
`--allow-runtime-lora-updating` two routes change the set while the server runs:

    POST /v1/load_lora_adapter     {"lora_name": ..., "lora_path": ...}   400: a bad adapter or a taken name
    POST /v1/unload_lora_adapter   {"lora_name": ...}                     400: an unknown name

A runtime load reads only from inside the directories of `--lora-dir` (the path and each of its files,
symlinks resolved; anything else is a 400 that says only that the path is outside them, whether or not
it exists). `--lora-modules` is the operator's own choice and may name any path. Either way the
files must be regular files (loader/lora_files.py), and /v1/models shows an adapter's name, never its
path.

An adapter is checked (files, rank, target modules) before its name is registered. Unloading only
forgets the name: requests already admitted with it run to their end (they hold the adapter's
content identity and path; its device slot stays pinned while they run).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deepinfer.contracts.lora import LoRARequest
from deepinfer.entrypoints.openai.body import parse_json, read_body
from deepinfer.entrypoints.openai.errors import APIError, bad_request
from deepinfer.model_executor.loader.lora_files import check_inside_dirs


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path` (the form of --lora-modules) -> (name, path); ValueError naming the value."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules takes NAME=PATH entries, got {text!r}")
    return name.strip(), path.strip()


class ServedAdapters:
    """The adapters this server serves, by name (thread-safe: routes read it on the tokenizer pool)."""

    def __init__(self, base_name: str, resolver=None, lora_dirs: tuple[str, ...] = ()):
        self.base_name, self.resolver, self.lora_dirs = base_name, resolver, tuple(lora_dirs)
        self._lock = threading.Lock()
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter and register it; ValueError naming what is wrong (a taken name, LoRA off,
        a missing or corrupt adapter, a rank above --max-lora-rank, targets the base lacks)."""
        if self.resolver is None:
            raise ValueError(f"cannot serve LoRA adapter {name!r}: start the server with --enable-lora")
        if name == self.base_name or self.get(name) is not None:
            raise ValueError(f"the model name {name!r} is already served")
        request = LoRARequest(name, next(self._ids), path, self.base_name)
        self.resolver.resolve(request)
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"the model name {name!r} is already served")
            self._by_name[name] = request
        return request

    def load(self, name: str, path: str) -> LoRARequest:
        """`add` for a runtime load: only a path inside the --lora-dir directories (ValueError that
        says no more than that otherwise)."""
        if self.resolver is None:
            raise ValueError(f"cannot serve LoRA adapter {name!r}: start the server with --enable-lora")
        check_inside_dirs(os.path.expanduser(path), name, self.lora_dirs)
        return self.add(name, path)

    def remove(self, name: str) -> None:
        with self._lock:
            if self._by_name.pop(name, None) is None:
                raise ValueError(f"no LoRA adapter named {name!r} is served")

    def get(self, name: str | None) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name) if name is not None else None

    def all(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())


def adapter_card(state, request: LoRARequest) -> dict:
    """An adapter's entry in /v1/models: its own id (also its root: never its path), the base model as parent."""
    return {"id": request.lora_name, "object": "model", "created": state.created, "owned_by": "deepinfer",
            "root": request.lora_name, "parent": state.settings.model_name, "max_model_len": state.max_model_len}


def lora_routes(state) -> APIRouter:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (only with --allow-runtime-lora-updating)."""
    router = APIRouter(prefix="/v1")

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = _body(parse_json(await read_body(request)), ("lora_name", "lora_path"))
        try:  # reads and hashes the adapter's files: off the event loop
            await asyncio.to_thread(state.adapters.load, body["lora_name"], body["lora_path"])
        except ValueError as exc:
            raise bad_request(str(exc), "lora_path") from None
        return JSONResponse({"status": "ok", "message": f"LoRA adapter {body['lora_name']!r} added"})

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body = _body(parse_json(await read_body(request)), ("lora_name",))
        try:
            state.adapters.remove(body["lora_name"])
        except ValueError as exc:
            raise bad_request(str(exc), "lora_name") from None
        return JSONResponse({"status": "ok", "message": f"LoRA adapter {body['lora_name']!r} removed"})

    return router


def _body(data, required: tuple[str, ...]) -> dict:
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    for field in required:
        if not isinstance(data.get(field), str) or not data[field]:
            raise bad_request(f"{field} must be a non-empty string, got {data.get(field)!r}", field)
    return data


def model_not_found(model: str, base_name: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist; this server serves `{base_name}` and its "
                    f"LoRA adapters (GET /v1/models)", param="model", code="model_not_found")
