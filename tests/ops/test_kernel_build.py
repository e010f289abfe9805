"""The CPU kernel build cache: one build per content, shared by checkouts and processes; the lock of
a dead builder is taken over; a failed build is logged and not retried by every process.

Most tests build a tiny library through the same builder (`load_library`), in subprocesses that
import separate copies of the package (as two checkouts would), with a stand-in compiler that
waits for a gate file before compiling, so each test controls when a build runs."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deepinfer.model_executor.layers.ops import cpu_kernels

PACKAGE = Path(cpu_kernels.__file__).resolve().parents[3]
TINY_SOURCE = 'extern "C" int tiny_answer() { return 42; }\n'
TINY_SCRIPT = textwrap.dedent("""
    import ctypes, logging, sys, time
    logging.basicConfig(level=logging.INFO, format="%(created).3f %(message)s")
    from deepinfer.model_executor.layers.ops import cpu_kernels
    print("module", cpu_kernels.__file__, flush=True)
    try:
        path = cpu_kernels.load_library("tiny", [sys.argv[1]], retry_failed=len(sys.argv) > 2)
    except cpu_kernels.KernelBuildError as exc:
        print("failed", exc, flush=True)
    else:
        print("loaded", path, ctypes.CDLL(path).tiny_answer(), flush=True)
""")
GATED_CXX = """#!/bin/sh
# A C++ compiler that waits for the file "gate" before it compiles or links, and counts those runs.
case " $* " in
  *" -c "*|*" -o "*)
    touch "{dir}/started"
    while [ ! -e "{dir}/gate" ]; do sleep 0.05; done
    echo run >> "{dir}/runs" ;;
esac
exec {cxx} "$@"
"""
BUILDING = "building CPU kernels"
WAITING = "waiting for another process's build"


class Proc:
    """A subprocess with its own process group; stdout and stderr go to one file."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str], log: Path):
        self.log = log
        with open(log, "w") as out:
            self.popen = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self.pid = self.popen.pid

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.popen.poll() is None or text in self.output(), f"exited without {text!r}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.output()}"
            time.sleep(0.05)
        return self.output()

    def finish(self, timeout: float = 120) -> str:
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout} s:\n{self.output()}")
        assert rc == 0, self.output()
        return self.output()

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait()


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory) -> list[Path]:
    """Two copies of the package, each with its own copy of the tiny library's source."""
    root = tmp_path_factory.mktemp("checkouts")
    for name in ("a", "b"):
        shutil.copytree(PACKAGE, root / name / "deepinfer", ignore=shutil.ignore_patterns("__pycache__"))
        (root / name / "tiny.cpp").write_text(TINY_SOURCE)
    return [root / "a", root / "b"]


