"""Models named by their Hugging Face id, read from a Hub cache built on disk in huggingface_hub's
own layout (blobs named by content hash, snapshots of symlinks into them, refs naming commits).

No test touches the network: the cache is offline (HF_HUB_OFFLINE=1), or the Hub "endpoint" is
a closed local port.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from deepinfer.model_executor.loader import load_model_source
from deepinfer.model_executor.loader.hub import hub_cache_dir, parse_hub_name

REPO = "tiny-org/tiny-llama"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def add_snapshot(cache, repo_id: str, commit: str, source_dir: str, refs=()) -> str:
    """Put `source_dir`'s files into `cache` as snapshot `commit` of `repo_id`, as huggingface_hub does:
    each file is a blob named by its sha256, linked from snapshots/<commit>/; each ref names the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for name in os.listdir(source_dir):
        with open(os.path.join(source_dir, name), "rb") as f:
            blob = repo / "blobs" / hashlib.sha256(f.read()).hexdigest()
        if not blob.exists():
            shutil.copy(os.path.join(source_dir, name), blob)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return str(snapshot)


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_checkpoint):
    """An offline Hub cache holding REPO at two commits: A (seed 0, refs main) and B (seed 1, refs v2)."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # so that no local path called tiny-org/... exists
    dirs = {"A": tiny_checkpoint("llama"), "B": tiny_checkpoint("llama", seed=1)}
    add_snapshot(cache, REPO, COMMIT_A, dirs["A"], refs=["main"])
    add_snapshot(cache, REPO, COMMIT_B, dirs["B"], refs=["v2"])
    return cache, dirs


def _greedy(model, **kwargs) -> list[int]:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, num_blocks=32, block_size=8, max_model_len=64, **kwargs)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    llm.close()
    return out[0].outputs[0].token_ids


def test_name_generates_as_its_local_directory(hub):
    cache, dirs = hub
    assert _greedy(REPO) == _greedy(dirs["A"])


@pytest.mark.slow
def test_llm_revision_generates_as_that_snapshot(hub):
    _, dirs = hub
    tokens = _greedy(REPO, revision="v2")
    assert tokens == _greedy(dirs["B"]) and tokens != _greedy(dirs["A"])


def test_name_resolves_into_the_cache_snapshot(hub):
    cache, dirs = hub
    source = load_model_source(REPO)
    assert source.path == str(cache / f"models--tiny-org--tiny-llama/snapshots/{COMMIT_A}")
    assert source.format == "hf" and source.identity == load_model_source(dirs["A"]).identity


@pytest.mark.parametrize("revision, expected", [(None, "A"), ("main", "A"), ("v2", "B"),
                                                (COMMIT_B, "B"), (COMMIT_A, "A")])
def test_revision_picks_its_snapshot(hub, revision, expected):
    _, dirs = hub
    other = "B" if expected == "A" else "A"
    identity = load_model_source(REPO, revision=revision).identity
    assert identity == load_model_source(dirs[expected]).identity
    assert identity != load_model_source(dirs[other]).identity


def test_missing_model_is_one_line_naming_the_fix(hub):
    cache, _ = hub
    with pytest.raises(FileNotFoundError) as info:
        load_model_source("tiny-org/not-cached")
    message = str(info.value)
    assert "\n" not in message
    assert message == (f"model 'tiny-org/not-cached' is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE "
                       "is set: download it with `hf download tiny-org/not-cached` on a machine with network, "
                       "or pass a local directory")


def test_missing_revision_names_it(hub):
    with pytest.raises(FileNotFoundError, match=r"\(revision 'v9'\) is not in the Hugging Face cache .*"
                                                r"`hf download tiny-org/tiny-llama --revision v9`"):
        load_model_source(REPO, revision="v9")


def test_local_path_wins_over_a_name(hub, tmp_path):
    _, dirs = hub
    shutil.copytree(dirs["B"], tmp_path / REPO)  # ./tiny-org/tiny-llama exists (cwd is tmp_path)
    source = load_model_source(REPO)
    assert source.path == str(tmp_path / REPO)
    assert source.identity == load_model_source(dirs["B"]).identity
    with pytest.raises(ValueError, match="revision 'v2' applies to Hugging Face names"):
        load_model_source(REPO, revision="v2")


def test_gguf_file_of_a_repository(hub, tiny_gguf):
    cache, _ = hub
    path, _, _ = tiny_gguf("llama")
    folder = cache.parent / "gguf-repo"
    folder.mkdir()
    shutil.copy(path, folder / "tiny-llama.gguf")
    add_snapshot(cache, "tiny-org/tiny-GGUF", COMMIT_A, str(folder), refs=["main"])
    source = load_model_source("tiny-org/tiny-GGUF/tiny-llama.gguf")
    assert source.format == "gguf" and source.identity == load_model_source(os.path.abspath(path)).identity
    # named alone, a GGUF repository opens its Q4_K_M, else its only model; a tag picks by name
    assert load_model_source("tiny-org/tiny-GGUF").identity == source.identity
    shutil.copy(path, cache / "models--tiny-org--tiny-GGUF" / "snapshots" / COMMIT_A / "tiny-llama-Q8_0.gguf")
    assert load_model_source("tiny-org/tiny-GGUF:q8_0").path.endswith("tiny-llama-Q8_0.gguf")
    with pytest.raises(ValueError, match=r"holds 2 GGUF models and none is Q4_K_M: name one as tiny-org/tiny-GGUF:TAG "
                                         r"\(tags: Q8_0\)"):
        load_model_source("tiny-org/tiny-GGUF")
    with pytest.raises(FileNotFoundError, match="`hf download tiny-org/tiny-GGUF other.gguf`"):
        load_model_source("tiny-org/tiny-GGUF/other.gguf")


def test_unreachable_hub_falls_back_to_the_cache(hub, monkeypatch):
    """Online mode with the Hub at a closed local port: a cached model loads, a missing one says why."""
    from huggingface_hub import constants

    cache, _ = hub
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert load_model_source(REPO).path.endswith(COMMIT_A)
    with pytest.raises(FileNotFoundError, match=r"is not in the Hugging Face cache .* and the Hub could not be "
                                                r"reached: download it with `hf download tiny-org/missing`"):
        load_model_source("tiny-org/missing")


@pytest.mark.parametrize("name, parsed", [
    ("org/name", ("org/name", None)),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", ("HuggingFaceTB/SmolLM2-135M-Instruct", None)),
    ("org/name-GGUF/model.Q4_K_M.gguf", ("org/name-GGUF", "model.Q4_K_M.gguf")),
    ("org/name/sub/model.gguf", ("org/name", "sub/model.gguf")),
    ("models/x.gguf", None), ("/abs/path", None), ("./org/name", None), ("~/org/name", None),
    ("org/name/config.json", None), ("org/../name", None), ("name", None),
])
def test_parse_hub_name(name, parsed):
    assert parse_hub_name(name) == parsed


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == str(tmp_path / ".cache/huggingface/hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == str(tmp_path / "hf/hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == str(tmp_path / "elsewhere")


def test_unknown_name_lists_what_is_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="smollm2-135m, gemma3-270m"):
        load_model_source("no-such-model")
