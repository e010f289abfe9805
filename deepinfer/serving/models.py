"""The models a server serves, by name: the base model and its LoRA adapters (vLLM's way).

Each adapter is a model of its own, chosen by a request's `model` field; `--lora-modules name=path`
registers adapters at start-up, and the runtime routes (entrypoints/openai/lora_routes.py) load and
unload them while the server runs. An adapter is checked (files, rank, target modules) before its
name is registered; a runtime load reads only from inside the `--lora-dir` directories. Unloading only
forgets the name: requests already admitted with it run to their end.
"""

from __future__ import annotations

import itertools
import os
import threading

from deepinfer.contracts.lora import LoRARequest
from deepinfer.model_executor.loader.lora_files import check_inside_dirs
from deepinfer.serving.errors import ServingError, not_found


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


def model_not_found(model: str, base_name: str, with_adapters: bool) -> ServingError:
    served = f"`{base_name}` and its LoRA adapters (GET /v1/models)" if with_adapters else f"`{base_name}`"
    error = not_found(f"The model `{model}` does not exist; this server serves {served}", "model",
                      code="model_not_found")
    error.type = "invalid_request_error"  # OpenAI's type for an unknown model
    return error

