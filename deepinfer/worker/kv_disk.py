"""The on-disk tier of the KV prefix cache: a saved cache the next start-up uses.

One safetensors file per cached unit, named by `contracts.kv_files` (read that module for the
layout). Writes are queued and done by one daemon thread, so `save` never waits on the disk:

    save() -> queue -> writer thread: serialize -> <folder>/.<name>.<pid>.<hex>.tmp
                                      flock <dir>/.lock: evict oldest-by-mtime until it fits,
                                      os.replace(tmp, final), unlock

Invariants:
  * only regular files the store wrote are read: every path inside the directory is walked without
    following a symlink, a FIFO or device node is never opened, and a file's size is checked
    against what the unit must hold before it is read (memory stays bounded by one unit);
    anything else is removed (a symlink itself, never its target) with one warning, a miss
    (`kv_dir_io`); the start-up checks, the budget's scan and the lock file take the same care;
  * a reader never sees a partial file (the final name only ever appears by rename);
  * the total size of all *.safetensors files under the directory never exceeds max_bytes, even
    with several processes sharing it (all of them evict and rename under the same flock);
  * `load` never raises for a bad file: a damaged or truncated file of ours is deleted, a foreign
    one (another root, format or version) is left alone; both are logged and read as a miss;
  * a successful `load` touches the file's mtime, so eviction drops the least recently used.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from safetensors.torch import deserialize
from safetensors.torch import save as serialize

from deepinfer.contracts import kv_files
from deepinfer.worker import kv_dir_io

_log = logging.getLogger("deepinfer.kv_disk")

_TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 3600.0
_MAX_HEADER_BYTES = 1 << 20  # a unit's safetensors header (names, shapes, metadata) is far smaller
_RESERVED_META = ("format", "version", "root", "key", "kind", "checksum")
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class _BadFile(Exception):
    """A file that must read as a miss; `foreign` ones belong to someone else and are kept."""

    def __init__(self, reason: str, foreign: bool = False):
        super().__init__(reason)
        self.foreign = foreign


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """blake2b-128 over each tensor in name order: name, dtype, shape, raw bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(name.encode())
        digest.update(str(t.dtype).encode())
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # raw bytes, any dtype
    return digest.hexdigest()


