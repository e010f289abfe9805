"""Opening a file that must be a regular file, never through a symlink, never a FIFO or a device.

Shared by the saved KV cache's reader (worker/kv_dir_io.py) and the LoRA adapter reader
(loader/lora_files.py):

    open_regular(name, dir_fd)   lstat first: only a regular file is opened, with O_NOFOLLOW |
                                 O_NONBLOCK | O_NOCTTY, then fstat on the fd: still a regular file,
                                 still the same inode -> (fd, fstat); NotRegular otherwise
    kind_of(mode)                "a symlink", "a FIFO", ... for a message

The caller checks the fstat size before reading, so a read never allocates more than the caller
said the file may hold.
"""

from __future__ import annotations

import os
import stat

READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


class NotRegular(Exception):
    """The entry is not a regular file (`what`: what it is), or was swapped for another after its
    lstat; `ino` is the inode found, for a caller that removes the entry only if it is still that."""

    def __init__(self, what: str, ino: int):
        super().__init__(what)
        self.what, self.ino = what, ino


def kind_of(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else f"a file of mode {mode:o}"


def open_regular(name: str, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """(fd, fstat) of regular file `name` (relative to folder fd `dir_fd` when given), opened without
    following a symlink. FileNotFoundError when missing; NotRegular for anything else; the caller
    closes the fd."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(kind_of(st.st_mode), st.st_ino)
    fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    try:
        fst = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(fst.st_mode) or fst.st_ino != st.st_ino:  # swapped after the lstat
        os.close(fd)
        raise NotRegular(f"{kind_of(fst.st_mode)}, put in place while it was opened", fst.st_ino)
    return fd, fst
