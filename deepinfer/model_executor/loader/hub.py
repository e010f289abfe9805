"""Models named by their Hugging Face Hub id, resolved to local files through `huggingface_hub`.

Two forms of name (only when no local path of that name exists, so a directory always wins):

    org/name                  an HF checkpoint: config, tokenizer, *.safetensors, generation_config
    org/name/file.gguf        one GGUF file of a repository (GGUF repositories hold many quants;
                              the name says which one). A file in a folder: org/name/dir/file.gguf
    org/name:Q4_K_M           a GGUF repository's file (or split set) by its quant tag
                              (`gguf_tags.py`); a GGUF repository named alone: its Q4_K_M, else
                              its only model

Files come from the Hub cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else
~/.cache/huggingface/hub), laid out as huggingface_hub lays it out:

    models--org--name/refs/main                      the commit a branch or tag points to
    models--org--name/snapshots/<commit>/config.json symlinks into blobs/
    models--org--name/blobs/<sha>

`revision` pins a branch, tag or commit hash (default "main"). With `HF_HUB_OFFLINE=1` (or
`TRANSFORMERS_OFFLINE=1`) nothing is fetched: a cached model is used as it is, a missing one is
one clear error. Online, only the files named above are downloaded; when the Hub cannot be
reached, a cached copy is used.

The environment is read at each call (huggingface_hub reads it once, at import).
"""

from __future__ import annotations

import contextlib
import os
import re

from deepinfer.model_executor.loader.gguf_tags import pick_gguf, split_tag

HF_CHECKPOINT_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
    "chat_template.*",
]
DEFAULT_REVISION = "main"
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_NAME = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:/(?P<file>(?:{_PART}/)*{_PART}\.gguf))?")
_TRUE = {"1", "ON", "YES", "TRUE"}


def parse_hub_name(model: str) -> tuple[str, str | None] | None:
    """`(repo_id, gguf filename or None)` for a name of any form (a quant tag is dropped), None for
    anything else.

    `org/file.gguf` is not a repository id: it reads as a local path (a missing one).
    """
    base, tag = split_tag(model)
    if tag is not None:
        parsed = parse_hub_name(base)
        return parsed if parsed is not None and parsed[1] is None else None
    match = _HUB_NAME.fullmatch(model)
    if match is None or (match["file"] is None and model.endswith(".gguf")) or ".." in model:
        return None
    return match["repo"], match["file"]


def hub_cache_dir() -> str:
    """The Hub cache directory the environment names now (huggingface_hub's own precedence)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        cache = os.path.join(os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface"), "hub")
    return os.path.abspath(os.path.expanduser(os.path.expandvars(cache)))


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set to a true value."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def resolve_hub_model(model: str, revision: str | None = None) -> str:
    """The local path of hub name `model`: a snapshot directory, or a .gguf file.

    Raises FileNotFoundError (one line, naming the cache and the download command) when the model
    is not cached and cannot be fetched, ValueError for a GGUF repository named without a file.
    """
    parsed = parse_hub_name(model)
    if parsed is None:
        raise ValueError(f"model {model!r} is not a Hugging Face name (org/name, org/name/file.gguf or org/name:TAG)")
    repo_id, filename = parsed
    tag = split_tag(model)[1]
    revision = revision or DEFAULT_REVISION
    try:
        if filename is not None:
            return _download_file(repo_id, filename, revision)
        if tag is not None:
            return _download_tagged(repo_id, revision, tag, None)
        return _check_checkpoint(repo_id, revision, _download_snapshot(repo_id, revision))
    except ValueError:  # ours (a GGUF repository named without a file) or a malformed name
        raise
    except Exception as exc:  # huggingface_hub's errors, turned into one line that names the fix
        raise _explain(exc, model, repo_id, filename, revision) from exc


def _download_snapshot(repo_id: str, revision: str) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(), local_files_only=hub_offline(),
                             allow_patterns=HF_CHECKPOINT_PATTERNS)


def _download_file(repo_id: str, filename: str, revision: str) -> str:
    from huggingface_hub import hf_hub_download

    return hf_hub_download(repo_id, filename, revision=revision, cache_dir=hub_cache_dir(),
                           local_files_only=hub_offline())


def _check_checkpoint(repo_id: str, revision: str, folder: str) -> str:
    """`folder` when it holds an HF checkpoint; for a GGUF repository, its default model's file
    (Q4_K_M, else its only one: `gguf_tags.pick_gguf`)."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    if not _gguf_files(repo_id, revision, folder):
        raise ValueError(f"model {repo_id!r} (revision {revision!r}) has no config.json: it is not an HF checkpoint")
    return _download_tagged(repo_id, revision, None, folder)


