"""`deepinfer pull`: fetch a Hub model into the Hugging Face cache (or one GGUF into a directory).

Two forms of name, as `deepinfer serve` reads them (`model_executor/loader/hub.py`):

    org/name                  an HF checkpoint: only the files the engine loads (the loader's
                              patterns: config, tokenizer, *.safetensors, ...), never *.bin, *.pth,
                              *.onnx, *.h5 or *.msgpack
    org/name/file.gguf        one GGUF file (also written org/name:file.gguf)
    org/name:Q4_K_M           a GGUF repository's file by its quant tag, or every part of a split
                              set (`loader/gguf_tags.py`); a GGUF repository named alone: its
                              Q4_K_M, else its only model

Files land where huggingface_hub puts them, so `deepinfer serve org/name` finds them offline:

    models--org--name/blobs/<etag>                   the bytes (etag: sha256 for LFS files)
    models--org--name/blobs/<etag>.incomplete        a partial download, kept until it completes
    models--org--name/snapshots/<commit>/<path>      a relative symlink to the blob
    models--org--name/refs/<revision>                the commit a branch or tag pointed to

A download resumes where an interrupted one stopped (an HTTP Range request from the size of the
`.incomplete` file, which grows in huggingface_hub's download chunks of 10 MB; a connection that
drops mid-file is also retried within the same run). Every finished file is checked before it
is moved into place: LFS files against the sha256 the Hub lists for them, small files against
their git blob id; a mismatch deletes the bad bytes and raises `ChecksumError` naming the file
and both hashes. Snapshot links and `refs/<revision>` are written under a temporary name and
renamed into place too.

The endpoint is not trusted (`HF_ENDPOINT` may name a mirror or a spoofed host): every commit,
ETag, file name, hash and size it sends is checked (`safe_names`) and every path built from them
must resolve inside the cache (or the models dir), before anything is written; a failed check
raises `UnsafeNameError`. The ETag must be one of the hashes the Hub lists for the file, so a
blob's name is the hash its bytes were checked against. The token goes only to the endpoint's
own origin, never to a host a redirect names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
from collections.abc import Callable

import deepinfer.entrypoints.models_cmd.safe_names as safe_names

_DEFAULT_ENDPOINT = "https://huggingface.co"
_CHUNK_BYTES = 8 * 1024 * 1024
_NOFOLLOW = os.O_NOFOLLOW if os.name == "posix" else 0  # the partial file is opened, never a link


class ChecksumError(OSError):
    """A downloaded file's hash differs from the one the Hub lists (the file has been deleted)."""


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """One file of a repository at a commit, as the Hub lists it."""

    path: str  # inside the repository
    size: int | None
    sha256: str | None  # LFS files
    blob_id: str | None  # the git blob id (what the Hub checks small files by)


@dataclasses.dataclass(frozen=True)
class PulledFile:
    """What `pull` did for one file: `status` is "downloaded" or "cached"."""

    path: str  # inside the repository
    local_path: str
    size: int
    status: str


