"""The llama.cpp peer of `deepinfer bench` (bench.peers.node_llama_cpp, llama_cpp_peer.mjs): the job built
from a workload, the parsed result, the errors without node or npm, the subprocess round trip
through a stand-in for node, and (slow) node-llama-cpp itself on the embedded model."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepinfer.entrypoints.bench import peers
from deepinfer.entrypoints.bench.common import Workload
from deepinfer.entrypoints.bench.peers import node_llama_cpp as nlc
from deepinfer.entrypoints.bench.workloads import make_workload

VOCAB = 49152


def _tiny_workload() -> Workload:
    return Workload("tiny", [[1, 2, 3, 4], [5, 6, 7]], [3, 5])


def _result_line(workload: Workload, **extra) -> str:
    info = {"seconds": 0.5, "output_tokens": workload.num_output_tokens, "threads": 2, "parallel": 1,
            "ctx_size": 256, "node_llama_cpp_version": "3.21.1", "llama_cpp_release": "v0.4.0",
            "build_type": "prebuilt", "cpu_variant": "zen4"} | extra
    return json.dumps(info)


def _only_node(path: str | None):
    """A shutil.which that finds `node` at `path` (None: nowhere) and nothing else."""
    return lambda tool: path if tool == "node" else None


def test_job_carries_the_workload_token_ids_and_a_context_that_fits_every_request():
    workload = make_workload("cpu32", VOCAB, num_requests=4)
    job = nlc.build_job("/m.gguf", workload, parallel=16)
    assert job["model_path"] == "/m.gguf" and job["threads"] == 2 and job["parallel"] == 16
    assert job["prompts"] == workload.prompts and job["output_lens"] == workload.output_lens
    need = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    assert job["ctx_size"] % nlc.CTX_ALIGN == 0 and need <= job["ctx_size"] < need + nlc.CTX_ALIGN
    assert json.loads(json.dumps(job)) == job  # plain JSON
    # The workloads' requests (prompt + output <= 512 tokens) fit a 512-token sequence.
    assert nlc.context_size(make_workload("cpu32", VOCAB)) <= 512
    assert nlc.context_size(make_workload("decode1", VOCAB)) == 256


def test_job_refuses_a_workload_that_may_stop_at_eos_and_bad_counts():
    with pytest.raises(ValueError, match="ignore_eos=False"):
        nlc.build_job("/m.gguf", Workload("w", [[1]], [4], ignore_eos=False), parallel=1)
    with pytest.raises(ValueError, match="parallel=0"):
        nlc.build_job("/m.gguf", _tiny_workload(), parallel=0)


def test_result_becomes_a_bench_result_per_mode():
    workload = _tiny_workload()
    result, info = nlc.parse_result("llama.cpp noise\n" + _result_line(workload) + "\n", workload, parallel=1)
    assert (result.engine, result.workload, result.seconds, result.output_tokens, result.batch) == (
        "llama.cpp", "tiny", 0.5, 8, 1)
    assert info["cpu_variant"] == "zen4"
    result, _ = nlc.parse_result(_result_line(workload, parallel=16), workload, parallel=16)
    assert result.engine == nlc.ENGINE_PARALLEL == "llama.cpp-np16" and result.batch == 16
    line = nlc.describe(info)
    assert "node-llama-cpp 3.21.1" in line and "CPU variant zen4" in line and "2 threads" in line


@pytest.mark.parametrize(("stdout", "match"), [
    ("", "printed no JSON result"),
    (_result_line(_tiny_workload(), output_tokens=7), "output_tokens=7, expected 8"),
    (_result_line(_tiny_workload(), seconds=0), "field seconds must be a positive number, got 0"),
])
def test_result_errors_name_the_field(stdout, match):
    with pytest.raises(RuntimeError, match=match):
        nlc.parse_result(stdout, _tiny_workload(), parallel=1)


def test_install_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv(nlc.DIR_ENV, raising=False)
    assert nlc.install_dir() == Path.home() / ".cache" / "deepinfer" / "node-llama-cpp"
    monkeypatch.setenv(nlc.DIR_ENV, str(tmp_path))
    assert nlc.install_dir() == tmp_path
    assert nlc.install_command(tmp_path) == ["npm", "i", "-E", "--prefix", str(tmp_path), "node-llama-cpp@3.21.1"]


def test_missing_node_is_a_clear_error_naming_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", _only_node(None))
    with pytest.raises(nlc.PeerSetupError, match=r"needs `node`.*npm i -E --prefix .* node-llama-cpp@3\.21\.1"):
        nlc.run_node_llama_cpp("/m.gguf", _tiny_workload(), directory=tmp_path)


def test_missing_npm_is_a_clear_error_when_the_package_is_not_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", _only_node("/usr/bin/node"))
    assert nlc.installed_version(tmp_path) is None
    with pytest.raises(nlc.PeerSetupError, match=rf"needs `npm`.*npm i -E --prefix {tmp_path} node-llama-cpp@3"):
        nlc.ensure_installed(tmp_path)


def test_installed_package_is_not_reinstalled(monkeypatch, tmp_path):
    package = tmp_path / "node_modules" / "node-llama-cpp"
    package.mkdir(parents=True)
    (package / "package.json").write_text(json.dumps({"version": nlc.NODE_LLAMA_CPP_VERSION}))
    monkeypatch.setattr(shutil, "which", _only_node(None))  # no npm: must not be needed
    assert nlc.ensure_installed(tmp_path) == tmp_path


def _fake_node(tmp_path: Path, body: str) -> str:
    """An executable standing in for node: a shell script with `body`."""
    script = tmp_path / "node"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_job_goes_in_on_stdin_and_the_result_comes_back(monkeypatch, tmp_path):
    """A stand-in node saves its stdin and arguments and prints a result line."""
    workload = _tiny_workload()
    node = _fake_node(tmp_path, f'cat > "{tmp_path}/job.json"\necho "$@" > "{tmp_path}/args"\n'
                                f"echo 'loading...'\necho '{_result_line(workload, parallel=16)}'\n")
    monkeypatch.setattr(shutil, "which", _only_node(node))
    monkeypatch.setattr(nlc, "installed_version", lambda directory: nlc.NODE_LLAMA_CPP_VERSION)
    result, info = nlc.run_node_llama_cpp("/m.gguf", workload, parallel=16, directory=tmp_path)
    assert result.engine == "llama.cpp-np16" and result.output_tokens == 8 and info["build_type"] == "prebuilt"
    assert json.loads((tmp_path / "job.json").read_text()) == nlc.build_job("/m.gguf", workload, 16)
    assert (tmp_path / "args").read_text().split() == [str(nlc.PEER_SCRIPT), str(tmp_path)]


def test_a_failing_peer_reports_its_stderr(monkeypatch, tmp_path):
    node = _fake_node(tmp_path, "cat > /dev/null\necho 'llama_cpp_peer: boom' >&2\nexit 1\n")
    monkeypatch.setattr(shutil, "which", _only_node(node))
    with pytest.raises(RuntimeError, match=r"failed \(exit 1\): llama_cpp_peer: boom"):
        nlc.run_job({}, tmp_path)


def test_peer_runs_both_modes_on_several_requests_and_one_on_decode1(monkeypatch, capsys):
    calls = []

    def fake_run(model_path, workload, parallel=1):
        calls.append((workload.name, parallel))
        info = json.loads(_result_line(workload, parallel=parallel))
        return nlc.parse_result(json.dumps(info), workload, parallel)

    monkeypatch.setattr(nlc, "run_node_llama_cpp", fake_run)
    monkeypatch.setattr(shutil, "which", _only_node("/usr/bin/node"))
    source = SimpleNamespace(format="gguf", path="/m.gguf")
    cpu32 = peers.run_peer("llama.cpp", source, make_workload("cpu32", VOCAB, num_requests=4))
    decode1 = peers.run_peer("llama.cpp", source, make_workload("decode1", VOCAB))
    assert [r.engine for r in cpu32] == ["llama.cpp", "llama.cpp-np16"] and [r.engine for r in decode1] == ["llama.cpp"]
    assert calls == [("cpu32", 1), ("cpu32", 16), ("decode1", 1)]
    assert capsys.readouterr().out.count("peer     llama.cpp") == 3


def test_peer_without_node_or_llama_cpp_python_is_a_clear_error(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "llama_cpp" else find_spec(name, *args))
    monkeypatch.setattr(shutil, "which", _only_node(None))
    with pytest.raises(ValueError, match="needs `node`"):
        peers.run_llama_cpp(SimpleNamespace(format="gguf", path="/m.gguf"), _tiny_workload())
    with pytest.raises(ValueError, match="needs a .gguf model"):
        peers.run_llama_cpp(SimpleNamespace(format="hf", path="/m"), _tiny_workload())


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_the_node_script_checks_the_job_before_loading_anything(tmp_path):
    """The .mjs validates the job first, so a bad field fails fast and names itself."""
    job = nlc.build_job("/m.gguf", _tiny_workload(), parallel=1) | {"ctx_size": 7}
    with pytest.raises(RuntimeError, match=r"ctx_size = 7 is too small for request 1: 3 prompt \+ 5 output"):
        nlc.run_job(job, tmp_path)
    with pytest.raises(RuntimeError, match=r"job field threads must be an integer >= 1, got \"2\""):
        nlc.run_job(job | {"ctx_size": 256, "threads": "2"}, tmp_path)


@pytest.fixture(scope="module")
def node_llama_cpp_dir() -> Path:
    """The package `make peers` installs. This peer is an optional benchmark tool (a 730 MB npm
    install with its GPU variants), so the suite does not install it: without it, this test is
    skipped with the command that installs it."""
    directory = nlc.install_dir()
    if nlc.installed_version(directory) is None:
        pytest.skip(f"node-llama-cpp is not installed in {directory}: run `make peers`")
    return nlc.ensure_installed(directory)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_node_llama_cpp_generates_exactly_the_requested_tokens(node_llama_cpp_dir, default_gguf_path):
    """2 tiny requests on the embedded model, one at a time and as 2 parallel sequences; 1 thread,
    so that llama.cpp's spinning thread barrier does not stall on a shared machine."""
    workload = _tiny_workload()
    for parallel in (1, 2):
        result, info = nlc.run_node_llama_cpp(default_gguf_path, workload, parallel=parallel, threads=1,
                                              directory=node_llama_cpp_dir)
        assert result.output_tokens == 8 and result.seconds > 0 and result.batch == parallel
        assert info["node_llama_cpp_version"] == "3.21.1" and info["build_type"] == "prebuilt"
        assert info["parallel"] == parallel and info["threads"] == 1 and info["ctx_size"] >= 8
