"""The model host's state (the catalog, the runners, the keys, the secret its children believe) and
what every route of it uses: a request passed to a model's child, the cards that list a model."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime

import httpx
from fastapi import Request
from fastapi.responses import Response
from starlette.datastructures import Headers

from deepinfer.entrypoints.model_host.catalog import Catalog, HostedModel, parameter_size
from deepinfer.entrypoints.model_host.relay import relay
from deepinfer.entrypoints.model_host.runners import RunnerPool
from deepinfer.serving.admission import client_key
from deepinfer.serving.errors import ServingError, not_found
from deepinfer.serving.tenancy import Credentials


class ModelHost:
    """The host's state: the catalog, the runners, the secret its children believe, the keys."""

    def __init__(self, catalog: Catalog, pool: RunnerPool, credentials: Credentials, models_dir: str | None,
                 secret: str, read_timeout_s: float = 600.0):
        self.catalog, self.pool, self.credentials, self.models_dir = catalog, pool, credentials, models_dir
        self.secret = secret  # in every child's environment: it believes x-deepinfer-client beside it
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.created = int(time.time())

    def client_of(self, request: Request) -> str:
        peer = request.scope.get("client")
        return client_key(Headers(scope=request.scope).getlist, peer[0] if peer else None, self.credentials)

    def model(self, name: str | None, field: str = "model") -> HostedModel:
        """The listed model `name` names; the one listed model when `name` is None; a 404 naming it."""
        if name is None:
            listed = self.catalog.all()
            if len(listed) == 1:
                return listed[0]
            raise ServingError(400, f"is required: this server lists {len(listed)} models (GET /v1/models)",
                               path=field)
        found = self.catalog.find(name)
        if found is None:
            error = not_found(f"The model `{name[:200]}` does not exist; GET /v1/models lists the models this "
                              "server serves", field, code="model_not_found")
            error.type = "invalid_request_error"
            raise error
        return found


async def forward(host: ModelHost, request: Request, raw: bytes, model: HostedModel,
                  keep_alive: float | None = None, touch: bool = True) -> Response:
    """`request` passed to `model`'s child (loaded first if need be). `touch`: the request counts as a use
    (it sets the model's expiry; a dashboard poll or a stored-response lookup does not)."""
    runner = await host.pool.acquire(model)

    async def done() -> None:
        await host.pool.release(runner, keep_alive, touch)

    return await relay(host.client, request, runner.url, raw, host.client_of(request),
                       host.secret, model.name, runner.gone, done)


def unloaded_reply(name: str, chat: bool) -> dict:
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    body = {"model": name, "created_at": now, "done": True, "done_reason": "unload"}
    return body | ({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})


def model_card(host: ModelHost, model: HostedModel) -> dict:
    """A /v1/models entry."""
    facts = host.catalog.facts(model)
    card = {"id": model.name, "object": "model", "created": host.created, "owned_by": "deepinfer", "root": model.name}
    if facts.context_length:
        card["max_model_len"] = facts.context_length
    return card


def ollama_card(host: ModelHost, model: HostedModel) -> dict:
    """What /api/tags and /api/ps tell of a model, from its files."""
    facts = host.catalog.facts(model)
    digest = hashlib.sha256(f"{model.path}\0{model.size}\0{model.modified}".encode()).hexdigest()
    details = {"parent_model": "", "format": "gguf" if model.path.lower().endswith(".gguf") else "safetensors",
               "family": facts.family, "families": [facts.family] if facts.family else [],
               "parameter_size": parameter_size(facts.parameter_count), "quantization_level": facts.quantization}
    modified = datetime.fromtimestamp(model.modified or host.created, UTC).isoformat().replace("+00:00", "Z")
    return {"name": model.name, "size": model.size, "digest": digest, "modified_at": modified, "details": details}
