"""The on-disk tier of the KV prefix cache: a saved cache the next start-up uses.

One safetensors file per cached unit, named by `contracts.kv_files` (read that module for the
layout). Writes are queued and done by one daemon thread, so `save` never waits on the disk:

    save() -> queue -> writer thread: serialize -> <folder>/.<name>.<pid>.<hex>.tmp
                                      flock <dir>/.lock: evict oldest-by-mtime until it fits,
                                      os.replace(tmp, final), unlock

Invariants:
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
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from safetensors.torch import deserialize
from safetensors.torch import save as serialize

from deepinfer.contracts import kv_files

_log = logging.getLogger("deepinfer.kv_disk")

_LOCK_NAME = ".lock"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 3600.0
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
        _check_writable(directory, kv_files.root_dir(directory, root))
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

    def load(self, path: str, kind: str, key: str, touch_ns: int | None = None) -> dict[str, torch.Tensor] | None:
        """Read and verify one file; None when missing (silently) or damaged, truncated or foreign
        (logged; a damaged file of ours is deleted). A hit touches the file's mtime (LRU): now,
        or `touch_ns`."""
        try:
            with open(path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._count(load_failures=1)
            _log.warning("kv cache file %s could not be read: %s", path, e)
            return None
        try:
            tensors = self._verify(data, kind, key)
        except _BadFile as e:
            self._reject(path, inode, e)
            return None
        self._count(bytes_read=len(data), files_read=1)
        _touch(path, touch_ns)
        return tensors

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

    def _reject(self, path: str, inode: int, error: _BadFile) -> None:
        """Log a bad file; delete it when it is ours (and still the same file we read)."""
        self._count(load_failures=1)
        if error.foreign:
            _log.warning("kv cache file %s is foreign (%s); left alone, read as a miss", path, error)
            return
        _log.warning("kv cache file %s is damaged (%s); deleted", path, error)
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            _log.warning("kv cache file %s could not be deleted: %s", path, e)

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
        """Serialize to a temporary file next to `path`, make room under the lock, rename in."""
        if os.path.exists(path):
            return
        tensors = {name: t.detach().contiguous() for name, t in tensors.items()}
        meta = {**extra, "format": kv_files.KV_FILE_FORMAT, "version": kv_files.KV_FILE_VERSION,
                "root": self.root, "key": key, "kind": kind, "checksum": tensors_checksum(tensors)}
        data = serialize(tensors, metadata=meta)
        if len(data) > self.max_bytes:
            self._warn_oversize(path, len(data))
            return
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            with _dir_lock(self.directory):
                if os.path.exists(path):
                    return
                if not self._make_room(len(data), mtime_ns):
                    return  # it would be the first to go: keep what is there
                if mtime_ns is not None:
                    os.utime(tmp, ns=(mtime_ns, mtime_ns))
                os.replace(tmp, path)
        finally:
            _remove_quietly(tmp)
        self._count(bytes_written=len(data), files_written=1)

    def _make_room(self, new_bytes: int, new_mtime_ns: int | None = None) -> bool:
        """Delete the least recently used files until the directory holds `new_bytes` more;
        False (nothing deleted) when the new file, of recency `new_mtime_ns`, would be the least
        recently used itself. Call with the directory lock held."""
        files = sorted(_scan_files(self.directory, clean_tmp=True))  # (mtime_ns, size, path)
        total = sum(size for _, size, _ in files)
        over = total + new_bytes - self.max_bytes
        if over > 0 and new_mtime_ns is not None and files and new_mtime_ns < files[0][0]:
            return False
        for _, size, old in files:
            if total + new_bytes <= self.max_bytes:
                break
            try:
                os.unlink(old)
                self._count(files_evicted=1)
            except FileNotFoundError:
                pass  # another process deleted it; it no longer counts either way
            total -= size
        return True

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


def _check_writable(directory: str, folder: str) -> None:
    """Create `folder` (under `directory`) and prove a file can be made and removed in it."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_cache_dir={directory!r} cannot be created: {e}") from e
    probe = os.path.join(folder, f".probe.{os.getpid()}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
    try:
        with open(probe, "wb"):
            pass
        os.unlink(probe)
        with open(os.path.join(directory, _LOCK_NAME), "ab"):
            pass
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


@contextmanager
def _dir_lock(directory: str) -> Iterator[None]:
    """An exclusive flock on <directory>/.lock, shared by every process using the directory."""
    with open(os.path.join(directory, _LOCK_NAME), "ab") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _walk(folder: str, clean_tmp: bool = False) -> Iterator[os.DirEntry]:
    """Every *.safetensors file under `folder`, recursively; vanished entries are skipped.
    With clean_tmp, leftover temporary files older than an hour are removed on the way."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                yield from _walk(entry.path, clean_tmp)
            elif entry.name.endswith(kv_files.KV_FILE_SUFFIX):
                yield entry
            elif clean_tmp and entry.name.endswith(_TMP_SUFFIX):
                if time.time() - entry.stat().st_mtime > _STALE_TMP_S:
                    _remove_quietly(entry.path)
        except FileNotFoundError:
            continue


def _scan_files(directory: str, clean_tmp: bool = False) -> list[tuple[int, int, str]]:
    """(mtime_ns, size, path) of every cache file under `directory`."""
    files = []
    for entry in _walk(directory, clean_tmp):
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        files.append((st.st_mtime_ns, st.st_size, entry.path))
    return files


def _touch(path: str, mtime_ns: int | None = None) -> None:
    try:
        if mtime_ns is None:
            os.utime(path)
        else:
            os.utime(path, ns=(mtime_ns, mtime_ns))
    except OSError:
        pass  # evicted meanwhile, or a read-only directory: the hit still counts


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def scan_kv_dir(directory: str) -> dict:
    """For `deepinfer info`: the files under a KV cache directory, in all and per model folder.

    {"path": directory, "entries": n, "bytes": b, "models": {root16: {"entries": n, "bytes": b}}};
    a missing directory gives 0 entries and 0 bytes."""
    report: dict = {"path": directory, "entries": 0, "bytes": 0, "models": {}}
    for _, size, path in _scan_files(directory):
        report["entries"] += 1
        report["bytes"] += size
        top = os.path.relpath(path, directory).split(os.sep)[0]
        if top != os.path.basename(path):
            model = report["models"].setdefault(top, {"entries": 0, "bytes": 0})
            model["entries"] += 1
            model["bytes"] += size
    return report
