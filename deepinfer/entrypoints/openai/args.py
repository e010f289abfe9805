"""The flags of `deepinfer serve` (beside the engine flags); light to import."""

from __future__ import annotations

import argparse
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the served name of the default model
GGUF_SUFFIX = ".gguf"


class JoinWithCommas(argparse.Action):
    """A repeatable string flag whose values join into one comma-separated string (`--api-key`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{previous},{values}" if previous else values)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", action=JoinWithCommas, default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1 routes; several keys: repeat the flag or "
                        "separate them with commas (each key is a client of its own for the fair share)")
    g.add_argument("--admin-api-key", action=JoinWithCommas, default=None, metavar="KEY",
                   help="an operator key (repeatable): accepted wherever --api-key keys are, sees every key's "
                        "stored responses and dashboard requests, may send any priority, and is the only key "
                        "the LoRA load/unload routes take")
    g.add_argument("--priority-range", default=None, metavar="MIN:MAX",
                   help="the `priority` values clients may send (lower is served first; either side may be "
                        "empty); default 0: (a client may lower its own requests' precedence, never raise it)")
    g.add_argument("--shared-prefix-cache", action="store_true",
                   help="let different API keys hit each other's cached prefixes (faster for a shared system "
                        "prompt; without it, with keys set, each key's prefixes are its own, so no key can time "
                        "another's prompts)")
    g.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models shows (default: a GGUF file's stem, the base "
                        "name of --model's directory, or the default model's name)")
    g.add_argument("--max-waiting", type=int, default=256,
                   help="waiting requests above which new ones get 429 with Retry-After")
    g.add_argument("--max-requests-per-client", type=int, default=None, metavar="N",
                   help="requests in flight per client (its peer address) above which its new ones "
                        "get 429 (default: --max-num-seqs + --max-waiting / 2)")
    g.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger bodies get 413")
    g.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds to finish (then abort) running requests on SIGINT/SIGTERM")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--log-stats-interval", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between the throughput lines (prompt and generation tokens/s, running and "
                        "waiting requests, KV cache usage) logged while the server is busy")
    g.add_argument("--disable-log-stats", action="store_true", help="log no throughput lines")
    add_agent_args(p)
    add_model_host_args(p)
    add_data_parallel_args(p)
    add_lora_args(p)
    add_media_args(p)
    add_connection_args(p)


def add_model_host_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several models on demand (as Ollama: each loaded on its first request)")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every GGUF file (by its stem; a split set once) and HF folder (by its name) in DIR, "
                        "each loaded on its first request; --model may repeat to add models, --all-models adds "
                        "what `deepinfer list` shows")
    g.add_argument("--all-models", action="store_true",
                   help="serve every model `deepinfer list` shows (pip-shipped, Hugging Face cache, models dir), "
                        "each loaded on its first request")
    g.add_argument("--max-loaded-models", type=int, default=3, metavar="N",
                   help="models loaded at once; a request for another unloads the least recently used idle one "
                        "(never one with requests in flight)")
    g.add_argument("--models-memory", default="auto", metavar="SIZE",
                   help="memory the loaded models may take together (e.g. 12GiB; auto: 90%% of what is free at "
                        "start-up; none: no budget); the least recently used idle models make room")
    g.add_argument("--keep-alive", default="5m", metavar="DURATION",
                   help="how long a model stays loaded after its last request (Ollama's keep_alive: 30s, 5m, 1h; "
                        "0 unloads after each answer; negative keeps it); a request's own keep_alive wins")
    g.add_argument("--load-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long a request waits for its model to load (or for room to load it) before a 503")


def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    from deepinfer.entrypoints.data_parallel.router import ROUTING_POLICIES

    g = p.add_argument_group("data parallelism (engine replicas behind one address)")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="engine replicas (processes) behind this server, which becomes their front end and "
                        "routes each request to the replica likely to hold its prefix, else the least loaded")
    g.add_argument("--data-parallel-size-local", type=int, default=None, metavar="L",
                   help="replicas the front end starts on this machine, ranks 0..L-1 (default: all N); the "
                        "others join with --data-parallel-address")
    g.add_argument("--data-parallel-address", default=None, metavar="HOST:PORT",
                   help="serve as a replica of the front end at HOST:PORT (it registers there once it listens)")
    g.add_argument("--data-parallel-rank", type=int, default=0, metavar="R",
                   help="this replica's rank among the front end's N (with --data-parallel-address)")
    g.add_argument("--data-parallel-routing", default="prefix", choices=ROUTING_POLICIES,
                   help="prefix: the replica that holds the prompt's first blocks unless it is overloaded, "
                        "else the least loaded; least-load; random (a baseline)")
    g.add_argument("--data-parallel-secret", default=None, metavar="SECRET",
                   help="the cluster secret (16+ printable ASCII characters): a front end accepts replicas that "
                        "it did not start only with it (without it, none), and a replica joining with "
                        "--data-parallel-address sends it; not an API key. Prefer --data-parallel-secret-file: "
                        "a command line is visible to other users of the machine")
    g.add_argument("--data-parallel-secret-file", default=None, metavar="FILE",
                   help="read the cluster secret from FILE (its first line)")
    g.add_argument("--data-parallel-read-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="a front end fails a request (504, or an error event ending its stream) whose replica "
                        "sends nothing for this long; a replica that fails its health checks fails its requests "
                        "at once")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters served")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served from the start, each a model of its own in "
                        "/v1/models, chosen by a request's `model` (needs --enable-lora)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter ({lora_name, lora_path}); "
                        "loads only from inside a --lora-dir")
    g.add_argument("--lora-dir", action="append", default=[], metavar="DIR",
                   help="a directory /v1/load_lora_adapter may load adapters from (repeatable); a lora_path "
                        "that resolves outside every --lora-dir is refused (without one, every runtime load is)")


def add_media_args(p: argparse.ArgumentParser) -> None:
    from deepinfer.serving.pictures import MAX_PICTURE_PIXELS, MAX_PICTURES_PER_REQUEST

    g = p.add_argument_group("pictures (vision models)")
    g.add_argument("--allowed-media-dir", default=None, metavar="DIR",
                   help="file:// picture URLs are read from inside DIR only (a path that resolves outside it, "
                        "through `..` or a symlink, is refused); without it every file:// picture is")
    g.add_argument("--allow-remote-media", action="store_true",
                   help="fetch http(s) picture URLs (no redirects, size-capped, 10 s timeout); off by default: "
                        "a server that fetches URLs for its clients can be made to reach its own network")
    g.add_argument("--max-picture-pixels", type=int, default=MAX_PICTURE_PIXELS, metavar="N",
                   help="width * height above which a picture is refused, read from its header before any "
                        f"pixel is decoded (default {MAX_PICTURE_PIXELS}: 4096 x 4096)")
    g.add_argument("--max-pictures-per-request", type=int, default=MAX_PICTURES_PER_REQUEST, metavar="N",
                   help=f"pictures one request may carry (default {MAX_PICTURES_PER_REQUEST})")


def media_settings(args) -> dict:
    """The picture flags as ServerSettings fields; ValueError naming a bad one."""
    for flag, value in (("--max-picture-pixels", args.max_picture_pixels),
                        ("--max-pictures-per-request", args.max_pictures_per_request)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.allowed_media_dir is not None and not os.path.isdir(args.allowed_media_dir):
        raise ValueError(f"--allowed-media-dir {args.allowed_media_dir!r} is not a directory")
    return {"allowed_media_dir": args.allowed_media_dir, "allow_remote_media": args.allow_remote_media,
            "max_picture_pixels": args.max_picture_pixels, "max_pictures_per_request": args.max_pictures_per_request}


def server_settings(args):
    """The ServerSettings of `deepinfer serve`'s flags; ValueError naming a bad flag (before the model loads)."""
    from deepinfer.entrypoints.data_parallel.launch import replica_secret
    from deepinfer.serving.admission import PriorityRange
    from deepinfer.serving.context import ServerSettings

    return ServerSettings(model_name=served_model_name(args), api_key=args.api_key, admin_api_key=args.admin_api_key,
                          max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
                          tokenizer_workers=args.tokenizer_workers, tool_call_parser=args.tool_call_parser,
                          max_requests_per_client=args.max_requests_per_client,
                          priority_range=PriorityRange.parse(args.priority_range) if args.priority_range
                          else PriorityRange(), shared_prefix_cache=args.shared_prefix_cache,
                          data_parallel_secret=replica_secret(args),
                          reasoning_parser=args.reasoning_parser, **lora_settings(args), **media_settings(args))