class KvDiskStore:
    """Saved KV units under `directory`, at most `max_bytes` in all, for one cache identity `root`.

    Counters (ints, updated as work happens): bytes_written, bytes_read, files_written,
    files_read, files_evicted, load_failures.
    """

    def __init__(self, directory: str, max_bytes: int, root: str, min_file_bytes: int = 1):
        """Creates the directory and its root folder; starts one daemon writer thread.

        Raises ValueError naming `kv_cache_dir` when the folder cannot be created or written, and
        `kv_cache_dir_size` when max_bytes < min_file_bytes (the store could not hold one file)."""
        if max_bytes < min_file_bytes:
            raise ValueError(f"kv_cache_dir_size={max_bytes} bytes is smaller than one cache file "
                             f"({min_file_bytes} bytes); raise it or leave kv_cache_dir unset")
        self.directory = directory
        self.max_bytes = max_bytes
        self.root = root
        _check_writable(directory, root)
        self.bytes_written = self.bytes_read = 0
        self.files_written = self.files_read = self.files_evicted = self.load_failures = 0
        self._stats_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._pending: set[str] = set()
        self._closed = False
        self._warned_oversize = False
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    # ---- public interface ----------------------------------------------------------------

    def save(self, path: str, kind: str, key: str, tensors: dict[str, torch.Tensor],
             meta: dict[str, str] | None = None, mtime_ns: int | None = None) -> None:
        """Queue a write and return at once. `tensors` are CPU tensors the store now owns (the
        caller made copies). Writing a path that exists (or is already queued) is a no-op.
        `mtime_ns` sets the file's recency for eviction (default: when it is written)."""
        extra = dict(meta or {})
        for name, value in extra.items():
            if name in _RESERVED_META or not isinstance(value, str):
                raise ValueError(f"meta[{name!r}]={value!r}: keys {_RESERVED_META} are reserved, values must be str")
        with self._queue_lock:
            if self._closed:
                raise RuntimeError(f"KvDiskStore({self.directory!r}) is closed; save({path!r}) refused")
            if path in self._pending:
                return
            self._pending.add(path)
            self._queue.put((path, kind, key, tensors, extra, mtime_ns))

    def load(self, path: str, kind: str, key: str, touch_ns: int | None = None,
             payload_bytes: int | None = None) -> dict[str, torch.Tensor] | None:
        """Read and verify one file; None when missing (silently) or unusable, with one warning:
        not a regular file (removed; a symlink is unlinked, never followed), of the wrong size
        (checked before it is read: `payload_bytes`, the unit's tensor bytes, when given, and
        never more than the directory's budget) or damaged (deleted), or foreign (left alone). A
        hit touches the file's mtime (LRU): now, or `touch_ns`."""
        parts, inode = kv_dir_io.parts_of(self.directory, path), None
        try:
            with kv_dir_io.folder(self.directory, parts[:-1]) as parent:
                data, inode = kv_dir_io.read_regular(parent, parts[-1], path, self._size_check(payload_bytes))
                tensors = self._verify(data, kind, key)
                _touch(parent, parts[-1], touch_ns)
        except FileNotFoundError:
            return None
        except kv_dir_io.Hostile as e:
            self._count(load_failures=1)
            _log.warning("kv cache entry %s", e)
            return None
        except kv_dir_io.BadSize as e:
            self._reject(path, e.ino, _BadFile(str(e)))
            return None
        except _BadFile as e:
            self._reject(path, inode, e)
            return None
        except OSError as e:
            self._count(load_failures=1)
            _log.warning("kv cache file %s could not be read: %s", path, e)
            return None
        self._count(bytes_read=len(data), files_read=1)
        return tensors

    def _size_check(self, payload_bytes: int | None) -> Callable[[int, bytes], str | None]:
        """Why a file of `size` bytes starting with `head` cannot be a unit (None if it may be)."""
        def check(size: int, head: bytes) -> str | None:
            if size > self.max_bytes:
                return f"{size} bytes, more than kv_cache_dir_size={self.max_bytes}"
            header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 <= header_len <= _MAX_HEADER_BYTES or 8 + header_len > size:
                return f"a header of {header_len} bytes in a file of {size}"
            if payload_bytes is not None and size - 8 - header_len != payload_bytes:
                return f"{size - 8 - header_len} bytes of tensors where the unit holds {payload_bytes}"
            return None
        return check

    def flush(self) -> None:
        """Block until every queued write is on disk (or dropped)."""
        self._queue.join()

    def close(self) -> None:
        """Flush, then stop the writer thread. Idempotent; `save` afterwards raises RuntimeError."""
        with self._queue_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()

    # ---- reading -------------------------------------------------------------------------

    def _verify(self, data: bytes, kind: str, key: str) -> dict[str, torch.Tensor]:
        """The tensors of a file's bytes, or _BadFile saying why they cannot be used."""
        meta = _header_metadata(data)
        expected = {"format": kv_files.KV_FILE_FORMAT, "version": kv_files.KV_FILE_VERSION, "root": self.root}
        for name, want in expected.items():
            if meta.get(name) != want:
                raise _BadFile(f"{name} is {meta.get(name)!r}, expected {want!r}", foreign=True)
        for name, want in (("kind", kind), ("key", key)):
            if meta.get(name) != want:
                raise _BadFile(f"{name} is {meta.get(name)!r}, expected {want!r}")
        tensors = _parse_tensors(data)
        if tensors_checksum(tensors) != meta.get("checksum"):
            raise _BadFile("checksum mismatch")
        return tensors

    def _reject(self, path: str, inode: int | None, error: _BadFile) -> None:
        """Log a bad file; delete it when it is ours (and still the same file we read)."""
        self._count(load_failures=1)
        if error.foreign:
            _log.warning("kv cache file %s is foreign (%s); left alone, read as a miss", path, error)
            return
        _log.warning("kv cache file %s is damaged (%s); deleted", path, error)
        kv_dir_io.remove_file(self.directory, path, inode)

    # ---- writing -------------------------------------------------------------------------

    def _run(self) -> None:
        """The writer thread: one job at a time; an exception drops that file, never the thread."""
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(*job)
            except Exception:
                _log.exception("kv cache file %s could not be written; dropped", job[0])
            finally:
                if job is not None:
                    with self._queue_lock:
                        self._pending.discard(job[0])
                self._queue.task_done()

    def _write(self, path: str, kind: str, key: str, tensors: dict[str, torch.Tensor],
               extra: dict[str, str], mtime_ns: int | None = None) -> None:
        """Serialize to a temporary file next to `path`, make room under the lock, rename in.
        The folder is reached without following a symlink (one found is replaced by a folder)."""
        parts = kv_dir_io.parts_of(self.directory, path)
        name, tmp = parts[-1], f".{parts[-1]}.{os.getpid()}.{uuid.uuid4().hex}{_TMP_SUFFIX}"
        with kv_dir_io.folder(self.directory, parts[:-1], create=True) as parent:
            if kv_dir_io.exists_regular(parent, name):
                return
            tensors = {n: t.detach().contiguous() for n, t in tensors.items()}
            meta = {**extra, "format": kv_files.KV_FILE_FORMAT, "version": kv_files.KV_FILE_VERSION,
                    "root": self.root, "key": key, "kind": kind, "checksum": tensors_checksum(tensors)}
            data = serialize(tensors, metadata=meta)
            if len(data) > self.max_bytes:
                self._warn_oversize(path, len(data))
                return
            try:
                kv_dir_io.write_new(parent, tmp, data, mtime_ns)
                with self._dir_lock():
                    if kv_dir_io.exists_regular(parent, name):
                        return
                    if not self._make_room(len(data), mtime_ns):
                        return  # it would be the first to go: keep what is there
                    os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            finally:
                kv_dir_io.remove(parent, tmp)
        self._count(bytes_written=len(data), files_written=1)

    @contextmanager
    def _dir_lock(self) -> Iterator[None]:
        """An exclusive flock on <directory>/.lock, shared by every process using the directory
        (a regular file: anything else found under that name is replaced)."""
        fd = kv_dir_io.open_lock(self.directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _make_room(self, new_bytes: int, new_mtime_ns: int | None = None) -> bool:
        """Delete the least recently used files until the directory holds `new_bytes` more;
        False (nothing deleted) when the new file, of recency `new_mtime_ns`, would be the least
        recently used itself, or when it cannot fit at all. Call with the directory lock held."""
        files = _scan_files(self.directory, clean_tmp=True)  # (mtime_ns, size, path, inode)
        total = sum(size for _, size, _, _ in files)
        files = sorted(f for f in files if f[2].endswith(kv_files.KV_FILE_SUFFIX))  # canary records stay
        over = total + new_bytes - self.max_bytes
        if over > 0 and new_mtime_ns is not None and files and new_mtime_ns < files[0][0]:
            return False
        for _, size, old, inode in files:
            if total + new_bytes <= self.max_bytes:
                break
            if kv_dir_io.remove_file(self.directory, old, inode) == "a regular file; removed":
                self._count(files_evicted=1)  # else another process deleted it: it no longer counts
            total -= size
        return total + new_bytes <= self.max_bytes  # the canary records alone may leave too little

    def _warn_oversize(self, path: str, num_bytes: int) -> None:
        if not self._warned_oversize:
            self._warned_oversize = True
            _log.warning("kv cache file %s (%d bytes) is larger than kv_cache_dir_size=%d; "
                         "files this large are not saved", path, num_bytes, self.max_bytes)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)


