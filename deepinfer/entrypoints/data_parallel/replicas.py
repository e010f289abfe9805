"""The replicas behind a data-parallel front end: where each is, whether it is up, its load.

A replica is a whole `deepinfer serve` process (its own engine, KV cache and prefix cache) that
registers itself with the front end (POST /dp/register {rank, url}) once it listens, and again
every `HEARTBEAT_S` (so a restarted front end learns it again). The front end starts its local
replicas as child processes; remote ones are started by hand or by torchrun on other machines.

    up      registered and its last /health answered 200
    down    /health failed `MAX_MISSED` times in a row, a request to it failed in transport, or
            its child process exited; it is routed nothing until a health check answers again

A local child that exits after it was up is started again (on a new port; it registers anew), at
most `MAX_RESTARTS` times in `RESTART_WINDOW_S`; one that exits before it was ever up (a start-up
error) is not, and when every local child has exited for good the front end stops.

A replica's address is `scheme://host:port` and nothing else (`replica_url`): http or https, a host
name or IP address, a port; no credentials, path, query or fragment, no whitespace or control
character anywhere. Anything else is refused with its value escaped, so no log line shows it raw.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

HEARTBEAT_S = 5.0
MAX_RESTARTS, RESTART_WINDOW_S = 3, 300.0
HEALTH_INTERVAL_S = 1.0
MAX_MISSED = 2
_PR_SET_PDEATHSIG = 1
MAX_URL_CHARS = 512
_HOST_NAME = re.compile(r"(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")

logger = logging.getLogger("deepinfer.server")


@dataclass
class Replica:
    rank: int
    url: str = ""  # http://host:port, once registered
    process: subprocess.Popen | None = None  # a local child
    start: Callable[[], subprocess.Popen] | None = None  # starts a local child (again)
    up: bool = False
    was_up: bool = False  # registered since its process started
    in_flight: int = 0
    missed: int = 0
    restarts: list[float] = field(default_factory=list)  # when it was started again (monotonic s)

    @property
    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None


class ReplicaSet:
    """The `size` replicas by rank; the front end's event loop is the only writer. `on_down(rank)` is
    called whenever a replica that was up goes down (the front end forgets its routes and fails the
    requests still waiting on it)."""

    def __init__(self, size: int, on_down: Callable[[int], None] | None = None):
        self.replicas = {rank: Replica(rank) for rank in range(size)}
        self.on_down = on_down

    @property
    def size(self) -> int:
        return len(self.replicas)

    def register(self, rank: int, url: str) -> Replica:
        """A replica says where it listens. ValueError for a rank outside the set or a bad url."""
        if rank not in self.replicas:
            raise ValueError(f"data-parallel rank {rank} is outside --data-parallel-size {self.size} "
                             f"(ranks 0..{self.size - 1})")
        url = replica_url(url)
        replica = self.replicas[rank]
        if replica.url != url or not replica.up:
            logger.info("data-parallel replica %d up at %s", rank, url)
        replica.url, replica.missed = url, 0
        replica.up = replica.was_up = not replica.exited
        return replica

    def loads(self) -> dict[int, int]:
        """Requests in flight per replica that is up."""
        return {r.rank: r.in_flight for r in self.replicas.values() if r.up}

    def mark_down(self, rank: int, why: str) -> bool:
        """Stop routing to `rank`; True when it was up."""
        replica = self.replicas[rank]
        was_up, replica.up = replica.up, False
        if was_up:
            logger.warning("data-parallel replica %d down: %s", rank, why)
            if self.on_down is not None:
                self.on_down(rank)
        return was_up

    def health_result(self, rank: int, ok: bool) -> bool:
        """Record one health check; True when the replica just went down."""
        replica = self.replicas[rank]
        if replica.exited:
            return self.mark_down(rank, f"its process exited with status {replica.process.returncode}")
        if ok:
            replica.missed, replica.up = 0, bool(replica.url)
            return False
        replica.missed += 1
        return replica.missed >= MAX_MISSED and self.mark_down(rank, f"{replica.missed} health checks failed")

    def restart_exited(self, now: float) -> list[int]:
        """Start again each local child that exited after it was up, within the restart budget."""
        restarted = []
        for r in self.replicas.values():
            r.restarts = [t for t in r.restarts if now - t < RESTART_WINDOW_S]
            if not (r.exited and r.was_up and r.start is not None and len(r.restarts) < MAX_RESTARTS):
                continue
            self.mark_down(r.rank, f"its process exited with status {r.process.returncode}")
            logger.warning("starting data-parallel replica %d again (%d of %d in %.0f s)", r.rank,
                           len(r.restarts) + 1, MAX_RESTARTS, RESTART_WINDOW_S)
            r.process, r.url, r.was_up, r.missed = r.start(), "", False, 0
            r.restarts.append(now)
            restarted.append(r.rank)
        return restarted

    def all_local_exited(self) -> bool:
        """Every replica is a local child and every one has exited (the front end has nothing left)."""
        return all(r.exited for r in self.replicas.values())

    def stop_local(self, grace_s: float = 10.0) -> None:
        """SIGTERM every local child (each drains as `deepinfer serve` does), then SIGKILL stragglers."""
        children = [r.process for r in self.replicas.values() if r.process is not None and r.process.poll() is None]
        for child in children:
            child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()


def replica_url(url: str) -> str:
    """`url` as `scheme://host:port` (host lowercased, no trailing slash). ValueError naming `url` and
    its value, escaped and shortened, when it is anything else (see the module docstring)."""
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"url {_shown(url)} has {len(url)} characters; the limit is {MAX_URL_CHARS}")
    if any(not c.isprintable() or c.isspace() or not c.isascii() for c in url):
        raise ValueError(f"url {_shown(url)} holds whitespace, a control character or a non-ASCII character")
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. a bracketed host that is no IPv6 address
        raise ValueError(f"url {_shown(url)} is not a URL") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"url {_shown(url)} is not an http:// or https:// address")
    if "@" in parts.netloc:
        raise ValueError(f"url {_shown(url)} holds credentials; a replica's address has none")
    if parts.path not in ("", "/") or "?" in url or "#" in url:
        raise ValueError(f"url {_shown(url)} has a path, query or fragment; write scheme://host:port")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is None or not 0 < port < 65536:
        raise ValueError(f"url {_shown(url)} needs a port (1..65535): write scheme://host:port")
    host = _host(parts.hostname or "", parts.netloc)
    written = f"[{parts.hostname}]" if parts.netloc.startswith("[") else parts.hostname
    if host is None or parts.netloc.lower() != f"{written}:{port}":
        raise ValueError(f"url {_shown(url)} is not scheme://host:port with a host name or an IP address")
    return f"{parts.scheme.lower()}://{host}:{port}"


def _host(hostname: str, netloc: str) -> str | None:
    """The host as it goes into a URL (an IPv6 address in brackets), or None when it is not one."""
    if netloc.startswith("["):
        try:
            return f"[{ipaddress.IPv6Address(hostname)}]"
        except ValueError:
            return None
    return hostname if _HOST_NAME.fullmatch(hostname) else None


def _shown(value: str, limit: int = 100) -> str:
    """A client's value for a message or log line: escaped (ASCII only) and shortened."""
    return ascii(value[:limit]) + (f"... ({len(value)} characters)" if len(value) > limit else "")


def start_local_replica(rank: int, serve_argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`deepinfer serve` with `serve_argv` as a child that ends with this process (PDEATHSIG)."""
    return subprocess.Popen([sys.executable, "-m", "deepinfer.entrypoints.cli", "serve", *serve_argv],
                            env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)
