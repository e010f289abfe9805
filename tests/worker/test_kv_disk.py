"""The on-disk KV cache tier: round trips, every kind of bad file read as a miss, the byte budget
with LRU eviction (also across two processes sharing one directory), and the config errors."""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import shutil
import tempfile
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.contracts import kv_files
from deepinfer.worker.kv_disk import KvDiskStore, scan_kv_dir, tensors_checksum

ROOT = "a1" * 32
OTHER_ROOT = "b2" * 32
LOGGER = "deepinfer.kv_disk"


def key_of(i: int) -> str:
    return f"{i:064x}"


def block(i: int, nbytes: int = 1000) -> dict[str, torch.Tensor]:
    """A unit whose content depends on i, always the same size."""
    return {"kv": torch.full((nbytes,), i % 251, dtype=torch.uint8)}


@pytest.fixture
def store(tmp_path):
    s = KvDiskStore(str(tmp_path / "kv"), 1 << 30, ROOT)
    yield s
    s.close()


def put(store: KvDiskStore, i: int, kind: str = "full", **kw) -> str:
    path = kv_files.unit_file(store.directory, store.root, key_of(i), kind)
    store.save(path, kind, key_of(i), block(i, **kw))
    return path


def dir_bytes(directory: str) -> int:
    return scan_kv_dir(directory)["bytes"]


def test_round_trip_keeps_dtypes_shapes_values_and_metadata(store):
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(4, 2).to(torch.bfloat16),
        "u8": torch.arange(7, dtype=torch.uint8),
        "i64": torch.tensor([[-(2**40), 3], [5, 2**50]], dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }
    path = kv_files.unit_file(store.directory, ROOT, key_of(1), kv_files.SNAPSHOT)
    store.save(path, kv_files.SNAPSHOT, key_of(1), {k: v.clone() for k, v in tensors.items()}, {"rows": "12"})
    store.flush()
    loaded = store.load(path, kv_files.SNAPSHOT, key_of(1))
    assert loaded is not None and sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(loaded[name], t), name
    loaded["u8"][0] = 9  # our own memory, writable
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert meta["rows"] == "12" and meta["root"] == ROOT and meta["kind"] == kv_files.SNAPSHOT
    assert meta["format"] == kv_files.KV_FILE_FORMAT and meta["version"] == kv_files.KV_FILE_VERSION
    assert meta["checksum"] == tensors_checksum(tensors)
    size = os.path.getsize(path)
    assert (store.files_written, store.bytes_written, store.files_read, store.bytes_read) == (1, size, 1, size)


def test_saving_an_existing_path_is_a_no_op(store):
    path = put(store, 1)
    store.flush()
    store.save(path, "full", key_of(1), block(2))  # different content, same unit: skipped
    store.flush()
    assert store.files_written == 1
    assert torch.equal(store.load(path, "full", key_of(1))["kv"], block(1)["kv"])


def test_missing_file_is_a_silent_miss(store, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    path = kv_files.unit_file(store.directory, ROOT, key_of(3), "full")
    assert store.load(path, "full", key_of(3)) is None
    assert caplog.records == [] and store.load_failures == 0


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 10)


def _flip_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0x01]))


def _garbage(path: str) -> None:
    with open(path, "wb") as f:
        f.write(os.urandom(300))