# ---- helpers ---------------------------------------------------------------------------------


def _check_writable(directory: str, root: str) -> None:
    """Create the root folder of `root` (under `directory`, never through a symlink) and the lock
    file, and prove a file can be made and removed there."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_cache_dir={directory!r} cannot be created: {e}") from e
    probe = f".probe.{os.getpid()}.{uuid.uuid4().hex}{_TMP_SUFFIX}"
    try:
        with kv_dir_io.folder(directory, [os.path.basename(kv_files.root_dir(directory, root))], create=True) as parent:
            kv_dir_io.write_new(parent, probe, b"")
            os.unlink(probe, dir_fd=parent)
        os.close(kv_dir_io.open_lock(directory))
    except OSError as e:
        raise ValueError(f"kv_cache_dir={directory!r} is not writable: {e}") from e


def _header_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors header, or _BadFile when the header is unreadable."""
    try:
        header_len = int.from_bytes(data[:8], "little")
        if len(data) < 8 or 8 + header_len > len(data):
            raise ValueError(f"header of {header_len} bytes in a file of {len(data)}")
        meta = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
        if not isinstance(meta, dict):
            raise ValueError("__metadata__ is not a mapping")
        return meta
    except Exception as e:
        raise _BadFile(f"unreadable header: {e}") from e


