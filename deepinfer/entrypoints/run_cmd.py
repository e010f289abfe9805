"""`deepinfer run MODEL [PROMPT]`, as `ollama run`: the model pulled when it is not here yet, then a
chat with it (or, with PROMPT, one answer through its chat template, printed as it streams).

MODEL is whatever `deepinfer list` shows (a name, a GGUF path, a GGUF's stem in the models dir), a
path, a pip-shipped model's short name, or a Hugging Face name `deepinfer pull` takes (org/name,
org/name:TAG, org/name/file.gguf), pulled first when it is in neither place.
"""

from __future__ import annotations

import os
import sys


def add_run_args(run) -> None:
    run.add_argument("run_model", metavar="MODEL", help="a model `deepinfer list` shows, a path, or a Hugging Face "
                                                        "name to pull first (org/name, org/name:TAG)")
    run.add_argument("prompt", nargs="?", default=None,
                     help='one prompt to answer (through the chat template) and exit; "-" reads standard input; '
                          "without it, an interactive chat")
    run.add_argument("--system", default=None, help="system message")
    run.add_argument("--history-file", default=None, metavar="PATH", help="as `deepinfer chat --history-file`")


def resolve_run_model(name: str, models_dir: str | None = None, pull=None) -> str:
    """What --model should load for `name`: a path or a listed model as it is, else the pulled name.
    ValueError naming `name` when it is none of these."""
    from deepinfer.entrypoints.models_cmd.inventory import list_models
    from deepinfer.model_executor.loader.source import is_model_name

    if os.path.exists(os.path.expanduser(name)):
        return name
    for entry in list_models(models_dir).entries:
        stem = os.path.basename(entry.name).removesuffix(".gguf")
        if name in (entry.name, stem, f"{stem}:latest"):
            return entry.name if entry.source != "models-dir" else entry.path
    if not is_model_name(name):
        raise ValueError(f"model {name!r} is not here (`deepinfer list`) and is no Hugging Face name to pull "
                         "(org/name, org/name:TAG or org/name/file.gguf)")
    if pull is None:
        from deepinfer.entrypoints.models_cmd.pull import pull
    print(f"deepinfer: pulling {name}", file=sys.stderr, flush=True)
    pull(name, None, models_dir)
    return name
