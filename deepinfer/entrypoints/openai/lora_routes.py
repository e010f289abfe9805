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

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from deepinfer.contracts.lora import LoRARequest
from deepinfer.entrypoints.openai.body import read_body
from deepinfer.serving.errors import bad_request
from deepinfer.serving.parse import STRICT


def adapter_card(state, request: LoRARequest) -> dict:
    """An adapter's entry in /v1/models: its own id (also its root: never its path), the base model as parent."""
    return {"id": request.lora_name, "object": "model", "created": state.created, "owned_by": "deepinfer",
            "root": request.lora_name, "parent": state.settings.model_name, "max_model_len": state.max_model_len}


def lora_routes(state) -> APIRouter:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (only with --allow-runtime-lora-updating)."""
    router = APIRouter(prefix="/v1")

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = await state.pool.parse(await read_body(request), LoadAdapter)
        try:  # reads and hashes the adapter's files: off the event loop
            await asyncio.to_thread(state.adapters.load, body.lora_name, body.lora_path)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_path") from None
        return JSONResponse({"status": "ok", "message": f"LoRA adapter {body.lora_name!r} added"})

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body = await state.pool.parse(await read_body(request), UnloadAdapter)
        try:
            state.adapters.remove(body.lora_name)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_name") from None
        return JSONResponse({"status": "ok", "message": f"LoRA adapter {body.lora_name!r} removed"})

    return router


class UnloadAdapter(BaseModel):
    model_config = STRICT
    lora_name: str = Field(min_length=1)


class LoadAdapter(UnloadAdapter):
    lora_path: str = Field(min_length=1)