@pytest.mark.parametrize("damage", [_truncate, _flip_payload_byte, _garbage])
def test_damaged_file_is_a_logged_miss_and_deleted(store, caplog, damage):
    path = put(store, 4)
    store.flush()
    damage(path)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.load(path, "full", key_of(4)) is None
    assert any(path in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
    assert not os.path.exists(path)
    assert store.load_failures == 1


def test_file_of_another_root_is_a_logged_miss_left_alone(store, caplog):
    other = KvDiskStore(store.directory, 1 << 30, OTHER_ROOT)
    theirs = put(other, 5)
    other.close()
    ours = kv_files.unit_file(store.directory, ROOT, key_of(5), "full")
    shutil.copyfile(theirs, ours)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.load(ours, "full", key_of(5)) is None
    assert any(ours in r.getMessage() and "foreign" in r.getMessage() for r in caplog.records)
    assert os.path.exists(ours) and os.path.exists(theirs)


def test_file_of_another_version_is_left_alone(store, caplog):
    tensors = block(6)
    meta = {"format": kv_files.KV_FILE_FORMAT, "version": "999", "root": ROOT, "key": key_of(6),
            "kind": "full", "checksum": tensors_checksum(tensors)}
    path = kv_files.unit_file(store.directory, ROOT, key_of(6), "full")
    save_file(tensors, path, metadata=meta)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.load(path, "full", key_of(6)) is None
    assert os.path.exists(path) and "version" in caplog.text


@pytest.mark.parametrize("kind, key", [("swa", key_of(7)), ("full", key_of(8))])
def test_kind_or_key_mismatch_is_a_miss(store, kind, key):
    path = put(store, 7)
    store.flush()
    assert store.load(path, kind, key) is None
    assert store.load_failures == 1


def _age(paths: list[str], seconds_ago: float) -> None:
    """Give files distinct, old mtimes, oldest first (file timestamps are too coarse otherwise)."""
    now = time.time()
    for i, path in enumerate(paths):
        os.utime(path, (now - seconds_ago + i, now - seconds_ago + i))


def test_budget_is_never_exceeded_and_eviction_is_least_recently_used(tmp_path):
    probe = KvDiskStore(str(tmp_path / "probe"), 1 << 30, ROOT)
    put(probe, 0)
    probe.close()
    file_bytes = dir_bytes(probe.directory)
    budget = 4 * file_bytes + file_bytes // 2  # room for four files
    store = KvDiskStore(str(tmp_path / "kv"), budget, ROOT, min_file_bytes=file_bytes)
    paths = [put(store, i) for i in range(4)]
    store.flush()
    _age(paths, 100)
    assert store.load(paths[0], "full", key_of(0)) is not None  # touched: now the newest
    for i in range(4, 6):
        put(store, i)
        store.flush()
        assert dir_bytes(store.directory) <= budget
    assert [os.path.exists(p) for p in paths] == [True, False, False, True]
    for i in range(6, 30):
        put(store, i)
        if i % 3 == 0:
            store.flush()
            assert dir_bytes(store.directory) <= budget
    store.close()
    assert dir_bytes(store.directory) <= budget and scan_kv_dir(store.directory)["entries"] == 4
    assert store.files_written == 30 and store.files_evicted == 26


def test_file_larger_than_the_budget_is_skipped_with_one_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = KvDiskStore(str(tmp_path / "kv"), 800, ROOT)
    big = [put(store, i, nbytes=1000) for i in range(2)]
    store.close()
    assert not any(os.path.exists(p) for p in big) and store.files_written == 0
    assert len([r for r in caplog.records if "larger than" in r.getMessage()]) == 1


def test_writer_thread_survives_a_failed_write(store, caplog):
    caplog.set_level(logging.ERROR, logger=LOGGER)
    bad = kv_files.unit_file(store.directory, ROOT, key_of(9), "full")
    store.save(bad, "full", key_of(9), {"kv": "not a tensor"})  # type: ignore[dict-item]
    good = put(store, 10)
    store.flush()
    assert not os.path.exists(bad) and store.load(good, "full", key_of(10)) is not None
    assert bad in caplog.text
    assert not [n for _, _, names in os.walk(store.directory) for n in names if n.endswith(".tmp")]


def test_stale_temporary_files_are_removed(store):
    stale = os.path.join(kv_files.root_dir(store.directory, ROOT), ".x.safetensors.1.ab.tmp")
    fresh = stale.replace(".ab.", ".cd.")
    for path in (stale, fresh):
        open(path, "wb").close()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    put(store, 11)
    store.flush()
    assert not os.path.exists(stale) and os.path.exists(fresh)


def _writer_process(directory: str, budget: int, first: int, count: int) -> None:
    """One process's share of the concurrent test: many saves into the shared directory."""
    store = KvDiskStore(directory, budget, ROOT)
    for i in range(first, first + count):
        put(store, i)
    store.close()


def _locked_bytes(directory: str) -> int:
    """The directory total as the writers see it: sampled under their lock."""
    with open(os.path.join(directory, ".lock"), "ab") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            return dir_bytes(directory)
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def test_writer_renames_only_under_the_directory_lock(store):
    with open(os.path.join(store.directory, ".lock"), "ab") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # as another process evicting would
        path = put(store, 12)
        time.sleep(0.3)
        assert not os.path.exists(path)
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    store.flush()
    assert os.path.exists(path)


@pytest.mark.slow
def test_two_processes_share_one_directory_within_budget(tmp_path):
    directory = str(tmp_path / "kv")
    reader = KvDiskStore(directory, 1 << 30, ROOT)
    put(reader, 0)
    reader.flush()
    budget = 10 * dir_bytes(directory) + 100
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer_process, args=(directory, budget, first, 60)) for first in (1, 31)]
    for p in procs:
        p.start()
    samples = []
    while any(p.is_alive() for p in procs):
        samples.append(_locked_bytes(directory))
        time.sleep(0.005)
    assert all(p.exitcode == 0 for p in procs)
    assert max(samples) <= budget and dir_bytes(directory) <= budget
    names = [n for _, _, files in os.walk(directory) for n in files if n.endswith(kv_files.KV_FILE_SUFFIX)]
    assert len(names) == 10
    for name in names:
        key, kind, _ = name.split(".")
        loaded = reader.load(os.path.join(kv_files.root_dir(directory, ROOT), name), kind, key)
        assert loaded is not None and torch.equal(loaded["kv"], block(int(key, 16))["kv"])
    assert reader.load_failures == 0
    reader.close()