@pytest.fixture
def sandbox(tmp_path):
    """(start(checkout, *args, cxx=True) -> Proc, the kernel cache, the gated compiler's folder)."""
    cache, gate_dir = tmp_path / "kernels", tmp_path / "cxx"
    gate_dir.mkdir()
    cxx = gate_dir / "c++"
    cxx.write_text(GATED_CXX.format(dir=gate_dir, cxx=shutil.which("c++")))
    cxx.chmod(0o755)
    procs: list[Proc] = []

    def start(checkout: Path, *args: str, script: str = TINY_SCRIPT, gated: bool = True) -> Proc:
        env = {k: v for k, v in os.environ.items() if k not in ("CXX", "DEEPINFER_CPU_ISA")}
        env.update(PYTHONPATH=str(checkout), DEEPINFER_KERNEL_CACHE=str(cache),
                   TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
        if gated:
            env["CXX"] = str(cxx)
        argv = [sys.executable, "-c", script, *args] if script else [sys.executable, *args]
        procs.append(Proc(argv, checkout, env, tmp_path / f"out{len(procs)}.txt"))
        return procs[-1]

    yield start, cache, gate_dir
    for proc in procs:
        proc.kill()


def _runs(gate_dir: Path) -> int:
    """How many times the gated compiler compiled or linked."""
    runs = gate_dir / "runs"
    return len(runs.read_text().splitlines()) if runs.exists() else 0


def _loaded(output: str) -> tuple[str, int]:
    match = re.search(r"^loaded (\S+) (\d+)$", output, re.M)
    assert match, output
    return match.group(1), int(match.group(2))


def _took_over(output: str, killed_build: bool) -> bool:
    """The process built at once, without waiting on a lock (it says when it waits: WAITING), and, after a
    killed build, removed torch's own lock (on which torch's load would wait forever) itself. Read from its
    log, not timed: a timing fails on a busy machine."""
    return (BUILDING in output and WAITING not in output
            and ("left by a build that was killed" in output) == killed_build)


def _snapshot(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.name != "build.lock"}


@pytest.mark.subprocess
def test_two_checkouts_share_one_build_and_the_second_says_it_waits(checkouts, sandbox):
    start, cache, gate_dir = sandbox
    a = start(checkouts[0], str(checkouts[0] / "tiny.cpp"))
    a.wait_for(BUILDING)
    b = start(checkouts[1], str(checkouts[1] / "tiny.cpp"))
    waited = b.wait_for(WAITING)
    assert f"held by pid {a.pid} on " in waited and str(cache) in waited and "build.lock" in waited
    (gate_dir / "gate").touch()
    out_a, out_b = a.finish(), b.finish()
    assert f"module {checkouts[0]}" in out_a and f"module {checkouts[1]}" in out_b
    assert _loaded(out_a) == _loaded(out_b) and _loaded(out_a)[1] == 42
    assert BUILDING not in out_b and _loaded(out_a)[0].startswith(str(cache))
    folder = Path(_loaded(out_a)[0]).parent
    before, runs = _snapshot(folder), _runs(gate_dir)
    assert runs >= 2 and (folder / "src" / "tiny.cpp").read_text() == TINY_SOURCE

    out_c = start(checkouts[1], str(checkouts[1] / "tiny.cpp")).finish()
    assert _loaded(out_c) == _loaded(out_a)
    assert BUILDING not in out_c and WAITING not in out_c
    assert _runs(gate_dir) == runs and _snapshot(folder) == before
    assert [p.name for p in cache.iterdir()] == [folder.name]


@pytest.mark.subprocess
def test_the_lock_of_a_build_killed_midway_is_taken_over_without_waiting(checkouts, sandbox):
    start, cache, gate_dir = sandbox
    source = str(checkouts[0] / "tiny.cpp")
    killed = start(checkouts[0], source)
    deadline = time.monotonic() + 60
    while not (gate_dir / "started").exists():
        assert time.monotonic() < deadline, killed.output()
        time.sleep(0.05)
    killed.kill()
    [folder] = cache.iterdir()
    assert (folder / "build" / "lock").exists()  # torch's own lock, on which torch's load waits forever
    (gate_dir / "gate").touch()
    out = start(checkouts[1], str(checkouts[1] / "tiny.cpp")).finish()
    assert _took_over(out, killed_build=True), out
    assert _loaded(out) == (str(folder / "tiny.so"), 42)
    assert not (folder / "build" / "lock").exists()


@pytest.mark.subprocess
def test_a_lock_file_left_by_a_dead_pid_is_taken_over_without_waiting(checkouts, sandbox, monkeypatch):
    start, cache, gate_dir = sandbox
    source = str(checkouts[0] / "tiny.cpp")
    monkeypatch.setenv("DEEPINFER_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("CXX", str(gate_dir / "c++"))
    folder = Path(cpu_kernels.library_folder("tiny", [source]))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    (folder / "build").mkdir(parents=True)
    (folder / "build.lock").write_text(f"pid {dead} on {os.uname().nodename}\n")
    (folder / "build" / "lock").write_text(dead)
    (gate_dir / "gate").touch()
    out = start(checkouts[1], str(checkouts[1] / "tiny.cpp")).finish()
    assert _took_over(out, killed_build=True), out  # torch's lock of the dead pid's build, removed
    assert _loaded(out) == (str(folder / "tiny.so"), 42)


@pytest.mark.subprocess
def test_a_failed_build_keeps_its_log_and_is_not_retried_by_every_process(checkouts, sandbox, tmp_path):
    start, cache, gate_dir = sandbox
    (gate_dir / "gate").touch()
    bad = tmp_path / "bad" / "tiny.cpp"
    bad.parent.mkdir()
    bad.write_text('extern "C" int tiny_answer( { return 42; }\n')
    first = start(checkouts[0], str(bad)).finish()
    match = re.search(r"^failed the build failed \(.*\); log: (\S+)$", first, re.M)
    assert match, first
    log = Path(match.group(1))
    assert log.parent.parent == cache and "error" in log.read_text()
    runs = _runs(gate_dir)
    assert runs >= 1

    again = start(checkouts[1], str(bad)).finish()
    assert BUILDING not in again and f"log: {log}" in again and "not retried" in again
    assert _runs(gate_dir) == runs

    retried = start(checkouts[1], str(bad), "retry").finish()
    assert BUILDING in retried and f"log: {log}" in retried and _runs(gate_dir) > runs


def test_no_compiler_falls_back_to_torch_with_a_line_that_says_how_to_fix_it(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("DEEPINFER_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with caplog.at_level("WARNING", logger="deepinfer.kernels"):
        isa, status = cpu_kernels._load.__wrapped__()
    assert isa == 0 and "no C++ compiler" in status and "no-such-c++" in status
    [record] = caplog.records
    line = record.getMessage()
    assert "\n" not in line and "apt-get install build-essential" in line and "DEEPINFER_CPU_ISA=none" in line
    assert not (tmp_path / "kernels").exists()


def test_the_kernel_cache_follows_its_variable_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_KERNEL_CACHE", str(tmp_path / "k"))
    assert cpu_kernels.kernel_cache_dir() == str(tmp_path / "k")
    monkeypatch.setenv("DEEPINFER_KERNEL_CACHE", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_kernels.kernel_cache_dir() == str(tmp_path / "xdg" / "deepinfer" / "kernels")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cpu_kernels.kernel_cache_dir() == str(tmp_path / "home" / ".cache" / "deepinfer" / "kernels")


@pytest.mark.subprocess
@pytest.mark.slow
def test_two_checkouts_started_at_once_build_the_real_kernels_once(checkouts, sandbox):
    start, cache, _ = sandbox
    install = ["-m", "deepinfer.model_executor.layers.ops.cpu_kernels"]
    a, b = (start(checkout, *install, script="", gated=False) for checkout in checkouts)
    outputs = [a.finish(timeout=600), b.finish(timeout=600)]
    assert sorted(BUILDING in out for out in outputs) == [False, True], outputs
    assert sorted(WAITING in out for out in outputs) == [False, True], outputs
    statuses = {out.strip().splitlines()[-1] for out in outputs}
    assert len(statuses) == 1 and statuses.pop().startswith("CPU kernels built for this CPU: "), outputs
    [folder] = cache.iterdir()
    before = _snapshot(folder)
    assert "deepinfer_cpu.so" in before and "build-failed.log" not in before

    third = start(checkouts[0], *install, script="", gated=False).finish(timeout=600)
    assert BUILDING not in third and WAITING not in third
    assert third.strip().splitlines()[-1] == outputs[0].strip().splitlines()[-1]
    assert _snapshot(folder) == before