def served_model_name(args) -> str:
    """--served-model-name, else a GGUF file's stem (its base name without `.gguf`, local or on the
    hub), else the base name of --model's file or directory, else --model as given (a hub name such
    as org/name, or a short name), else the default's."""
    if args.served_model_name:
        return args.served_model_name
    if not args.model:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(args.model)) or args.model
    if base.lower().endswith(GGUF_SUFFIX) and len(base) > len(GGUF_SUFFIX):
        return base[:-len(GGUF_SUFFIX)]
    from deepinfer.model_executor.loader.source import is_model_name

    if not os.path.exists(os.path.expanduser(args.model)) and is_model_name(args.model):
        return args.model
    return base


def lora_settings(args) -> dict:
    """The ServerSettings fields of the LoRA flags: (name, path) pairs, the runtime switch and the
    directories runtime loads may read (each an existing directory, made absolute)."""
    from deepinfer.serving.models import parse_lora_module

    modules = tuple(parse_lora_module(m) for m in args.lora_modules or [])
    if modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    dirs = tuple(os.path.abspath(os.path.expanduser(d)) for d in args.lora_dir or [])
    if dirs and not args.allow_runtime_lora_updating:
        raise ValueError("--lora-dir only matters with --allow-runtime-lora-updating (the load route reads from it)")
    for directory in dirs:
        if not os.path.isdir(directory):
            raise ValueError(f"--lora-dir {directory!r} is not a directory")
    return {"lora_modules": modules, "allow_runtime_lora_updating": bool(args.allow_runtime_lora_updating),
            "lora_dirs": dirs}


def add_agent_args(p: argparse.ArgumentParser) -> None:
    from deepinfer.serving.chat.reasoning import REASONING_PARSER_CHOICES
    from deepinfer.serving.chat.tool_parsers import TOOL_PARSER_CHOICES

    g = p.add_argument_group("tool calls and reasoning")
    g.add_argument("--tool-call-parser", default="auto", choices=TOOL_PARSER_CHOICES,
                   help="the format of tool calls in the model's answers; auto: the one its chat template writes "
                        "(requests with tools get a 400 when it writes none the server knows)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_CHOICES,
                   help="split a <think>...</think> section off the answer into reasoning_content (default: none)")


def add_connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connections")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds after which a connection with no request under way is closed")
    g.add_argument("--timeout-request-header", type=float, default=10.0,
                   help="seconds a client has to send a request's headers, from their first byte (then 408)")
    g.add_argument("--timeout-request-body", type=float, default=60.0,
                   help="seconds a client has to send a request's body, once the headers are in (then 408)")
    g.add_argument("--max-connections", type=int, default=512,
                   help="open connections above this get 503 and are closed")
    g.add_argument("--tokenizer-workers", type=int, default=2,
                   help="threads that parse and tokenize request bodies off the event loop")
