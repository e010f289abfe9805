"""`deepinfer pull`: fetch a Hub model into the Hugging Face cache (or one GGUF into a directory).

Two forms of name, as `deepinfer serve` reads them (`model_executor/loader/hub.py`):

    org/name                  an HF checkpoint: only the files the engine loads (the loader's
                              patterns: config, tokenizer, *.safetensors, ...), never *.bin, *.pth,
                              *.onnx, *.h5 or *.msgpack
    org/name/file.gguf        one GGUF file (also written org/name:file.gguf)

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
and both hashes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil

_DEFAULT_ENDPOINT = "https://huggingface.co"
_CHUNK_BYTES = 8 * 1024 * 1024


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
    HTTP client (no network, timeouts, a cut connection) and OSError (ChecksumError, disk, a file
    the Hub does not have)."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        import httpx2 as client  # huggingface_hub >= 2
    except ImportError:
        import httpx as client
    return HfHubHTTPError, client.HTTPError, OSError


def hub_endpoint() -> str:
    """`HF_ENDPOINT` as it is now (huggingface_hub reads it once, at import)."""
    return (os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")


def parse_pull_name(name: str) -> tuple[str, str | None]:
    """`(repo_id, gguf filename or None)` for `org/name`, `org/name/file.gguf` or `org/name:file.gguf`."""
    from deepinfer.model_executor.loader.hub import parse_hub_name

    text = name.replace(":", "/", 1) if ":" in name else name
    parsed = parse_hub_name(text)
    if parsed is None:
        raise ValueError(f"model name {name!r}: expected org/name, org/name/file.gguf or org/name:file.gguf")
    return parsed


def select_checkpoint_files(repo_id: str, files: list[RemoteFile]) -> list[RemoteFile]:
    """The files of a whole-repository pull: those the engine's HF loader reads.

    Raises ValueError for a GGUF repository (naming its files: pull one of them) and for a
    repository without safetensors weights.
    """
    from huggingface_hub.utils import filter_repo_objects

    from deepinfer.model_executor.loader.hub import HF_CHECKPOINT_PATTERNS

    chosen = list(filter_repo_objects(files, allow_patterns=HF_CHECKPOINT_PATTERNS, key=lambda f: f.path))
    if any(f.path.endswith(".safetensors") for f in chosen):
        return chosen
    gguf = sorted(f.path for f in files if f.path.endswith(".gguf"))
    if gguf:
        raise ValueError(f"model {repo_id!r} is a GGUF repository: pull one file, e.g. {repo_id}/{gguf[0]} "
                         f"(files: {', '.join(gguf[:8])})")
    raise ValueError(f"model {repo_id!r} has no *.safetensors weights (the engine does not load "
                     f"*.bin/*.pth/*.onnx/*.h5/*.msgpack checkpoints)")


def list_repo_files(repo_id: str, revision: str) -> tuple[str, list[RemoteFile]]:
    """`(commit, files)` of the repository at `revision`, with sizes and hashes (one Hub call)."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=hub_endpoint()).model_info(repo_id, revision=revision, files_metadata=True)
    files = [RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None, s.blob_id) for s in info.siblings or ()]
    return info.sha, files


def describe_file(repo_id: str, commit: str, filename: str) -> RemoteFile:
    """One file's size and hashes at `commit` (the Hub's paths-info)."""
    from huggingface_hub import HfApi, RepoFile

    entries = HfApi(endpoint=hub_endpoint()).get_paths_info(repo_id, [filename], revision=commit)
    for entry in entries:
        if entry.path == filename and isinstance(entry, RepoFile):
            return RemoteFile(entry.path, entry.size, entry.lfs.sha256 if entry.lfs else None, entry.blob_id)
    raise FileNotFoundError(f"model {repo_id!r} has no file {filename!r} at commit {commit}")


