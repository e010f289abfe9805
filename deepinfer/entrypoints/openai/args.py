"""The flags of `deepinfer serve` (beside the engine flags); light to import."""

from __future__ import annotations

import argparse


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    g.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: --model as given, or the default model's name)")
    g.add_argument("--max-waiting", type=int, default=256,
                   help="waiting requests above which new ones get 429 with Retry-After")
    g.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger bodies get 413")
    g.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds to finish (then abort) running requests on SIGINT/SIGTERM")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
