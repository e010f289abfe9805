"""POST /api/pull and DELETE /api/delete of a model host: `deepinfer pull` and `deepinfer rm` behind
Ollama's routes (an operator key, when keys are set: both write to disk, and a pull reaches the Hub).

A pull goes where `deepinfer pull` puts it (a GGUF into --models-dir when the host has one, a
checkpoint into the Hugging Face cache) and is listed at once under the name it was pulled by. Its
answer is Ollama's NDJSON progress: `pulling manifest`, a line per file with `total` and
`completed`, then `success`, or one `{"error"}` line naming what failed. A delete unloads the model
and removes its files as `deepinfer rm` does (never a pip-shipped model, nor one outside the models
directory or the Hub cache), and unlists it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from deepinfer.entrypoints.model_host.catalog import HostedModel
from deepinfer.serving.errors import ServingError

PROGRESS_S = 0.5  # a progress line per download under way, this often


async def pull_lines(host, name: str):
    """The NDJSON lines of pulling `name`, ending with `success` or an error."""
    from deepinfer.entrypoints.models_cmd.inventory import default_models_dir
    from deepinfer.entrypoints.models_cmd.pull import download_errors, pull
    from deepinfer.model_executor.loader.hub import hub_cache_dir

    yield _line({"status": "pulling manifest"})
    task = asyncio.ensure_future(asyncio.to_thread(pull, name, None, host.models_dir))
    roots = [host.models_dir or default_models_dir(), hub_cache_dir()]
    while not task.done():  # the bytes written so far, as the download goes
        await asyncio.wait({task}, timeout=PROGRESS_S)
        for partial, size in await asyncio.to_thread(_partial_files, roots):
            yield _line({"status": f"pulling {os.path.basename(partial).removesuffix('.incomplete')}",
                         "completed": size})
    try:
        _, files = task.result()
    except (*download_errors(), ValueError, FileExistsError) as exc:
        yield _line({"error": f"pull {name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"})
        return
    for f in files:
        yield _line({"status": f"pulling {os.path.basename(f.path)}", "total": f.size, "completed": f.size})
    yield _line({"status": "verifying sha256 digest"})
    host.catalog.add(_pulled_model(name, files))
    yield _line({"status": "success"})


def _pulled_model(name: str, files) -> HostedModel:
    """The model a pull fetched, listed under `name`: a GGUF by its (first) file, a checkpoint by name."""
    ggufs = sorted(f.local_path for f in files if f.local_path.endswith(".gguf"))
    path = ggufs[0] if ggufs else name
    stats = [os.stat(f.local_path) for f in files if os.path.exists(f.local_path)]
    return HostedModel(name, path, sum(s.st_size for s in stats), max((s.st_mtime for s in stats), default=0.0),
                       "pulled")


def delete_model(host, model: HostedModel) -> None:
    """Remove `model`'s files as `deepinfer rm` does and unlist it; a 400 naming why it is kept."""
    from deepinfer.entrypoints.models_cmd.inventory import remove_model

    target = model.path if model.path.lower().endswith(".gguf") else model.name
    try:
        remove_model(target, host.models_dir)
    except (ValueError, FileNotFoundError) as exc:
        raise ServingError(400, str(exc), path="model") from None
    host.catalog.remove(model.name)


def _partial_files(roots: list[str]) -> list[tuple[str, int]]:
    """The downloads under way under `roots` (`*.incomplete` files written in the last few seconds)."""
    found, now = [], time.time()
    for root in roots:
        for folder, _, files in os.walk(root):
            for name in files:
                path = os.path.join(folder, name)
                if name.endswith(".incomplete") and not os.path.islink(path):
                    stat = os.stat(path)
                    if now - stat.st_mtime < 5 * PROGRESS_S:
                        found.append((path, stat.st_size))
    return found


def _line(body: dict) -> str:
    return json.dumps(body) + "\n"
