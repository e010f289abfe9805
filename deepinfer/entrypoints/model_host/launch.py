"""`deepinfer serve` as a model host: several models on one address, each loaded on demand.

    deepinfer serve --models-dir DIR                  every GGUF file and HF folder in DIR
    deepinfer serve --model a.gguf --model b.gguf     the models given
    deepinfer serve --all-models                      what `deepinfer list` shows

Each model runs in a child `deepinfer serve --model PATH` (its own engine, prefix cache and saved
cache) on a free 127.0.0.1 port, started by the first request that names it and stopped when its
keep-alive runs out, when it must make room (`--max-loaded-models`, `--models-memory`), or when the
host stops. A child gets every flag of the command but the host's own (HOST_FLAGS) and the address.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import subprocess
import sys

from deepinfer.entrypoints.data_parallel.identity import HOST_SECRET_ENV
from deepinfer.entrypoints.model_host.catalog import build_catalog
from deepinfer.entrypoints.model_host.load_priority import child_env, lower_for_load

logger = logging.getLogger("deepinfer.server")
# the host's own flags, with whether each takes a value; a child gets none of them
HOST_FLAGS = {"--models-dir": True, "--max-loaded-models": True, "--models-memory": True, "--keep-alive": True,
              "--all-models": False, "--load-timeout": True, "--model": True, "--served-model-name": True,
              "--host": True, "--port": True}


def hosts_models(args) -> bool:
    """Whether the command serves several models on demand (rather than one, loaded at start-up)."""
    return args.models_dir is not None or args.all_models or len(given_models(args.argv)) > 1


def given_models(argv: list[str]) -> list[str]:
    """Every --model value of the command line, in order (argparse keeps the last one only)."""
    found = []
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--model="):
            found.append(arg.split("=", 1)[1])
    return found


def child_argv(argv: list[str], model_path: str, name: str, port: int) -> list[str]:
    """The serve flags of the child serving `model_path` as `name` on 127.0.0.1:`port`."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in HOST_FLAGS:
            skip = HOST_FLAGS[flag] and "=" not in arg
            continue
        kept.append(arg)
    return [*kept, "--model", model_path, "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port)]


def start_child(argv: list[str], env: dict[str, str], model, port: int) -> subprocess.Popen:
    """A child `deepinfer serve` for `model` that ends with this process."""
    command = [sys.executable, "-m", "deepinfer.entrypoints.cli", "serve",
               *child_argv(argv, model.path, model.name, port)]
    return subprocess.Popen(command, env={**env, **child_env()},
                            preexec_fn=_child_setup if sys.platform == "linux" else None)


def _child_setup() -> None:
    """In the child before it executes: it ends with the host, and it loads as a batch job that lets
    the models that are answering run first (`load_priority`)."""
    from deepinfer.entrypoints.data_parallel.replicas import _die_with_parent

    _die_with_parent()
    lower_for_load()


def run_model_host(args) -> int:
    """Serve the catalog until a signal; the children are stopped on the way out."""
    import uvicorn

    from deepinfer.entrypoints.data_parallel.launch import free_port
    from deepinfer.entrypoints.model_host.app import build_host_app
    from deepinfer.entrypoints.model_host.host import ModelHost
    from deepinfer.entrypoints.model_host.runners import HostLimits, RunnerPool, keep_alive_seconds, memory_budget
    from deepinfer.entrypoints.openai.connections import ConnectionLimits, TimedH11Protocol
    from deepinfer.serving.tenancy import Credentials

    catalog = build_catalog(args.models_dir, given_models(args.argv), args.all_models)
    if args.max_loaded_models < 1:
        raise ValueError(f"--max-loaded-models must be >= 1, got {args.max_loaded_models}")
    limits = HostLimits(args.max_loaded_models, memory_budget(args.models_memory),
                        keep_alive_seconds(args.keep_alive, "--keep-alive"), args.load_timeout, args.max_waiting)
    secret = secrets.token_hex(32)
    env = {**os.environ, HOST_SECRET_ENV: secret}
    argv = args.argv[1:] if args.argv[:1] == ["serve"] else list(args.argv)  # the flags after `serve`
    pool = RunnerPool(limits, functools.partial(start_child, argv, env), free_port)
    host = ModelHost(catalog, pool, Credentials(args.api_key, args.admin_api_key), args.models_dir, secret)
    app = build_host_app(host, args.max_body_bytes)
    names = [m.name for m in catalog.all()]
    budget = "no memory budget" if limits.memory_budget is None else f"{limits.memory_budget / 2**30:.1f} GiB"
    print(f"deepinfer: serving {len(names)} models on demand ({', '.join(names[:8])}"
          f"{', ...' if len(names) > 8 else ''}) on http://{args.host}:{args.port}/v1; at most "
          f"{limits.max_loaded} loaded, {budget}, keep-alive {args.keep_alive}", flush=True)
    print(f"deepinfer: chat page http://{args.host}:{args.port}/  dashboard "
          f"http://{args.host}:{args.port}/dashboard", flush=True)
    limits_ = ConnectionLimits(args.timeout_keep_alive, args.timeout_request_header, args.timeout_request_body,
                               args.max_connections)
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                  timeout_keep_alive=limits_.keep_alive_s,
                                  http=functools.partial(TimedH11Protocol, limits=limits_))).run()
    return 0
