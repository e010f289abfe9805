"""The model host's parts without a server: the catalog of a folder, keep_alive, a child's flags,
`deepinfer run`'s model resolution."""

from __future__ import annotations

import json
import os

import pytest

from deepinfer.entrypoints import cli
from deepinfer.entrypoints.model_host.catalog import Catalog, HostedModel, build_catalog, parameter_size
from deepinfer.entrypoints.model_host.launch import child_argv, given_models, hosts_models
from deepinfer.entrypoints.model_host.runners import keep_alive_seconds
from deepinfer.entrypoints.run_cmd import resolve_run_model


def _touch(path, size: int = 10) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def test_a_folder_lists_ggufs_by_stem_split_sets_once_and_hf_folders_by_name(tmp_path):
    _touch(tmp_path / "a.gguf", 5)
    _touch(tmp_path / "deep" / "b-00001-of-00002.gguf", 7)
    _touch(tmp_path / "deep" / "b-00002-of-00002.gguf", 11)
    _touch(tmp_path / "notes.txt")
    (tmp_path / "hf-model").mkdir()
    config = json.dumps({"model_type": "llama"})
    (tmp_path / "hf-model" / "config.json").write_text(config)
    _touch(tmp_path / "hf-model" / "inner.gguf")  # a checkpoint's own files list nothing more
    catalog = build_catalog(str(tmp_path), [], False)
    assert [(m.name, m.size) for m in catalog.all()] == [("a", 5), ("b", 18), ("hf-model", 10 + len(config))]
    assert catalog.find("b:latest").path.endswith("b-00001-of-00002.gguf")
    assert catalog.find("b-00002-of-00002") is None and catalog.find("") is None
    with pytest.raises(ValueError, match="--models-dir .*nowhere.* is not a directory"):
        build_catalog(str(tmp_path / "nowhere"), [], False)


def test_a_taken_name_keeps_its_first_model(tmp_path, caplog):
    first = HostedModel("m", "/one/m.gguf", 1, 0.0, "models-dir")
    second = HostedModel("m", "/two/m.gguf", 2, 0.0, "model")
    catalog = Catalog([first, second])
    assert catalog.all() == [first] and "/two/m.gguf is not listed" in caplog.text


def test_facts_of_a_file_that_is_no_gguf_are_empty_not_an_error(tmp_path):
    _touch(tmp_path / "junk.gguf", 100)
    catalog = build_catalog(str(tmp_path), [], False)
    facts = catalog.facts(catalog.find("junk"))
    assert facts.parameter_count is None and parameter_size(facts.parameter_count) == ""
    assert parameter_size(494_030_000) == "494.03M" and parameter_size(7_615_616_512) == "7.62B"


@pytest.mark.parametrize(("value", "seconds"), [
    (0, 0.0), ("0", 0.0), (30, 30.0), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("250ms", 0.25),
    (-1, float("inf")), ("-1m", float("inf"))])
def test_keep_alive_takes_ollamas_forms(value, seconds):
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", True, None, [5], "1d", float("nan")])
def test_a_bad_keep_alive_names_the_field_and_value(value):
    with pytest.raises(ValueError, match="keep_alive must be"):
        keep_alive_seconds(value)


def test_a_child_gets_the_commands_flags_but_the_hosts_own():
    argv = ["--models-dir", "/m", "--model", "a.gguf", "--model=b.gguf", "--threads", "1", "--port", "9000",
            "--host=0.0.0.0", "--all-models", "--keep-alive", "1m", "--api-key", "k", "--max-loaded-models=2"]
    assert given_models(argv) == ["a.gguf", "b.gguf"]
    assert child_argv(argv, "/m/x.gguf", "x", 4242) == [
        "--threads", "1", "--api-key", "k", "--model", "/m/x.gguf", "--served-model-name", "x",
        "--host", "127.0.0.1", "--port", "4242"]


@pytest.mark.parametrize(("flags", "hosts"), [
    ([], False), (["--model", "a"], False), (["--model", "a", "--model", "b"], True), (["--models-dir", "/m"], True),
    (["--all-models"], True)])
def test_which_commands_host_several_models(flags, hosts):
    args = cli.build_parser().parse_args(["serve", *flags])
    args.argv = ["serve", *flags]
    assert hosts_models(args) is hosts


def test_run_resolves_paths_listed_models_and_pulls_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _touch(tmp_path / "mine.gguf")
    pulled = []
    fake_pull = lambda name, revision, models_dir: pulled.append(name)  # noqa: E731
    assert resolve_run_model(str(tmp_path / "mine.gguf"), pull=fake_pull) == str(tmp_path / "mine.gguf")
    assert resolve_run_model("mine", pull=fake_pull) == str(tmp_path / "mine.gguf")  # its stem in the models dir
    assert resolve_run_model("smollm2-135m", pull=fake_pull) == "smollm2-135m"  # pip-shipped
    assert pulled == []
    assert resolve_run_model("org/name:Q4_K_M", pull=fake_pull) == "org/name:Q4_K_M"
    assert pulled == ["org/name:Q4_K_M"]
    with pytest.raises(ValueError, match="'no such thing' is not here"):
        resolve_run_model("no such thing", pull=fake_pull)
    assert os.path.isfile(tmp_path / "mine.gguf")


@pytest.mark.real_model
def test_run_answers_a_prompt_with_the_default_model(capsys):
    assert cli.main(["run", "smollm2-135m", "Say hello", "--max-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