def _download_tagged(repo_id: str, revision: str, tag: str | None, folder: str | None) -> str:
    """The first file of the model `tag` picks (every part of a split set is fetched beside it)."""
    folder = folder or _cached_snapshot(repo_id, revision)  # what is cached, if the Hub cannot list it
    parts = pick_gguf(repo_id, _gguf_files(repo_id, revision, folder), tag)
    return [_download_file(repo_id, part, revision) for part in parts][0]


def _cached_snapshot(repo_id: str, revision: str) -> str | None:
    """The cache's snapshot folder of `revision` (a branch or tag through refs/, or a commit)."""
    root = os.path.join(hub_cache_dir(), "models--" + repo_id.replace("/", "--"))
    commit = revision
    with contextlib.suppress(OSError):
        with open(os.path.join(root, "refs", revision)) as f:
            commit = f.read().strip()
    folder = os.path.join(root, "snapshots", commit)
    return folder if re.fullmatch(r"[0-9a-f]{40}", commit) and os.path.isdir(folder) else None


def _gguf_files(repo_id: str, revision: str, folder: str | None) -> list[str]:
    """The repository's .gguf files: listed by the Hub when online, else those already cached."""
    if not hub_offline():
        try:
            from huggingface_hub import HfApi

            endpoint = (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None  # as it is now, not at import
            info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision)
            return sorted(s.rfilename for s in info.siblings or () if s.rfilename.endswith(".gguf"))
        except Exception:  # no network: fall back to what the cache holds
            pass
    cached = []
    for root, _, names in os.walk(folder or os.devnull):
        cached += [os.path.relpath(os.path.join(root, n), folder) for n in names if n.endswith(".gguf")]
    return sorted(cached)


def _explain(exc: Exception, model: str, repo_id: str, filename: str | None, revision: str) -> Exception:
    """One line for a failed resolution: what is missing, where we looked, and the command that fixes it."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:  # newer releases (huggingface_hub >= 1.x) tell a partial snapshot apart
        from huggingface_hub.errors import IncompleteSnapshotError as incomplete
    except ImportError:
        incomplete = ()
    pinned = "" if revision == DEFAULT_REVISION else f" --revision {revision}"
    command = f"`hf download {repo_id}{' ' + filename if filename else ''}{pinned}`"
    what = f"model {model!r}" + ("" if revision == DEFAULT_REVISION else f" (revision {revision!r})")
    if isinstance(exc, GatedRepoError):
        return FileNotFoundError(f"{what} is gated on the Hugging Face Hub: accept its terms on the Hub, "
                                 f"log in with `hf auth login`, or pass a local directory")
    if isinstance(exc, RevisionNotFoundError):
        return FileNotFoundError(f"{what}: revision {revision!r} does not exist on the Hugging Face Hub")
    if isinstance(exc, RepositoryNotFoundError):
        return FileNotFoundError(f"{what} is not a local path nor a Hugging Face Hub repository "
                                 f"(private ones need `hf auth login`)")
    fix = f"download it with {command} on a machine with network, or pass a local directory"
    if not isinstance(exc, LocalEntryNotFoundError):  # the Hub answered with an error of its own
        return FileNotFoundError(f"{what} could not be fetched from the Hugging Face Hub "
                                 f"({type(exc).__name__}: {_first_line(exc)}): {fix}")
    cached = "is only partly" if isinstance(exc, incomplete) else "is not"
    reason = "HF_HUB_OFFLINE is set" if hub_offline() else "the Hub could not be reached"
    return FileNotFoundError(f"{what} {cached} in the Hugging Face cache ({hub_cache_dir()}) and {reason}: {fix}")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