def file_metadata(repo_id: str, filename: str, revision: str):
    """huggingface_hub's HEAD of the file: commit_hash, etag, size and the download location."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    endpoint = hub_endpoint()
    return get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint),
                                endpoint=endpoint)


def download(url: str, dest: str, remote: RemoteFile, expected_size: int | None) -> None:
    """Fetch `url` into `dest` through `dest.incomplete`, resuming a partial file; checks the hash,
    then renames. A progress bar shows on stderr (HF_HUB_DISABLE_PROGRESS_BARS=1 hides it)."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    partial = dest + ".incomplete"
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    done = os.path.getsize(partial) if os.path.exists(partial) else 0
    if expected_size is not None and done > expected_size:  # not a prefix of this file
        os.remove(partial)
        done = 0
    with open(partial, "ab") as out:
        http_get(url, out, resume_size=done, headers=build_hf_headers(), expected_size=expected_size,
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


def pull_to_cache(repo_id: str, files: list[RemoteFile], commit: str, revision: str) -> list[PulledFile]:
    """Download `files` of `repo_id` at `commit` into the Hub cache; `refs/<revision>` last."""
    from huggingface_hub.file_download import repo_folder_name

    from deepinfer.model_executor.loader.hub import hub_cache_dir

    storage = os.path.join(hub_cache_dir(), repo_folder_name(repo_id=repo_id, repo_type="model"))
    pulled = [_pull_one(repo_id, remote, commit, storage) for remote in files]
    if revision != commit:
        os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
        with open(os.path.join(storage, "refs", revision), "w") as f:
            f.write(commit)
    return pulled


def _pull_one(repo_id: str, remote: RemoteFile, commit: str, storage: str) -> PulledFile:
    pointer = os.path.join(storage, "snapshots", commit, *remote.path.split("/"))
    if os.path.exists(pointer):
        return PulledFile(remote.path, pointer, os.path.getsize(pointer), "cached")
    meta = file_metadata(repo_id, remote.path, commit)
    blob = os.path.join(storage, "blobs", meta.etag or remote.sha256 or remote.blob_id)
    status = "cached" if os.path.exists(blob) else "downloaded"
    if status == "downloaded":
        download(meta.location, blob, remote, meta.size)
    _link(blob, pointer)
    return PulledFile(remote.path, pointer, os.path.getsize(blob), status)


def _link(blob: str, pointer: str) -> None:
    """A relative symlink pointer -> blob, as huggingface_hub makes it (a copy where links fail)."""
    os.makedirs(os.path.dirname(pointer), exist_ok=True)
    try:
        os.symlink(os.path.relpath(blob, os.path.dirname(pointer)), pointer)
    except OSError:
        shutil.copyfile(blob, pointer)


def pull_to_dir(repo_id: str, filename: str, revision: str, models_dir: str) -> list[PulledFile]:
    """Download one GGUF file of `repo_id` into `models_dir` (as its base name)."""
    meta = file_metadata(repo_id, filename, revision)
    remote = describe_file(repo_id, meta.commit_hash or revision, filename)
    dest = os.path.join(os.path.abspath(os.path.expanduser(models_dir)), os.path.basename(filename))
    if os.path.exists(dest):
        actual = file_hash(dest, hashlib.sha256())
        if remote.sha256 and actual != remote.sha256:
            raise FileExistsError(f"{dest} exists with other contents (sha256 {actual}, the Hub's "
                                  f"{remote.sha256}): remove it first with `deepinfer rm {dest}`")
        return [PulledFile(filename, dest, os.path.getsize(dest), "cached")]
    download(meta.location, dest, remote, meta.size)
    return [PulledFile(filename, dest, os.path.getsize(dest), "downloaded")]


def pull(name: str, revision: str | None = None, models_dir: str | None = None) -> tuple[str, list[PulledFile]]:
    """Fetch what `name` names (see the module docstring); `(commit or revision, files)`.

    Raises ValueError for a malformed name, a GGUF repository named whole, or `models_dir` with a
    whole repository; huggingface_hub's errors and OSError (ChecksumError included) for a failed
    download.
    """
    from deepinfer.model_executor.loader.hub import DEFAULT_REVISION, hub_offline

    repo_id, filename = parse_pull_name(name)
    revision = revision or DEFAULT_REVISION
    if hub_offline():
        raise ValueError(f"cannot pull {name!r}: HF_HUB_OFFLINE is set")
    if models_dir is not None:
        if filename is None:
            raise ValueError(f"--models-dir {models_dir!r} takes one GGUF file (org/name/file.gguf), not the "
                             f"repository {name!r} (a repository goes into the Hugging Face cache)")
        return revision, pull_to_dir(repo_id, filename, revision, models_dir)
    if filename is not None:
        meta = file_metadata(repo_id, filename, revision)
        commit = meta.commit_hash or revision
        return commit, pull_to_cache(repo_id, [describe_file(repo_id, commit, filename)], commit, revision)
    commit, files = list_repo_files(repo_id, revision)
    return commit, pull_to_cache(repo_id, select_checkpoint_files(repo_id, files), commit, revision)
