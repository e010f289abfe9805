"""Model identity by content: file digests cached by stat (loader/fingerprint.py)."""

from __future__ import annotations

import json
import os
import time

import pytest

from deepinfer.model_executor.loader import fingerprint
from deepinfer.model_executor.loader.fingerprint import (
    CACHE_FILE,
    content_identity,
    default_cache_dir,
    file_digest,
)
from deepinfer.model_executor.loader.model_source import compute_identity


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> str:
    path = tmp_path / "cache"
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(path))
    return str(path)


@pytest.fixture
def counted_reads(monkeypatch) -> list[str]:
    """Paths whose bytes were hashed (each call of the hashing function)."""
    reads: list[str] = []
    real = fingerprint._hash_file

    def counting(path: str) -> str:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(fingerprint, "_hash_file", counting)
    return reads


def _checkpoint(directory, weights: bytes = b"\x01" * 1000) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": weights, "tokenizer.json": b"{}"}
    paths = []
    for name, data in files.items():
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths


def test_same_content_in_two_directories_has_one_identity(tmp_path, cache_dir):
    first = _checkpoint(tmp_path / "a")
    second = _checkpoint(tmp_path / "elsewhere" / "b")
    assert compute_identity(str(tmp_path / "a"), first) == compute_identity(str(tmp_path / "elsewhere" / "b"), second)
    assert content_identity(first, None) == content_identity(list(reversed(second)), cache_dir)


def test_identity_depends_on_names_and_every_file(tmp_path, cache_dir):
    files = _checkpoint(tmp_path / "a")
    base = content_identity(files, cache_dir)
    assert content_identity(files[:2], cache_dir) != base
    renamed = str(tmp_path / "a" / "tokenizer_config.json")
    os.rename(files[2], renamed)
    assert content_identity([*files[:2], renamed], cache_dir) != base


def test_rewrite_with_same_size_and_mtime_changes_identity(tmp_path, cache_dir):
    files = _checkpoint(tmp_path / "a")
    weights = files[1]
    first = compute_identity(str(tmp_path / "a"), files)
    before = os.stat(weights)
    with open(weights, "r+b") as f:
        f.write(b"\x02")  # same size
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(weights)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert compute_identity(str(tmp_path / "a"), files) != first


def test_rewrite_is_seen_by_the_stat_check_alone(tmp_path, cache_dir, monkeypatch, counted_reads):
    # With the racy window off, the cached entry is trusted; the rewrite must still miss (ctime moved).
    monkeypatch.setattr(fingerprint, "_RACY_WINDOW_NS", 0)
    path = _checkpoint(tmp_path / "a")[1]
    first = file_digest(path, cache_dir)
    assert file_digest(path, cache_dir) == first and len(counted_reads) == 1  # trusted
    before = os.stat(path)
    time.sleep(0.05)  # past the kernel's coarse timestamp tick
    with open(path, "r+b") as f:
        f.write(b"\x02")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    if os.stat(path).st_ctime_ns == before.st_ctime_ns:
        pytest.skip("this filesystem's ctime did not move")
    assert file_digest(path, cache_dir) == file_digest(path, None) != first


def test_digest_is_blake2b_of_the_bytes(tmp_path):
    import hashlib

    path = tmp_path / "w.bin"
    path.write_bytes(b"weights")
    assert file_digest(str(path), None) == hashlib.blake2b(b"weights", digest_size=32).hexdigest()