def download_errors() -> tuple[type[Exception], ...]:
    """What a failed download raises: the Hub's HTTP errors, transport errors of huggingface_hub's
    HTTP client (no network, timeouts, a cut connection), OSError (ChecksumError, disk, a file
    the Hub does not have) and UnsafeNameError (an answer that fails its check)."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        import httpx2 as client  # huggingface_hub >= 2
    except ImportError:
        import httpx as client
    return HfHubHTTPError, client.HTTPError, OSError, safe_names.UnsafeNameError


def hub_endpoint() -> str:
    """`HF_ENDPOINT` as it is now (huggingface_hub reads it once, at import)."""
    return (os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")


def parse_pull_name(name: str) -> tuple[str, str | None]:
    """`(repo_id, gguf filename or None)` for `org/name`, `org/name/file.gguf`, `org/name:file.gguf`
    or `org/name:TAG` (the tag: `gguf_tags.split_tag`)."""
    from deepinfer.model_executor.loader.gguf_tags import split_tag
    from deepinfer.model_executor.loader.hub import parse_hub_name

    base, tag = split_tag(name)
    text = base if tag is not None else name.replace(":", "/", 1) if ":" in name else name
    parsed = parse_hub_name(text)
    if parsed is None:
        raise ValueError(f"model name {name!r}: expected org/name, org/name/file.gguf or org/name:file.gguf")
    return parsed


def select_checkpoint_files(repo_id: str, files: list[RemoteFile], tag: str | None = None) -> list[RemoteFile]:
    """The files of a whole-repository pull: those the engine's HF loader reads; for a GGUF repository
    (or a quant `tag`), the file or split set the tag picks (`gguf_tags.pick_gguf`: no tag, Q4_K_M or
    the only model).

    Raises ValueError for a tag that picks nothing or several, and for a repository without
    safetensors weights or GGUF files.
    """
    from huggingface_hub.utils import filter_repo_objects

    from deepinfer.model_executor.loader.gguf_tags import pick_gguf
    from deepinfer.model_executor.loader.hub import HF_CHECKPOINT_PATTERNS

    chosen = list(filter_repo_objects(files, allow_patterns=HF_CHECKPOINT_PATTERNS, key=lambda f: f.path))
    if tag is None and any(f.path.endswith(".safetensors") for f in chosen):
        return chosen
    if tag is not None or any(f.path.endswith(".gguf") for f in files):
        by_path = {f.path: f for f in files}
        return [by_path[p] for p in pick_gguf(repo_id, by_path, tag)]
    raise ValueError(f"model {repo_id!r} has no *.safetensors weights (the engine does not load "
                     f"*.bin/*.pth/*.onnx/*.h5/*.msgpack checkpoints)")


def list_repo_files(repo_id: str, revision: str) -> tuple[str, list[RemoteFile]]:
    """`(commit, files)` of the repository at `revision`, with sizes and hashes (one Hub call); every
    name, size and hash checked (`safe_names`)."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=hub_endpoint()).model_info(repo_id, revision=revision, files_metadata=True)
    commit = safe_names.check_commit(info.sha, "the Hub's model info 'sha'")
    files = [remote_file(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None, s.blob_id, "repository listing")
             for s in info.siblings or ()]
    return commit, files


def remote_file(path, size, sha256, blob_id, source: str) -> RemoteFile:
    """A `RemoteFile` from what the Hub's `source` answer says, each field checked."""
    path = safe_names.check_repo_path(path, f"the Hub's file name in the {source}")
    where = f"of {safe_names.show(path)} in the Hub's {source}"
    return RemoteFile(path, safe_names.check_size(size, f"size {where}"),
                      safe_names.check_hash(sha256, "sha256", f"sha256 {where}"),
                      safe_names.check_hash(blob_id, "git blob id", f"blob id {where}"))


def describe_file(repo_id: str, commit: str, filename: str) -> RemoteFile:
    """One file's size and hashes at `commit` (the Hub's paths-info)."""
    from huggingface_hub import HfApi, RepoFile

    entries = HfApi(endpoint=hub_endpoint()).get_paths_info(repo_id, [filename], revision=commit)
    for entry in entries:
        safe_names.check_repo_path(entry.path, "the Hub's file name in the paths-info answer")
        if entry.path == filename and isinstance(entry, RepoFile):
            return remote_file(entry.path, entry.size, entry.lfs.sha256 if entry.lfs else None, entry.blob_id,
                               "paths-info answer")
    raise FileNotFoundError(f"model {repo_id!r} has no file {filename!r} at commit {commit}")


@dataclasses.dataclass(frozen=True)
class FileHead:
    """The Hub's answer to a HEAD of one file, checked: the commit, the ETag the blob is named by,
    the size (None when not sent) and where the bytes come from."""

    commit: str
    etag: str
    size: int | None
    location: str


