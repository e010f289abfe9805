"""File access inside the saved cache directory that trusts nothing it finds there.

Everything below `<dir>` (its root folders, unit files, the lock file, the canary records) is
reached through directory file descriptors, one path component at a time:

    <dir>                 opened as given (the user named it; a symlink to it is fine)
      <root16>/           O_DIRECTORY | O_NOFOLLOW: a symlink or a file here is not ours
        <name>            lstat first: only a regular file is opened, with O_NOFOLLOW | O_NONBLOCK,
                          then fstat on the fd (regular, the same inode) and the size is checked
                          against what the caller expects BEFORE a byte is read

So a symlink is never followed (a link inside the directory is unlinked, its target never
touched), a FIFO or device node is never opened, and a read allocates at most what the caller
said a file may hold. An entry that is not a regular file where one belongs is removed (it is
inside the directory) and reported as `Hostile`, for the caller's one warning.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from deepinfer.model_executor.loader.regular_file import NotRegular, kind_of, open_regular

_log = logging.getLogger("deepinfer.kv_disk")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class Hostile(Exception):
    """An entry that is not a regular file (or not a real folder) where one of ours belongs; it
    was removed when it could be. `path` names it; `what` (from `remove`) says what it was and
    whether it is gone."""

    def __init__(self, path: str, what: str):
        super().__init__(f"{path} is not a cache file of ours: {what}")
        self.path = path


class BadSize(Exception):
    """A regular file whose size is not what it must be (`ino`: its inode); nothing more of it
    than its first 8 bytes was read."""

    def __init__(self, reason: str, ino: int):
        super().__init__(reason)
        self.ino = ino


def parts_of(directory: str, path: str) -> list[str]:
    """`path`'s components below `directory`; ValueError for a path outside it."""
    parts = os.path.relpath(path, directory).split(os.sep)
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"kv cache path {path!r} is not inside kv_cache_dir={directory!r}")
    return parts


@contextmanager
def folder(directory: str, parts: list[str], create: bool = False) -> Iterator[int]:
    """An fd of directory/parts..., each component opened without following a symlink.
    FileNotFoundError for a missing one (created with `create`); Hostile for one that is not a
    real folder (removed first; with `create` a real one takes its place and nothing is raised)."""
    fds = [os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        for i, name in enumerate(parts):
            fds.append(_open_folder(fds[-1], name, os.path.join(directory, *parts[:i + 1]), create))
        yield fds[-1]
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _open_folder(parent: int, name: str, path: str, create: bool) -> int:
    for _ in range(3):
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            hostile = Hostile(path, remove(parent, name))
            if not create:
                raise hostile from None
            report_hostile(hostile)
        try:
            os.mkdir(name, 0o755, dir_fd=parent)
        except FileExistsError:
            pass  # another process made it meanwhile
    raise OSError(errno.EAGAIN, f"{path} keeps changing while it is opened")


def remove(parent: int, name: str, ino: int | None = None) -> str:
    """Unlink entry `name` of folder fd `parent` (a symlink itself, never its target; an empty
    folder too), only if it is still inode `ino` when given. Says what it was and what became of
    it ("a FIFO; removed", ...)."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return "gone"
    what = kind_of(st.st_mode)
    if ino is not None and st.st_ino != ino:
        return f"{what}; replaced meanwhile, left alone"
    try:
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(name, dir_fd=parent)
        else:
            os.unlink(name, dir_fd=parent)
    except FileNotFoundError:
        return f"{what}; gone"
    except OSError as e:
        return f"{what}; could not be removed ({e.strerror})"
    return f"{what}; removed"


def read_regular(parent: int, name: str, path: str,
                 check_size: Callable[[int, bytes], str | None]) -> tuple[bytes, int]:
    """(the bytes, the inode) of regular file `name` in folder fd `parent`. `check_size(size,
    first 8 bytes)` says why the size is wrong (BadSize, before anything more is read) or None.
    FileNotFoundError when missing; Hostile (after removing it) for anything but a regular file."""
    try:
        fd, fst = open_regular(name, parent)  # lstat, O_NOFOLLOW open, fstat: regular, same inode
    except NotRegular as e:
        raise Hostile(path, remove(parent, name, e.ino)) from None
    try:
        wrong = check_size(fst.st_size, os.pread(fd, 8, 0))
        if wrong is not None:
            raise BadSize(wrong, fst.st_ino)
        return _read_exactly(fd, fst.st_size, fst.st_ino), fst.st_ino
    finally:
        os.close(fd)


def _read_exactly(fd: int, size: int, ino: int) -> bytes:
    parts, got = [], 0
    while got < size:
        chunk = os.pread(fd, size - got, got)
        if not chunk:
            raise BadSize(f"shrank to {got} bytes while read (was {size})", ino)
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def write_new(parent: int, name: str, data: bytes, mtime_ns: int | None = None) -> None:
    """Create regular file `name` (it must not exist) in folder fd `parent` with `data`."""
    fd = os.open(name, _WRITE_FLAGS, 0o644, dir_fd=parent)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if mtime_ns is not None:
            os.utime(fd, ns=(mtime_ns, mtime_ns))
    finally:
        os.close(fd)


def exists_regular(parent: int, name: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def open_lock(directory: str) -> int:
    """An fd of <directory>/.lock for flock: a regular file, created if missing; anything else
    found there is removed first (reported as Hostile after the lock file is made)."""
    with folder(directory, []) as top:
        hostile = None
        try:
            st = os.stat(".lock", dir_fd=top, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                hostile = Hostile(os.path.join(directory, ".lock"), remove(top, ".lock", st.st_ino))
        except FileNotFoundError:
            pass
        fd = os.open(".lock", _LOCK_FLAGS, 0o644, dir_fd=top)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{os.path.join(directory, '.lock')} is not a regular file")
    if hostile is not None:
        report_hostile(hostile)
    return fd


def scan(directory: str, keep: Callable[[str], bool]) -> Iterator[tuple[os.DirEntry, os.stat_result]]:
    """(entry, lstat) of every regular file under `directory` whose name `keep` accepts, recursing
    into real folders only (never a symlink); vanished entries are skipped, nothing is opened."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            yield from scan(entry.path, keep)
        elif stat.S_ISREG(st.st_mode) and keep(entry.name):
            yield entry, st


def remove_file(directory: str, path: str, ino: int | None = None) -> str:
    """Remove `path` (inside `directory`) without following a symlink on the way; see `remove`."""
    parts = parts_of(directory, path)
    try:
        with folder(directory, parts[:-1]) as parent:
            return remove(parent, parts[-1], ino)
    except (FileNotFoundError, Hostile):
        return "gone"


def report_hostile(error: Hostile) -> None:
    """The one warning for an entry removed on the way to creating ours."""
    _log.warning("kv cache entry %s", error)
