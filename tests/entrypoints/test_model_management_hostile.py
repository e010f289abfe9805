"""`deepinfer pull / list / rm` against a hostile or spoofed Hub endpoint and odd files on disk.

A name the server sends (commit, ETag, a file name of a listing, a size, a redirect) that is not of
the form the Hub uses stops `pull` with status 1 and one line naming the field, and nothing is
written anywhere (the whole tree around the test's directory is compared before and after). A
symlink already in the cache or models dir that points out of it is never followed. `list` lists
what it can read and names the rest; `rm` never deletes outside the cache or the models dir.
"""

from __future__ import annotations

import json
import os

import pytest
from fake_hub import GGUF_COMMIT, GGUF_FILE, GGUF_REPO, serve_fake_hub

from deepinfer.entrypoints import cli
from deepinfer.entrypoints.models_cmd import inventory

CKPT = "tiny-org/tiny-llama"
GGUF_NAME = f"{GGUF_REPO}/{GGUF_FILE}"
GGUF_FOLDER = "models--tiny-org--tiny-gguf"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with serve_fake_hub(tmp_path, monkeypatch) as fake:
        yield fake


def _tree(root) -> dict[str, tuple]:
    """Every entry under `root`: (kind, size or link target), symlinks not followed."""
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            seen[path] = ("link", os.readlink(path)) if os.path.islink(path) else (oct(info.st_mode), info.st_size)
    return seen