def head_file(repo_id: str, filename: str, revision: str) -> FileHead:
    """huggingface_hub's HEAD of the file, every header checked (`safe_names`)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    endpoint = hub_endpoint()
    meta = get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint),
                                endpoint=endpoint)
    return FileHead(safe_names.check_commit(meta.commit_hash, "the Hub's X-Repo-Commit header"),
                    safe_names.check_etag(meta.etag, "the Hub's ETag header"),
                    safe_names.check_size(meta.size, "the Hub's X-Linked-Size / Content-Length header"),
                    safe_names.check_location(meta.location, "the Hub's download location (Location header)"))


def with_etag(remote: RemoteFile, etag: str) -> RemoteFile:
    """`remote` with a hash to check the bytes against: the listed ones, which the ETag must be one of;
    the ETag itself (sha256 or git blob id by its length) when the listing has none."""
    listed = [h for h in (remote.sha256, remote.blob_id) if h]
    if listed and etag not in listed:
        raise safe_names.UnsafeNameError("the Hub's ETag header", etag, f"a hash the Hub lists for {remote.path} "
                                         f"({' or '.join(listed)})")
    if listed:
        return remote
    return dataclasses.replace(remote, sha256=etag) if len(etag) == 64 else dataclasses.replace(remote, blob_id=etag)


def download_headers(url: str) -> dict[str, str]:
    """huggingface_hub's headers for a GET of `url`; the token only when `url` is on the Hub's origin
    (a redirect to another host, such as a CDN, gets none)."""
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers()
    if safe_names.same_origin(url, hub_endpoint()):
        return headers
    return {key: value for key, value in headers.items() if key.lower() != "authorization"}


def download(url: str, dest: str, remote: RemoteFile, expected_size: int | None) -> None:
    """Fetch `url` into `dest` through `dest.incomplete` (beside it, never through a symlink),
    resuming a partial file; checks the hash, then renames (os.replace). A progress bar shows on
    stderr (HF_HUB_DISABLE_PROGRESS_BARS=1 hides it)."""
    from huggingface_hub.file_download import http_get

    partial = dest + ".incomplete"
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o644)
    with os.fdopen(fd, "ab") as out:
        done = os.fstat(fd).st_size
        if expected_size is not None and done > expected_size:  # not a prefix of this file
            out.truncate(0)
            done = 0
        http_get(url, out, resume_size=done, headers=download_headers(url), expected_size=expected_size,
                 displayed_filename=os.path.basename(remote.path))
    check_hash(partial, remote)
    os.replace(partial, dest)


def check_hash(path: str, remote: RemoteFile) -> None:
    """Compare `path` with the Hub's sha256 (LFS) or git blob id; on a mismatch delete it and raise."""
    if remote.sha256:
        kind, expected, actual = "sha256", remote.sha256, file_hash(path, hashlib.sha256())
    elif remote.blob_id:
        header = f"blob {os.path.getsize(path)}\0".encode()
        kind, expected, actual = "git blob id", remote.blob_id, file_hash(path, hashlib.sha1(header))
    else:
        return
    if actual != expected.lower():
        os.remove(path)
        raise ChecksumError(f"{remote.path}: {kind} {actual} does not match the Hub's {expected}; "
                            f"the downloaded file was deleted")


def file_hash(path: str, digest) -> str:
    """Hex digest of the file's bytes fed into `digest` (which may already hold a prefix)."""
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class _CachePlan:
    """One file of a cache pull, every path checked before anything is written: `head` None when
    the snapshot already has the file."""

    remote: RemoteFile
    pointer: str  # snapshots/<commit>/<path>
    blob: str | None  # blobs/<etag>
    head: FileHead | None


def pull_to_cache(repo_id: str, files: list[RemoteFile], commit: str, revision: str) -> list[PulledFile]:
    """Download `files` of `repo_id` at `commit` into the Hub cache; `refs/<revision>` last. Every
    file's HEAD is fetched and checked, and every path checked to stay in the cache, before the
    first byte is written."""
    from huggingface_hub.file_download import repo_folder_name

    from deepinfer.model_executor.loader.hub import hub_cache_dir

    cache, folder = hub_cache_dir(), repo_folder_name(repo_id=repo_id, repo_type="model")
    plans = [_plan_one(repo_id, remote, commit, cache, folder) for remote in files]
    ref = safe_names.path_inside(cache, folder, "refs", *revision.split("/")) if revision != commit else None
    pulled = [_pull_one(plan) for plan in plans]
    if ref is not None:
        _replace_with(ref, lambda temp: _write_text(temp, commit))
    return pulled


def _plan_one(repo_id: str, remote: RemoteFile, commit: str, cache: str, folder: str) -> _CachePlan:
    pointer = safe_names.path_inside(cache, folder, "snapshots", commit, *remote.path.split("/"))
    if os.path.exists(pointer):
        if remote.size is None or os.path.getsize(pointer) == remote.size:
            return _CachePlan(remote, pointer, None, None)
        _drop_cut_file(cache, pointer)  # not the size the Hub lists (a cut or damaged copy): fetched again
    head = head_file(repo_id, remote.path, commit)
    blob = safe_names.path_inside(cache, folder, "blobs", head.etag)
    safe_names.path_inside(cache, folder, "blobs", head.etag + ".incomplete")
    return _CachePlan(with_etag(remote, head.etag), pointer, blob, head)