def _parse_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, in memory we own (no mmap); _BadFile when malformed."""
    try:
        tensors = {}
        for name, view in deserialize(data):
            buf = view["data"] if isinstance(view["data"], bytearray) else bytearray(view["data"])
            dtype = _DTYPES[view["dtype"]]
            if len(buf) == 0:
                tensors[name] = torch.empty(view["shape"], dtype=dtype)
            else:
                tensors[name] = torch.frombuffer(buf, dtype=dtype).reshape(view["shape"])
        return tensors
    except Exception as e:
        raise _BadFile(f"unparsable safetensors: {type(e).__name__}: {e}") from e


def _scan_files(directory: str, clean_tmp: bool = False) -> list[tuple[int, int, str, int]]:
    """(mtime_ns, size, path, inode) of every cache file and canary record (regular files only:
    symlinks, FIFOs and devices are neither followed nor opened nor counted) under `directory`.
    With clean_tmp, leftover temporary files older than an hour are removed on the way."""
    def keep(name: str) -> bool:
        return name.endswith(kv_files.KV_FILE_SUFFIX) or name == kv_files.CANARY_RECORD or \
            (clean_tmp and name.endswith(_TMP_SUFFIX))

    files, now = [], time.time()
    for entry, st in kv_dir_io.scan(directory, keep):
        if entry.name.endswith(_TMP_SUFFIX):
            if now - st.st_mtime > _STALE_TMP_S:
                kv_dir_io.remove_file(directory, entry.path, st.st_ino)
            continue
        files.append((st.st_mtime_ns, st.st_size, entry.path, st.st_ino))
    return files


def _touch(parent: int, name: str, mtime_ns: int | None = None) -> None:
    """Set entry `name`'s mtime (now, or mtime_ns), never through a symlink."""
    try:
        if mtime_ns is None:
            os.utime(name, dir_fd=parent, follow_symlinks=False)
        else:
            os.utime(name, ns=(mtime_ns, mtime_ns), dir_fd=parent, follow_symlinks=False)
    except OSError:
        pass  # evicted meanwhile, or a read-only directory: the hit still counts


def scan_kv_dir(directory: str) -> dict:
    """For `deepinfer info`: the files under a KV cache directory, in all and per model folder.

    {"path": directory, "entries": n, "bytes": b, "models": {root16: {"entries": n, "bytes": b}}};
    a missing directory gives 0 entries and 0 bytes."""
    report: dict = {"path": directory, "entries": 0, "bytes": 0, "models": {}}
    for _, size, path, _ in _scan_files(directory):
        if not path.endswith(kv_files.KV_FILE_SUFFIX):
            continue
        report["entries"] += 1
        report["bytes"] += size
        top = os.path.relpath(path, directory).split(os.sep)[0]
        if top != os.path.basename(path):
            model = report["models"].setdefault(top, {"entries": 0, "bytes": 0})
            model["entries"] += 1
            model["bytes"] += size
    return report