def _pull_refused(args, tmp_path, capsys, *fields: str) -> str:
    """Run `deepinfer pull ARGS`: status 1, one error line naming each of `fields`, nothing written."""
    before = _tree(tmp_path.parent)
    capsys.readouterr()
    assert cli.main(["pull", *args]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepinfer: error: pull "), err
    for field in fields:
        assert field in lines[0], err
    assert _tree(tmp_path.parent) == before
    return lines[0]


@pytest.mark.parametrize(("header", "value", "field"), [
    ("X-Repo-Commit", "../../evil", "X-Repo-Commit header '../../evil'"),
    ("X-Repo-Commit", "../../../../evil", "X-Repo-Commit"),
    ("X-Repo-Commit", "D" * 40, "X-Repo-Commit"),  # not lowercase
    ("X-Repo-Commit", None, "X-Repo-Commit header (missing)"),
    ("X-Linked-Etag", '"../../../../evil"', "ETag header '../../../../evil'"),
    ("X-Linked-Etag", '"abc/def"', "ETag header 'abc/def'"),
    ("X-Linked-Etag", 'W/"' + "e" * 63 + '/"', "ETag"),
    ("X-Linked-Etag", '"' + "e" * 64 + '"', "a hash the Hub lists"),  # well formed, another file's hash
    ("X-Linked-Size", "-5", "X-Linked-Size"),
])
@pytest.mark.parametrize("target", ["cache", "models-dir"])
def test_a_hostile_header_stops_pull_and_writes_nothing(hub, tmp_path, capsys, header, value, field, target):
    hub.headers[header] = value
    args = [GGUF_NAME] + (["--models-dir", str(tmp_path / "models")] if target == "models-dir" else [])
    _pull_refused(args, tmp_path, capsys, field)
    assert not [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]  # no byte was fetched


def test_an_etag_header_checked_when_there_is_no_linked_one(hub, tmp_path, capsys):
    hub.headers.update({"X-Linked-Etag": None, "ETag": '"../../../evil"'})
    _pull_refused([GGUF_NAME], tmp_path, capsys, "ETag header '../../../evil'", "sha256 (64 hex digits)")


@pytest.mark.parametrize(("name", "shown"), [
    ("../x.json", "'../x.json'"),
    ("/etc/x.json", "'/etc/x.json'"),
    ("a/../../b.gguf", "'a/../../b.gguf'"),
    ("a/./b.json", "'a/./b.json'"),
    ("a//b.json", "'a//b.json'"),
    ("tok\r\nenizer.json", r"'tok\r\nenizer.json'"),
    ("x\x00.json", r"'x\x00.json'"),
    ("..\\x.json", r"'..\\x.json'"),
    ("a" * 300 + ".json", "..."),
])
def test_a_hostile_file_name_in_the_listing_stops_pull(hub, tmp_path, capsys, name, shown):
    hub.extra_siblings.append({"rfilename": name, "size": 2, "blobId": "0" * 40})
    line = _pull_refused([CKPT], tmp_path, capsys, "file name in the repository listing", shown,
                         "a relative path inside the repository")
    assert len(line) < 400  # the value is shortened


def test_a_hostile_commit_or_size_in_the_listing_stops_pull(hub, tmp_path, capsys):
    hub.info_sha = "../../evil"
    _pull_refused([CKPT], tmp_path, capsys, "model info 'sha' '../../evil'", "40 lowercase hex digits")
    hub.info_sha = None
    hub.extra_siblings.append({"rfilename": "vocab.json", "size": -1, "blobId": "0" * 40})
    _pull_refused([CKPT], tmp_path, capsys, "size of 'vocab.json'", "a size in bytes")
    hub.extra_siblings[0] = {"rfilename": "vocab.json", "size": 2, "blobId": "../../x"}
    _pull_refused([CKPT], tmp_path, capsys, "blob id of 'vocab.json'", "40 hex digits")


def test_a_hostile_paths_info_answer_stops_pull(hub, tmp_path, capsys):
    hub.paths_info_path = "../../../" + GGUF_FILE
    _pull_refused([GGUF_NAME], tmp_path, capsys, "file name in the paths-info answer", "'../../../tiny.Q8_0.gguf'")


def test_a_redirect_to_a_non_http_location_stops_pull(hub, tmp_path, capsys):
    hub.redirect_to = "file:///etc"
    _pull_refused([GGUF_NAME], tmp_path, capsys, "download location", "an http(s) URL")


def test_a_revision_that_leaves_refs_is_refused(hub, tmp_path, capsys):
    before = _tree(tmp_path.parent)
    assert cli.main(["pull", GGUF_NAME, "--revision", "../../../evil"]) == 2
    assert "--revision '../../../evil'" in capsys.readouterr().err
    assert _tree(tmp_path.parent) == before


def test_the_token_goes_to_the_hub_and_never_to_a_host_it_redirects_to(hub, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hub.redirect_to = hub.url.replace("127.0.0.1", "localhost")  # another origin, like a CDN
    assert cli.main(["pull", GGUF_NAME]) == 0
    sent = {(m, p.split("/")[1]): auth for m, p, auth in hub.authorization}
    assert sent[("HEAD", "tiny-org")] == "Bearer hf_secret"
    assert ("GET", "cdn") in sent and sent[("GET", "cdn")] is None
    hub.redirect_to = hub.url  # the same origin keeps it
    assert cli.main(["pull", f"{GGUF_REPO}/other.Q4_0.gguf"]) == 0
    assert [a for m, p, a in hub.authorization if m == "GET" and p.endswith("other.Q4_0.gguf")] == ["Bearer hf_secret"]


def _outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    return outside


def test_a_symlinked_folder_in_the_cache_that_points_outside_is_not_followed(hub, tmp_path, capsys):
    blobs = tmp_path / "hub" / GGUF_FOLDER / "blobs"
    blobs.parent.mkdir(parents=True)
    blobs.symlink_to(_outside(tmp_path), target_is_directory=True)
    line = _pull_refused([GGUF_NAME], tmp_path, capsys, "local path", f"{GGUF_FOLDER}/blobs/",
                         str(tmp_path / "outside"))
    assert "is not inside" in line and not list((tmp_path / "outside").iterdir())


def test_a_dangling_snapshot_link_that_points_outside_is_not_written_through(hub, tmp_path, capsys):
    pointer = tmp_path / "hub" / GGUF_FOLDER / "snapshots" / GGUF_COMMIT / GGUF_FILE
    pointer.parent.mkdir(parents=True)
    pointer.symlink_to(_outside(tmp_path) / "x.gguf")
    _pull_refused([GGUF_NAME], tmp_path, capsys, "local path", "outside")
    assert not (tmp_path / "outside" / "x.gguf").exists()


def test_a_ref_or_partial_file_linked_outside_is_not_written_through(hub, tmp_path, capsys):
    refs = tmp_path / "hub" / GGUF_FOLDER / "refs"
    refs.mkdir(parents=True)
    (refs / "main").symlink_to(_outside(tmp_path) / "main")
    _pull_refused([GGUF_NAME], tmp_path, capsys, "local path", f"{GGUF_FOLDER}/refs/main")
    models = tmp_path / "models"
    models.mkdir()
    (models / (GGUF_FILE + ".incomplete")).symlink_to(tmp_path / "outside" / "partial")
    _pull_refused([GGUF_NAME, "--models-dir", str(models)], tmp_path, capsys, "local path", ".incomplete")
    assert not list((tmp_path / "outside").iterdir())


def test_a_failed_hash_check_leaves_no_file_in_the_models_dir(hub, tmp_path, capsys):
    hub.corrupt.add(GGUF_FILE)
    assert cli.main(["pull", GGUF_NAME, "--models-dir", str(tmp_path / "models")]) == 1
    assert "does not match" in capsys.readouterr().err
    assert list((tmp_path / "models").iterdir()) == []  # neither the file nor the partial one


def _skipped_lines(err: str) -> dict[str, str]:
    lines = [line for line in err.splitlines() if line.startswith("deepinfer: list: skipped ")]
    return {line.removeprefix("deepinfer: list: skipped ").rsplit(": ", 1)[0]: line for line in lines}


def _odd_models_dir(tmp_path, monkeypatch):
    """A models dir with one good GGUF and five it cannot read; the paths of the bad ones."""
    models = tmp_path / "models"
    (models / "sub").mkdir(parents=True)
    (models / "good.gguf").write_bytes(b"GGUF" + b"\0" * 96)
    bad = {"dangling": models / "dangling.gguf", "unreadable": models / "sub" / "unreadable.gguf",
           "loop": models / "loop.gguf", "fifo": models / "fifo.gguf"}
    bad["dangling"].symlink_to(tmp_path / "nowhere.gguf")
    bad["unreadable"].write_bytes(b"GGUF")
    bad["unreadable"].chmod(0)
    bad["loop"].symlink_to(bad["loop"])
    os.mkfifo(bad["fifo"])
    os.close(os.open(os.path.join(os.fsencode(models), b"bad\xff.gguf"), os.O_CREAT | os.O_WRONLY, 0o644))
    real_access = os.access
    unreadable = str(bad["unreadable"])
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: p != unreadable and real_access(p, mode, **kw))
    return models, bad  # (as root, chmod 0 leaves a file readable: os.access answers for the test)


def test_list_skips_and_reports_what_it_cannot_read_in_the_models_dir(hub, tmp_path, capsys, monkeypatch):
    models, bad = _odd_models_dir(tmp_path, monkeypatch)
    assert cli.main(["list", "--json"]) == 0
    captured = capsys.readouterr()
    answer = json.loads(captured.out)
    assert str(models / "good.gguf") in [row["name"] for row in answer["models"]]
    assert not [row for row in answer["models"] if row["name"] != str(models / "good.gguf")
                and row["source"] == "models-dir"]
    reasons = {item["path"]: item["reason"] for item in answer["skipped"]}
    assert reasons[str(bad["dangling"])].startswith("a dangling symlink")
    assert reasons[str(bad["unreadable"])] == "unreadable (permission denied)"
    assert reasons[str(bad["fifo"])] == "not a regular file"
    assert str(bad["loop"]) in reasons
    assert reasons[str(models / "bad\\xff.gguf")] == "its name is not valid UTF-8"
    assert len(reasons) == 5
    assert set(_skipped_lines(captured.err)) == set(reasons)  # one stderr line each
    assert cli.main(["list"]) == 0
    table = capsys.readouterr().out
    assert "good.gguf" in table and "dangling" not in table


def test_list_reports_an_unreadable_directory_and_lists_the_rest(hub, tmp_path, capsys, monkeypatch):
    assert cli.main(["pull", GGUF_NAME]) == 0
    locked = [tmp_path / "models" / "locked", tmp_path / "hub" / "models--org--locked" / "snapshots" / ("a" * 40)]
    for folder in locked:
        folder.mkdir(parents=True)
        (folder / "x.gguf").write_bytes(b"GGUF")
        folder.chmod(0)
    (tmp_path / "models" / "good.gguf").write_bytes(b"GGUF")
    real_scandir, refused = os.scandir, {str(p) for p in locked}

    def scandir(path="."):  # as root, chmod 0 leaves a folder readable: refuse it here too
        if os.fspath(path) in refused:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    try:
        capsys.readouterr()
        assert cli.main(["list", "--json"]) == 0
        answer = json.loads(capsys.readouterr().out)
    finally:
        for folder in locked:
            folder.chmod(0o755)
    names = {row["name"] for row in answer["models"]}
    assert {GGUF_NAME, str(tmp_path / "models" / "good.gguf")} <= names and "org/locked" not in names
    assert {item["path"]: item["reason"] for item in answer["skipped"]} == {p: "Permission denied" for p in refused}


def test_list_skips_broken_cache_folders_and_lists_the_rest(hub, tmp_path, capsys):
    assert cli.main(["pull", f"{GGUF_REPO}/other.Q4_0.gguf"]) == 0
    cache = tmp_path / "hub"
    (cache / "models--org--unfinished" / "blobs").mkdir(parents=True)  # an interrupted pull: not reported
    (cache / "models--org--file-snapshots").mkdir()
    (cache / "models--org--file-snapshots" / "snapshots").write_bytes(b"")
    (cache / "models--org--a-file").write_bytes(b"")
    snapshot = cache / "models--org--linked-out" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (_outside(tmp_path) / "secret.gguf").write_bytes(b"GGUF")
    (snapshot / "secret.gguf").symlink_to(tmp_path / "outside" / "secret.gguf")
    (cache / GGUF_FOLDER / "snapshots" / GGUF_COMMIT / "gone.gguf").symlink_to("../../blobs/" + "f" * 64)
    capsys.readouterr()
    assert cli.main(["list", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert {row["name"] for row in answer["models"] if row["source"] == "hf-cache"} == {f"{GGUF_REPO}/other.Q4_0.gguf"}
    reasons = {item["path"]: item["reason"] for item in answer["skipped"]}
    assert reasons[str(cache / "models--org--file-snapshots" / "snapshots")].startswith("not a Hugging Face cache")
    assert reasons[str(cache / "models--org--a-file")].startswith("not a Hugging Face cache folder")
    assert "resolves outside" in reasons[str(snapshot / "secret.gguf")]
    assert reasons[str(cache / GGUF_FOLDER / "snapshots" / GGUF_COMMIT / "gone.gguf")].startswith("a dangling")
    assert len(reasons) == 4


def test_list_exits_1_when_nothing_could_be_read(hub, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(inventory, "pip_entries", lambda: [])
    models = tmp_path / "models"
    models.mkdir()
    (models / "dangling.gguf").symlink_to(tmp_path / "nowhere.gguf")
    assert cli.main(["list"]) == 1
    assert "dangling.gguf: a dangling symlink" in capsys.readouterr().err
    os.remove(models / "dangling.gguf")
    assert cli.main(["list", "--json"]) == 0  # nothing at all is not an error
    assert json.loads(capsys.readouterr().out) == {"models": [], "skipped": []}


def test_rm_never_deletes_outside_the_cache(hub, tmp_path, capsys):
    assert cli.main(["pull", GGUF_NAME]) == 0
    secret = _outside(tmp_path) / "secret.gguf"
    secret.write_bytes(b"GGUF secret")
    snapshot = tmp_path / "hub" / GGUF_FOLDER / "snapshots" / GGUF_COMMIT
    (snapshot / "linked.gguf").symlink_to(secret)
    capsys.readouterr()
    assert cli.main(["rm", f"{GGUF_REPO}/linked.gguf"]) == 2  # its "blob" is outside: refused
    assert "resolves outside the Hugging Face cache" in capsys.readouterr().err
    assert secret.read_bytes() == b"GGUF secret" and (snapshot / GGUF_FILE).exists()
    assert cli.main(["rm", GGUF_REPO]) == 0  # the whole folder goes; a link in it is removed, not followed
    assert secret.read_bytes() == b"GGUF secret" and not (tmp_path / "hub" / GGUF_FOLDER).exists()


def test_rm_names_a_damaged_cache_folder_instead_of_deleting_through_it(hub, tmp_path, capsys):
    folder = tmp_path / "hub" / GGUF_FOLDER
    folder.mkdir(parents=True)
    (folder / "snapshots").symlink_to(_outside(tmp_path), target_is_directory=True)
    (tmp_path / "outside" / "keep").write_bytes(b"x")
    assert cli.main(["rm", GGUF_REPO]) == 2
    assert "is in the Hugging Face cache but its folder is damaged" in capsys.readouterr().err
    assert (tmp_path / "outside" / "keep").exists()


def test_rm_in_the_models_dir_removes_a_link_never_its_target(hub, tmp_path, capsys):
    models = tmp_path / "models"
    models.mkdir()
    secret = _outside(tmp_path) / "elsewhere.gguf"
    secret.write_bytes(b"GGUF")
    (models / "link.gguf").symlink_to(secret)
    (models / "dangling.gguf").symlink_to(tmp_path / "nowhere.gguf")
    assert cli.main(["rm", "link.gguf"]) == 0
    assert cli.main(["rm", "dangling.gguf"]) == 0  # what `list` reports can be cleaned up
    assert secret.exists() and not os.path.lexists(models / "link.gguf")
    assert not os.path.lexists(models / "dangling.gguf")
    assert cli.main(["rm", "../outside/elsewhere.gguf"]) == 2
    assert "not in the models directory" in capsys.readouterr().err
    assert secret.read_bytes() == b"GGUF"
