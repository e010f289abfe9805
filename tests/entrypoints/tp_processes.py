"""The processes a multi-rank command starts, read from Linux /proc: its children, which of them are
tensor-parallel workers (multiprocessing's spawn_main), and whether one still runs."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time


def children(pid: int) -> list[int]:
    """The processes `pid` started and that still exist (none once `pid` is gone)."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def is_worker(pid: int) -> bool:
    """A spawned rank (multiprocessing's spawn_main), not the resource tracker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except OSError:
        return False


def workers(pid: int) -> list[int]:
    return [c for c in children(pid) if is_worker(c)]


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def still_alive(pids: list[int], within_s: float = 0.0) -> list[int]:
    """The `pids` still running after waiting up to `within_s` for all of them to end."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def run_watching_workers(args: list[str], timeout_s: float) -> tuple[subprocess.CompletedProcess, set[int]]:
    """Run `args` to its end (killed after `timeout_s`), noting every worker it has meanwhile (polled
    every 50 ms); returns the finished process (text stdout, stderr) and the workers seen."""
    seen: set[int] = set()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                seen.update(workers(proc.pid))
                time.sleep(0.05)
        finally:
            proc.kill()
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(args, proc.returncode, out.read(), err.read()), seen
