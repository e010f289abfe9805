"""Content fingerprints of model files, with a stat-keyed digest cache (like git's index).

    file_digest(path, cache_dir)         # blake2b-256 hex of the file's bytes
    content_identity(files, cache_dir)   # sha256 hex over sorted (basename, file_digest) pairs

Hashing every byte of a large checkpoint takes minutes, so each file's digest is stored in
`<cache_dir>/fingerprints.json`, keyed by the file's real path:

    {"<realpath>": {"stat": [st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns],
                    "digest": "<hex>", "hashed_at": <time.time_ns() before the read>}}

A stored digest is used only when all five stat fields still match: any rewrite of a file changes
its ctime (and `os.utime` cannot set ctime back), so a rewritten file is hashed again. As in git's
"racy clean" rule, an entry whose file changed within `_RACY_WINDOW_NS` of the moment it was hashed
is not trusted (a rewrite in the same timestamp tick could leave every stat field unchanged); it is
hashed again, and the fresh entry becomes trusted once the file has been quiet long enough.

The cache is only an accelerator: when `cache_dir` is None, cannot be written, or holds a damaged
file, digests are computed and nothing fails. The file is replaced atomically (a temp file and
`os.replace`) and keeps the `_MAX_ENTRIES` most recently stored entries. Concurrent writers may
drop each other's new entries, never corrupt the file.

The cache directory (`default_cache_dir`) comes from `DEEPINFER_CACHE_DIR`, else
`$XDG_CACHE_HOME/deepinfer`, else `~/.cache/deepinfer`. It is read from `os.environ` here, at each
call, rather than through `deepinfer.environ`: that table holds only counts and switches.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time

CACHE_FILE = "fingerprints.json"
_CHUNK_BYTES = 8 * 1024 * 1024
_MAX_ENTRIES = 4096
_RACY_WINDOW_NS = 2_000_000_000  # covers coarse timestamps (2 s on FAT) and kernel-clock lag


def default_cache_dir() -> str | None:
    """`$DEEPINFER_CACHE_DIR`, else `$XDG_CACHE_HOME/deepinfer`, else `~/.cache/deepinfer`
    (None when no home directory can be found). Empty variables count as unset."""
    explicit = os.environ.get("DEEPINFER_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return os.path.join(os.path.abspath(os.path.expanduser(xdg)), "deepinfer")
    home = os.path.expanduser("~")
    if home == "~":
        return None
    return os.path.join(home, ".cache", "deepinfer")


def file_digest(path: str, cache_dir: str | None) -> str:
    """blake2b (32-byte digest) hex of the file's bytes; looked up in / stored to the cache."""
    cache = _DigestCache(cache_dir)
    digest = cache.digest(path)
    cache.save()
    return digest


def content_identity(files: list[str], cache_dir: str | None) -> str:
    """sha256 hex over the sorted (basename, content digest) pairs of `files`.

    The directory is not part of it: a copy of a checkpoint elsewhere has the same identity, and
    the same path with changed bytes has another.
    """
    cache = _DigestCache(cache_dir)
    pairs = sorted((os.path.basename(file), cache.digest(file)) for file in files)
    cache.save()
    identity = hashlib.sha256()
    for name, digest in pairs:
        identity.update(f"{name}\0{digest}\0".encode())
    return identity.hexdigest()


def _hash_file(path: str) -> str:
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _stat_key(stat: os.stat_result) -> list[int]:
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


class _DigestCache:
    """The JSON cache file, loaded once and saved once per caller (no-op without a cache dir)."""

    def __init__(self, cache_dir: str | None):
        self.file = os.path.join(cache_dir, CACHE_FILE) if cache_dir else None
        self.entries: dict[str, dict] = self._load() if self.file else {}
        self.dirty = False

    def _load(self) -> dict[str, dict]:
        try:
            with open(self.file, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):  # missing, unreadable or damaged: start over
            return {}
        return data if isinstance(data, dict) else {}

    def digest(self, path: str) -> str:
        key = os.path.realpath(path)
        started = time.time_ns()
        stat = _stat_key(os.stat(key))
        entry = self.entries.get(key)
        if _trusted(entry, stat):
            return entry["digest"]
        digest = _hash_file(key)
        if self.file and _stat_key(os.stat(key)) == stat:  # not stored when it changed while read
            self.entries.pop(key, None)  # re-inserted last: the oldest insertions are dropped first
            self.entries[key] = {"stat": stat, "digest": digest, "hashed_at": started}
            self.dirty = True
        return digest

    def save(self) -> None:
        if not (self.file and self.dirty):
            return
        for key in list(self.entries)[: max(0, len(self.entries) - _MAX_ENTRIES)]:
            del self.entries[key]
        directory = os.path.dirname(self.file)
        temp = None
        try:
            os.makedirs(directory, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=".fingerprints-", suffix=".tmp", dir=directory)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.entries, f)
            os.replace(temp, self.file)
            temp = None
        except OSError:
            pass  # an unwritable cache only costs hashing again next time
        finally:
            if temp is not None:
                try:
                    os.unlink(temp)
                except OSError:
                    pass
        self.dirty = False


def _trusted(entry, stat: list[int]) -> bool:
    """A well-formed entry for the same stat, hashed after the file had been quiet for a while."""
    if not isinstance(entry, dict):
        return False
    digest, hashed_at = entry.get("digest"), entry.get("hashed_at")
    if entry.get("stat") != stat or not isinstance(digest, str) or len(digest) != 64:
        return False
    try:
        int(digest, 16)
    except ValueError:
        return False
    if not isinstance(hashed_at, int) or isinstance(hashed_at, bool):
        return False
    return max(stat[3], stat[4]) < hashed_at - _RACY_WINDOW_NS