def test_cache_spares_reading_an_unchanged_file(tmp_path, cache_dir, counted_reads, monkeypatch):
    monkeypatch.setattr(fingerprint, "_RACY_WINDOW_NS", 0)  # the files were written just now
    files = _checkpoint(tmp_path / "a")
    first = content_identity(files, cache_dir)
    assert len(counted_reads) == 3
    entries = json.loads(open(os.path.join(cache_dir, CACHE_FILE)).read())
    assert set(entries) == {os.path.realpath(f) for f in files}
    assert all(len(entry["stat"]) == 5 and len(entry["digest"]) == 64 for entry in entries.values())
    assert content_identity(files, cache_dir) == first
    assert file_digest(files[1], cache_dir) == entries[os.path.realpath(files[1])]["digest"]
    assert len(counted_reads) == 3  # nothing read again
    with open(files[0], "ab") as f:
        f.write(b" ")
    assert content_identity(files, cache_dir) != first
    assert counted_reads[3:] == [os.path.realpath(files[0])]  # only the changed file


def test_freshly_written_files_are_hashed_again_until_quiet(tmp_path, cache_dir, counted_reads):
    files = _checkpoint(tmp_path / "a")
    content_identity(files, cache_dir)
    content_identity(files, cache_dir)
    assert len(counted_reads) == 6  # within the racy window: the cached stat is not trusted yet


def test_damaged_cache_is_ignored_and_replaced(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setattr(fingerprint, "_RACY_WINDOW_NS", 0)
    files = _checkpoint(tmp_path / "a")
    expected = content_identity(files, None)
    os.makedirs(cache_dir)
    cache_file = os.path.join(cache_dir, CACHE_FILE)
    for damage in ('{"truncated": ', "[1, 2]", "\x00\xff garbage"):
        with open(cache_file, "w", encoding="latin-1") as f:
            f.write(damage)
        assert content_identity(files, cache_dir) == expected
    assert len(json.loads(open(cache_file).read())) == 3


def test_forged_or_malformed_entries_are_not_trusted(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setattr(fingerprint, "_RACY_WINDOW_NS", 0)
    path = _checkpoint(tmp_path / "a")[1]
    expected = file_digest(path, None)
    cache_file = os.path.join(cache_dir, CACHE_FILE)
    file_digest(path, cache_dir)
    good = json.loads(open(cache_file).read())[os.path.realpath(path)]
    for bad in ({**good, "digest": "zz" * 32}, {**good, "digest": 7}, {**good, "stat": good["stat"][:4]},
                {**good, "hashed_at": "soon"}, "not a dict"):
        with open(cache_file, "w") as f:
            json.dump({os.path.realpath(path): bad}, f)
        assert file_digest(path, cache_dir) == expected


def test_unwritable_cache_dir_still_answers(tmp_path, monkeypatch):
    files = _checkpoint(tmp_path / "a")
    expected = content_identity(files, None)
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")  # a file where the cache directory should be: makedirs fails
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(blocker / "cache"))
    assert compute_identity(str(tmp_path / "a"), files) == expected
    occupied = tmp_path / "occupied"
    (occupied / CACHE_FILE).mkdir(parents=True)  # the cache file's name is taken: load and replace fail
    assert content_identity(files, str(occupied)) == expected
    assert os.listdir(occupied) == [CACHE_FILE]  # no temp file left behind
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        assert content_identity(files, str(read_only)) == expected
        if not os.access(read_only, os.W_OK):  # root may write anyway
            assert os.listdir(read_only) == []
    finally:
        read_only.chmod(0o700)


def test_cache_keeps_the_newest_entries(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setattr(fingerprint, "_MAX_ENTRIES", 3)
    paths = []
    for i in range(5):
        path = tmp_path / f"f{i}"
        path.write_bytes(bytes([i]))
        paths.append(str(path))
        file_digest(str(path), cache_dir)
    entries = json.loads(open(os.path.join(cache_dir, CACHE_FILE)).read())
    assert list(entries) == [os.path.realpath(p) for p in paths[2:]]
    assert not [name for name in os.listdir(cache_dir) if name != CACHE_FILE]  # no temp files left


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == str(tmp_path / "explicit")
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", "")
    assert default_cache_dir() == str(tmp_path / "xdg" / "deepinfer")
    monkeypatch.delenv("DEEPINFER_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "deepinfer")