def test_directory_under_a_file_is_rejected(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ValueError, match="kv_cache_dir=.*file/kv"):
        KvDiskStore(str(afile / "kv"), 1 << 20, ROOT)


NOBODY = 65534  # the unprivileged uid and gid the writability test drops to when it runs as root


def _as_unprivileged(fn) -> str:
    """Run `fn()` as a user who cannot write where it may not: this process when it is not root; as
    root (CI), a forked child that drops to uid/gid `nobody` first (root writes into any folder).
    Returns "" when `fn` returned, else `"<type>: <message>"` of what it raised."""
    if os.geteuid() != 0:
        try:
            fn()
            return ""
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        outcome = b"child died"
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            outcome = b""
        except BaseException as e:  # noqa: BLE001
            outcome = f"{type(e).__name__}: {e}".encode()
        finally:
            os.write(write_end, outcome)
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        outcome = f.read().decode()
    os.waitpid(pid, 0)
    return outcome


def test_read_only_directory_is_rejected():
    """A folder its user may read but not write: ValueError naming kv_cache_dir, also when the tests
    run as root (then as `nobody` in a forked child), while a folder that user owns is accepted (the
    refusal is the folder's, not the child's). Fails if the store stops probing writability."""
    base = tempfile.mkdtemp(prefix="kv-perm-")  # outside pytest's root-only 0700 tree
    try:
        os.chmod(base, 0o755)
        read_only, writable = os.path.join(base, "ro"), os.path.join(base, "rw")
        os.mkdir(read_only, 0o555)
        os.mkdir(writable, 0o755)
        if os.geteuid() == 0:
            os.chown(writable, NOBODY, NOBODY)
        refused = _as_unprivileged(lambda: KvDiskStore(read_only, 1 << 20, ROOT))
        assert refused.startswith("ValueError: kv_cache_dir=") and "is not writable" in refused, refused
        assert os.listdir(read_only) == []
        assert _as_unprivileged(lambda: KvDiskStore(writable, 1 << 20, ROOT).close()) == ""
    finally:
        shutil.rmtree(base)  # "ro" is empty: removing it needs only base's write bit


def test_budget_below_one_file_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dir_size=4096"):
        KvDiskStore(str(tmp_path / "kv"), 4096, ROOT, min_file_bytes=8192)


def test_scan_counts_files_per_model(tmp_path):
    directory = str(tmp_path / "kv")
    assert scan_kv_dir(directory) == {"path": directory, "entries": 0, "bytes": 0, "models": {}}
    sizes = {}
    for root, count in ((ROOT, 3), (OTHER_ROOT, 2)):
        s = KvDiskStore(directory, 1 << 30, root)
        for i in range(count):
            put(s, i)
        s.close()
        sizes[root[:16]] = sum(os.path.getsize(e.path) for e in os.scandir(kv_files.root_dir(directory, root)))
    report = scan_kv_dir(directory)
    assert report["entries"] == 5 and report["bytes"] == sum(sizes.values())
    assert report["models"] == {
        ROOT[:16]: {"entries": 3, "bytes": sizes[ROOT[:16]]},
        OTHER_ROOT[:16]: {"entries": 2, "bytes": sizes[OTHER_ROOT[:16]]},
    }


def test_save_after_close_raises_and_close_is_idempotent(store):
    put(store, 1)
    store.close()
    store.close()
    assert store.files_written == 1
    with pytest.raises(RuntimeError, match="closed"):
        put(store, 2)
