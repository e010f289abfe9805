"""Checks on what a Hub endpoint answers before `deepinfer pull` trusts it or makes a path of it.

`HF_ENDPOINT` may name a mirror, a proxy or a spoofed host, so every value the server sends is
checked against the form the Hub uses:

    commit (X-Repo-Commit, model info `sha`)   40 lowercase hex digits
    ETag (X-Linked-Etag, else ETag)            sha256 (64 hex) or git blob id (40 hex), after `W/`
                                               and quotes are stripped
    a file's sha256 / blob id in a listing     64 / 40 hex digits
    a file name in a listing                   a relative POSIX path: no leading `/`, no `\\`, no
                                               empty, `.` or `..` segment, no control character,
                                               at most 1024 characters (255 a segment)
    a size                                     an integer, 0 <= size < 16 TiB
    the download location (a redirect)         an http(s) URL

and every path built from them must resolve inside its target directory (the Hub cache or the
models dir), symlinks already there included. A value that fails raises `UnsafeNameError`, whose
one-line message names the field, the value (escaped, shortened) and the expected form.
"""

from __future__ import annotations

import os
import re
import urllib.parse

MAX_PATH_CHARS, MAX_SEGMENT_CHARS = 1024, 255
MAX_SIZE = 16 << 40  # 16 TiB: far above any single checkpoint file
_COMMIT = re.compile(r"[0-9a-f]{40}")
_HEX = {"sha256": re.compile(r"[0-9a-f]{64}"), "git blob id": re.compile(r"[0-9a-f]{40}")}
_SHOWN_CHARS = 80


class UnsafeNameError(Exception):
    """A value from the Hub, or a path built from one, failed its check (`pull` exits 1)."""

    def __init__(self, field: str, value, expected: str):
        super().__init__(f"{field} {show(value)} is not {expected}")
        self.field = field


def show(value) -> str:
    """`value` as one escaped line, cut to about 80 characters (control characters as \\r, \\x00)."""
    if value is None:
        return "(missing)"
    if not isinstance(value, str):
        return repr(value)[:_SHOWN_CHARS]
    text = value if len(value) <= _SHOWN_CHARS else value[:_SHOWN_CHARS] + "..."
    return repr(text)


def check_commit(value, field: str) -> str:
    """A commit hash as the Hub sends it: 40 lowercase hex digits."""
    if not isinstance(value, str) or _COMMIT.fullmatch(value) is None:
        raise UnsafeNameError(field, value, "a commit hash (40 lowercase hex digits)")
    return value


def check_etag(value, field: str) -> str:
    """An ETag the Hub names blobs by: sha256 (64 hex) or git blob id (40 hex), lowercased, with
    `W/` and quotes stripped first."""
    text = value.removeprefix("W/").strip('"').lower() if isinstance(value, str) else value
    if not isinstance(text, str) or not any(p.fullmatch(text) for p in _HEX.values()):
        raise UnsafeNameError(field, value, "a sha256 (64 hex digits) or git blob id (40 hex digits)")
    return text


def check_hash(value, kind: str, field: str) -> str | None:
    """A listed sha256 or git blob id (`kind`), lowercased; None stays None."""
    if value is None:
        return None
    if not isinstance(value, str) or _HEX[kind].fullmatch(value.lower()) is None:
        raise UnsafeNameError(field, value, f"a {kind} ({'64' if kind == 'sha256' else '40'} hex digits)")
    return value.lower()


def check_size(value, field: str) -> int | None:
    """A byte count: an int with 0 <= value < 16 TiB; None stays None."""
    if value is None:
        return None
    if type(value) is not int or not 0 <= value < MAX_SIZE:
        raise UnsafeNameError(field, value, "a size in bytes (an integer from 0 to 16 TiB)")
    return value


def check_repo_path(value, field: str) -> str:
    """A file name of a repository: a relative POSIX path that stays inside the repository."""
    if not isinstance(value, str) or not _is_relative_posix(value):
        raise UnsafeNameError(field, value, "a relative path inside the repository (no leading '/', no '\\', "
                                            "no empty, '.' or '..' part, no control character, at most "
                                            f"{MAX_PATH_CHARS} characters)")
    return value


def _is_relative_posix(text: str) -> bool:
    if not text or len(text) > MAX_PATH_CHARS or text.startswith("/") or "\\" in text:
        return False
    if not all(c.isprintable() or c == " " for c in text):  # control, format and separator characters
        return False
    return all(part not in ("", ".", "..") and len(part) <= MAX_SEGMENT_CHARS for part in text.split("/"))


def check_location(value, field: str) -> str:
    """Where the file's bytes come from (the Hub's redirect, or its own URL): an http(s) URL."""
    parts = urllib.parse.urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not value.isprintable():
        raise UnsafeNameError(field, value, "an http(s) URL")
    return value


def same_origin(url: str, other: str) -> bool:
    """Whether two URLs share scheme, host and port (the Hub's token goes only to its own origin)."""
    a, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(other)
    default = {"http": 80, "https": 443}
    return (a.scheme, a.hostname, a.port or default.get(a.scheme)) == (b.scheme, b.hostname,
                                                                       b.port or default.get(b.scheme))


def inside(root: str, path: str) -> bool:
    """Whether `path` resolves (following every symlink on the way, dangling ones too) inside `root`."""
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def path_inside(root: str, *parts: str) -> str:
    """`root` joined with `parts`; UnsafeNameError when the result resolves outside `root` (a symlink
    already there that points out of it)."""
    path = os.path.join(root, *parts)
    if not inside(root, path):
        raise UnsafeNameError("local path", os.path.join(*parts), f"inside {root}: it resolves to "
                              f"{os.path.realpath(path)} (a symlink there points out of it)")
    return path


def check_revision(value: str) -> str:
    """The `--revision` a user gave (a branch, tag or commit; `refs/pr/1` too): ValueError unless it
    is a relative path that stays inside `refs/`, since the Hub cache stores it as `refs/<revision>`."""
    if not _is_relative_posix(value):
        raise ValueError(f"--revision {show(value)}: expected a branch, tag or commit name (no leading '/', "
                         f"no '\\', no '.' or '..' part, no control character)")
    return value
