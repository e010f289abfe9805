"""What `deepinfer list` reads from disk, entry by entry, so that one bad entry never hides the rest.

    the Hugging Face cache   models--org--name/snapshots/<commit>/<path>, the layout huggingface_hub's
                             `scan_cache_dir` reads (read here entry by entry: that scan stops at the
                             first unreadable folder); a file must resolve inside the cache
    the models dir           *.gguf files, recursively (a symlink to a file elsewhere is fine)

An entry that cannot be read comes back as a `Skipped` (its path and why) instead of an error: a
dangling symlink, a cache file that resolves outside the cache, an unreadable file or directory,
something other than a regular file, a name that is not valid UTF-8, a `models--*` entry or its
`snapshots` that is not a directory (or is a symlink). Symlinked directories are not descended into.
"""

from __future__ import annotations

import dataclasses
import os
import stat

from deepinfer.entrypoints.models_cmd.safe_names import inside

_REPO_PREFIX = "models--"


@dataclasses.dataclass(frozen=True)
class Skipped:
    """An entry `list` could not read: its path and the reason, both for people to read."""

    path: str
    reason: str


@dataclasses.dataclass(frozen=True)
class FoundFile:
    """A readable regular file (or a symlink to one). `target` is where its bytes are (realpath)."""

    path: str
    size: int
    modified: float
    target: str


@dataclasses.dataclass(frozen=True)
class CachedRepo:
    """A model repository of the Hub cache: its readable files by repository path (all snapshots)."""

    repo_id: str
    path: str
    files: dict[str, FoundFile]
    modified: float  # the newest file's mtime; the folder's own when it holds none


def printable(text: str) -> str:
    """`text` safe to print on one line: bytes that are not UTF-8 as \\xNN, control characters escaped."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def read_file(path: str, skipped: list[Skipped], root: str | None = None) -> FoundFile | None:
    """`path` measured, or None with the reason appended to `skipped`. With `root`, the file (after
    every symlink) must lie inside it."""
    reason = _unreadable(path, root)
    if reason is not None:
        skipped.append(Skipped(path, reason))
        return None
    info = os.stat(path)
    return FoundFile(path, info.st_size, info.st_mtime, os.path.realpath(path))


def _unreadable(path: str, root: str | None) -> str | None:
    """Why `path` cannot be listed, or None when it can."""
    if not _utf8(path):
        return "its name is not valid UTF-8"
    if root is not None and not inside(root, path):
        return f"a symlink that resolves outside {root} (to {os.path.realpath(path)})"
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return f"a dangling symlink (to {_link_target(path)})" if os.path.islink(path) else "it vanished"
    except OSError as exc:
        return _reason(exc)
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if not os.access(path, os.R_OK):
        return "unreadable (permission denied)"
    return None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a byte that is not UTF-8, kept as a lone surrogate
        return False
    return True


def _link_target(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _walk_files(top: str, skipped: list[Skipped]):
    """Every non-directory under `top` (dangling symlinks included); unreadable folders into `skipped`."""
    def unreadable(exc: OSError) -> None:
        if not (isinstance(exc, FileNotFoundError) and exc.filename == top):  # a missing top is empty
            skipped.append(Skipped(exc.filename or top, _reason(exc)))

    for folder, _, names in os.walk(top, onerror=unreadable):
        for name in sorted(names):
            yield os.path.join(folder, name)


def scan_models_dir(models_dir: str) -> tuple[list[FoundFile], list[Skipped]]:
    """The *.gguf files under `models_dir` (absolute paths) and the entries that could not be read."""
    skipped: list[Skipped] = []
    found = [read_file(path, skipped) for path in _walk_files(os.path.abspath(models_dir), skipped)
             if path.endswith(".gguf")]
    return [f for f in found if f is not None], skipped


def scan_hub_cache(cache: str) -> tuple[list[CachedRepo], list[Skipped]]:
    """The model repositories of the Hub cache and the entries that could not be read."""
    skipped: list[Skipped] = []
    try:
        names = sorted(os.listdir(cache))
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        return [], [Skipped(cache, _reason(exc))]
    repos = [_scan_repo(cache, name, skipped) for name in names if name.startswith(_REPO_PREFIX)]
    return [r for r in repos if r is not None], skipped


def _scan_repo(cache: str, name: str, skipped: list[Skipped]) -> CachedRepo | None:
    """One `models--org--name` folder; None when nothing of it could be read, or when it has no
    snapshots yet (a pull that has not finished a file: only blobs/*.incomplete)."""
    path = os.path.join(cache, name)
    snapshots = os.path.join(path, "snapshots")
    if os.path.islink(path) or not os.path.isdir(path):
        skipped.append(Skipped(path, "not a Hugging Face cache folder (a directory of the cache itself)"))
        return None
    if not os.path.lexists(snapshots):
        return None
    if os.path.islink(snapshots) or not os.path.isdir(snapshots):
        skipped.append(Skipped(snapshots, "not a Hugging Face cache folder's snapshots directory"))
        return None
    before, files = len(skipped), {}
    for snapshot in (os.path.join(snapshots, commit) for commit in _list(snapshots, skipped)):
        if os.path.islink(snapshot) or not os.path.isdir(snapshot):
            skipped.append(Skipped(snapshot, "not a snapshot directory"))
            continue
        for file_path in _walk_files(snapshot, skipped):
            if (found := read_file(file_path, skipped, cache)) is not None:
                files[os.path.relpath(file_path, snapshot).replace(os.sep, "/")] = found
    if not files and len(skipped) > before:
        return None
    modified = max((f.modified for f in files.values()), default=os.path.getmtime(path))
    return CachedRepo(name[len(_REPO_PREFIX):].replace("--", "/"), path, files, modified)


def _list(folder: str, skipped: list[Skipped]) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError as exc:
        skipped.append(Skipped(folder, _reason(exc)))
        return []
