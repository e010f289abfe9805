"""A `deepinfer serve` process on a free local port, for tests; always killed on exit."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RUN_CLI = "\nimport sys\nfrom deepinfer.entrypoints.cli import main\nsys.exit(main(sys.argv[1:]))\n"


class LiveServer:
    """Starts the server in a subprocess and waits for /health; use as a context manager.

    `prelude`: Python code the subprocess runs before the CLI (e.g. to monkeypatch the engine)."""

    def __init__(self, *args: str, api_key: str | None = None, startup_timeout: float = 180.0,
                 prelude: str | None = None):
        self.prelude = prelude
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.args = ["serve", "--port", str(self.port), "--log-level", "warning", *args]
        if api_key:
            self.args += ["--api-key", api_key]
        self.startup_timeout = startup_timeout
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __enter__(self) -> LiveServer:
        try:
            return self.start().wait_ready()
        except BaseException:
            self.kill()
            raise

    def start(self) -> LiveServer:
        from tiers import tier_marked

        tier_marked("live_server", "starts `deepinfer serve` as a subprocess")
        entry = ["-m", "deepinfer.entrypoints.cli"] if self.prelude is None else ["-c", self.prelude + _RUN_CLI]
        self.proc = subprocess.Popen([sys.executable, *entry, *self.args], stdout=self.log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self) -> LiveServer:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {self.startup_timeout} s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)

    def log_tail(self, num_chars: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-num_chars:]

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {'name{label="v",...}': value} (labels sorted as the server prints them)."""
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10.0).text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{label="v",...}': value}."""
    values = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def openai_client(server: LiveServer, api_key: str = "unused"):
    """The official `openai` client on `server`, without retries (a test sees the first answer)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)