def _drop_cut_file(cache: str, pointer: str) -> None:
    """Remove a cached file and its blob (both inside the cache) so that the pull downloads it again."""
    blob = os.path.realpath(pointer)
    if not safe_names.inside(cache, blob):
        raise safe_names.UnsafeNameError(f"{pointer} points outside the cache ({blob}); not removing it")
    os.remove(blob)
    os.remove(pointer)


def _pull_one(plan: _CachePlan) -> PulledFile:
    if plan.head is None:
        return PulledFile(plan.remote.path, plan.pointer, os.path.getsize(plan.pointer), "cached")
    status = "cached" if os.path.isfile(plan.blob) else "downloaded"
    if status == "downloaded":
        download(plan.head.location, plan.blob, plan.remote, plan.head.size)
    _replace_with(plan.pointer, lambda temp: _link(plan.blob, temp))
    return PulledFile(plan.remote.path, plan.pointer, os.path.getsize(plan.blob), status)


def _replace_with(path: str, make: Callable[[str], None]) -> None:
    """Create `path` atomically: `make` writes a temporary name beside it, os.replace moves it in
    (an existing entry, a symlink included, is replaced, never followed)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.remove(temp)  # a leftover of a killed run (a link is removed, not followed)
    make(temp)
    os.replace(temp, path)


def _link(blob: str, pointer: str) -> None:
    """A relative symlink pointer -> blob, as huggingface_hub makes it (a copy where links fail)."""
    try:
        os.symlink(os.path.relpath(blob, os.path.dirname(pointer)), pointer)
    except OSError:
        shutil.copyfile(blob, pointer)


def _write_text(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def pull_to_dir(repo_id: str, filename: str, revision: str, models_dir: str) -> list[PulledFile]:
    """Download one GGUF file of `repo_id` into `models_dir` (as its base name)."""
    head = head_file(repo_id, filename, revision)
    remote = with_etag(describe_file(repo_id, head.commit, filename), head.etag)
    root = os.path.abspath(os.path.expanduser(models_dir))
    dest = safe_names.path_inside(root, os.path.basename(filename))
    safe_names.path_inside(root, os.path.basename(filename) + ".incomplete")
    if os.path.exists(dest):
        actual = file_hash(dest, hashlib.sha256())
        if remote.sha256 and actual != remote.sha256:
            raise FileExistsError(f"{dest} exists with other contents (sha256 {actual}, the Hub's "
                                  f"{remote.sha256}): remove it first with `deepinfer rm {dest}`")
        return [PulledFile(filename, dest, os.path.getsize(dest), "cached")]
    download(head.location, dest, remote, head.size)
    return [PulledFile(filename, dest, os.path.getsize(dest), "downloaded")]


def pull(name: str, revision: str | None = None, models_dir: str | None = None) -> tuple[str, list[PulledFile]]:
    """Fetch what `name` names (see the module docstring); `(commit or revision, files)`.

    Raises ValueError for a malformed name or revision, a GGUF repository named whole, or
    `models_dir` with a whole repository; huggingface_hub's errors, OSError (ChecksumError
    included) and UnsafeNameError (an answer that fails its check) for a failed download.
    """
    from deepinfer.model_executor.loader.gguf_tags import split_tag
    from deepinfer.model_executor.loader.hub import DEFAULT_REVISION, hub_offline

    repo_id, filename = parse_pull_name(name)
    tag = split_tag(name)[1]
    revision = safe_names.check_revision(revision or DEFAULT_REVISION)
    if hub_offline():
        raise ValueError(f"cannot pull {name!r}: HF_HUB_OFFLINE is set")
    if models_dir is not None:
        if filename is None and tag is None:
            raise ValueError(f"--models-dir {models_dir!r} takes one GGUF model (org/name/file.gguf or "
                             f"org/name:TAG), not the repository {name!r} (a repository goes into the Hugging "
                             f"Face cache)")
        listing = [] if filename else list_repo_files(repo_id, revision)[1]
        parts = [filename] if filename else [f.path for f in select_checkpoint_files(repo_id, listing, tag)]
        return revision, [got for part in parts for got in pull_to_dir(repo_id, part, revision, models_dir)]
    if filename is not None:
        commit = head_file(repo_id, filename, revision).commit
        return commit, pull_to_cache(repo_id, [describe_file(repo_id, commit, filename)], commit, revision)
    commit, files = list_repo_files(repo_id, revision)
    return commit, pull_to_cache(repo_id, select_checkpoint_files(repo_id, files, tag), commit, revision)
