"""The `deepinfer.entrypoints.bench` package: workloads, peers and report, with the peers loaded only
when one is asked for; `deepinfer bench --help` still works, and the llama.cpp peer's .mjs driver is
package data next to the module that runs it."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from deepinfer.entrypoints.bench.peers import node_llama_cpp

REPO_ROOT = Path(__file__).resolve().parents[2]
PEER_PREFIXES = ("deepinfer.entrypoints.bench.peers", "llama_cpp")

# Runs in a fresh interpreter: imports the package and the CLI, prints `deepinfer bench --help`, asks
# for the llama.cpp peer on a non-GGUF model (refused), and reports sys.modules at each point.
_PROBE = r"""
import json, sys
from types import SimpleNamespace

def loaded():
    return sorted(sys.modules)

import deepinfer
import deepinfer.entrypoints.cli as cli
report = {"import": loaded()}
try:
    cli.main(["bench", "--help"])
except SystemExit as exit_:
    report["help_exit"] = exit_.code
report["help"] = loaded()
from deepinfer.entrypoints.bench.peers import run_peer
from deepinfer.entrypoints.bench.common import Workload
try:
    run_peer("llama.cpp", SimpleNamespace(format="hf", path="/m"), Workload("w", [[1, 2]], [2]))
except ValueError as exc:
    report["refused"] = str(exc)
report["llama.cpp"] = loaded()
print("\nPROBE " + json.dumps(report))
"""


def _peer_modules(names: list[str]) -> list[str]:
    return [n for n in names if any(n == p or n.startswith(p + ".") for p in PEER_PREFIXES)]


def _probe() -> tuple[str, dict]:
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    help_text, _, report = proc.stdout.rpartition("\nPROBE ")
    return help_text, json.loads(report)


@pytest.mark.subprocess
def test_import_and_bench_help_load_no_peer_and_a_peer_loads_only_its_own_module():
    help_text, report = _probe()
    assert _peer_modules(report["import"]) == []
    assert report["help_exit"] == 0
    out = " ".join(help_text.split())
    for flag in ("--workload", "--peer", "--num-requests", "--window", "--prefix-len", "{serve}"):
        assert flag in out, flag
    assert "deepinfer.entrypoints.bench.workloads.serve" in report["help"]  # the bench parser was built
    assert _peer_modules(report["help"]) == []
    # asking for the llama.cpp peer loads its node-llama-cpp module, not the HF or llama-cpp-python one
    assert "needs a .gguf model, got '/m'" in report["refused"]
    assert _peer_modules(report["llama.cpp"]) == ["deepinfer.entrypoints.bench.peers",
                                                  "deepinfer.entrypoints.bench.peers.node_llama_cpp"]


def test_the_llama_cpp_driver_is_package_data_of_the_peers_package():
    script = node_llama_cpp.PEER_SCRIPT.resolve()
    assert script.is_file() and script.parent == Path(node_llama_cpp.__file__).resolve().parent
    package_data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = []
    for package, patterns in package_data.items():
        directory = REPO_ROOT.joinpath(*package.split("."))
        assert (directory / "__init__.py").is_file(), f"package-data key {package!r} is not a package"
        for pattern in patterns:
            matched = sorted(p.resolve() for p in directory.glob(pattern))
            assert matched, f"package-data {package!r}: {pattern!r} matches no file"
            shipped += matched
    assert script in shipped
    assert [p for p in shipped if fnmatch.fnmatch(p.name, "*.mjs")] == [script]


@pytest.mark.subprocess
def test_the_prefix_restart_child_starts_as_a_module_without_a_double_import():
    """The prefix workload's restart run is `python -m ...workloads.prefix --child SPEC`: the bench
    package must not have imported that module already (runpy would warn and run it twice)."""
    proc = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.bench.workloads.prefix", "--help"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "--child" in proc.stdout
    assert "RuntimeWarning" not in proc.stderr, proc.stderr
