"""`deepinfer list` and `deepinfer rm`: the models available offline, from three places.

    pip          models shipped as pip packages (`loader/default_model.py`), by short name
    hf-cache     the Hugging Face cache (`HF_HUB_CACHE`), read with `scan_cache_dir`: a checkpoint
                 as org/name, a GGUF repository's cached files as org/name/file.gguf
    models-dir   *.gguf files under the models directory (`--models-dir`, else
                 `$DEEPINFER_MODELS_DIR`, else `models` in DeepInfer's cache directory), by path

Each row's name is what `--model` / `deepinfer serve` accepts.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import pathlib
import re

from deepinfer.entrypoints.models_cmd.cache_scan import Skipped, printable, scan_hub_cache, scan_models_dir
from deepinfer.entrypoints.models_cmd.safe_names import inside

SOURCE_PIP, SOURCE_HUB, SOURCE_DIR = "pip", "hf-cache", "models-dir"


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model available offline. `size` in bytes, `modified` a POSIX timestamp."""

    name: str
    source: str
    size: int
    modified: float
    path: str


def default_models_dir() -> str:
    """`$DEEPINFER_MODELS_DIR`, else `models` in DeepInfer's cache directory (`$DEEPINFER_CACHE_DIR`,
    else ~/.cache/deepinfer). Empty variables count as unset."""
    from deepinfer.model_executor.loader.fingerprint import default_cache_dir

    explicit = os.environ.get("DEEPINFER_MODELS_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    return os.path.join(default_cache_dir() or os.path.abspath(".deepinfer"), "models")


@dataclasses.dataclass(frozen=True)
class Inventory:
    """What `list` found: the models, and the entries it could not read (see `cache_scan`)."""

    entries: list[ModelEntry]
    skipped: list[Skipped]


def list_models(models_dir: str | None = None) -> Inventory:
    """Every model available offline: pip-shipped first, then the Hub cache, then the models dir;
    an entry that cannot be read is skipped and reported, never fatal."""
    hub, hub_skipped = hub_entries()
    local, dir_skipped = dir_entries(models_dir or default_models_dir())
    entries = pip_entries() + sorted(hub, key=lambda e: e.name.lower()) + sorted(local, key=lambda e: e.name)
    return Inventory(entries, hub_skipped + dir_skipped)


def pip_entries() -> list[ModelEntry]:
    """The pip-shipped models that are installed (their files measured, nothing assembled)."""
    from deepinfer.model_executor.loader.default_model import PACKAGED_MODELS

    entries = []
    for name in PACKAGED_MODELS:
        files, path = _pip_model_files(name)
        if files:
            stats = [os.stat(f) for f in files]
            entries.append(ModelEntry(name, SOURCE_PIP, sum(s.st_size for s in stats),
                                      max(s.st_mtime for s in stats), path))
    return entries


def _pip_model_files(name: str) -> tuple[list[str], str]:
    """`(files, path)` of pip model `name`: the files holding it (one GGUF, or the chunks a split
    model is assembled from on first use) and the path to show; `([], "")` when not installed."""
    from deepinfer.model_executor.loader import default_model

    try:
        if name == default_model.DEFAULT_MODEL_NAME:
            path = default_model.default_model_path()
            return [path], path
        package = importlib.import_module(default_model.GEMMA3_PACKAGE)
        return [str(p) for p in package.chunk_paths() if p.is_file()], os.path.dirname(package.__file__)
    except (FileNotFoundError, ImportError):
        return [], ""


def pip_uninstall_command(name: str) -> str | None:
    """`pip uninstall ...` for pip model `name` (with the chunk packages a split model needs);
    None when `name` is not one."""
    from deepinfer.model_executor.loader import default_model as dm

    dist = {dm.DEFAULT_MODEL_NAME: dm.DEFAULT_MODEL_DISTRIBUTION, dm.GEMMA3_MODEL_NAME: dm.GEMMA3_DISTRIBUTION}
    if name.lower() not in dist:
        return None
    main = dist[name.lower()]
    try:
        requires = importlib.metadata.requires(main) or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    parts = [r.split("=")[0].strip() for r in requires if r.startswith(f"{main}-part")]
    return f"pip uninstall {' '.join([main, *parts])}"


def hf_cache_info():
    """huggingface_hub's scan of the Hub cache (what `rm` deletes through); None when the cache
    directory does not exist. ValueError when it cannot be read."""
    from huggingface_hub import scan_cache_dir

    from deepinfer.model_executor.loader.hub import hub_cache_dir

    cache = hub_cache_dir()
    try:
        return scan_cache_dir(cache) if os.path.isdir(cache) else None
    except OSError as exc:
        raise ValueError(f"cannot read the Hugging Face cache ({cache}): {exc}") from None


def hub_entries() -> tuple[list[ModelEntry], list[Skipped]]:
    """A checkpoint repository as one row (org/name); a GGUF repository as one row per cached file;
    and what could not be read."""
    from deepinfer.model_executor.loader.hub import hub_cache_dir

    repos, skipped = scan_hub_cache(hub_cache_dir())
    entries = []
    for repo in repos:
        gguf = {path: f for path, f in repo.files.items() if path.endswith(".gguf")}
        if "config.json" in repo.files or not gguf:
            size = sum({f.target: f.size for f in repo.files.values()}.values())  # a blob counts once
            entries.append(ModelEntry(repo.repo_id, SOURCE_HUB, size, repo.modified, repo.path))
            continue
        entries += [ModelEntry(f"{repo.repo_id}/{path}", SOURCE_HUB, f.size, f.modified, f.path)
                    for path, f in gguf.items()]
    return entries, skipped


def _relative(file, revision) -> str:
    return pathlib.PurePath(file.file_path).relative_to(revision.snapshot_path).as_posix()


def dir_entries(models_dir: str) -> tuple[list[ModelEntry], list[Skipped]]:
    """The *.gguf files under `models_dir` (searched recursively), each named by its absolute path;
    and what could not be read."""
    found, skipped = scan_models_dir(models_dir)
    return [ModelEntry(f.path, SOURCE_DIR, f.size, f.modified, f.path) for f in found], skipped


def remove_model(name: str, models_dir: str | None = None) -> ModelEntry:
    """Delete `name` (a Hub-cache checkpoint or GGUF file, or a GGUF in the models dir) and return
    what was deleted.

    Raises ValueError for a pip-shipped model (naming the `pip uninstall` command) and
    FileNotFoundError for a name found in neither place (naming both).
    """
    command = pip_uninstall_command(name)
    if command is not None:
        raise ValueError(f"model {name!r} is shipped as a pip package; remove it with: {command}")
    models_dir = models_dir or default_models_dir()
    removed = _remove_from_hub(name) or _remove_from_dir(name, models_dir)
    if removed is None:
        from deepinfer.model_executor.loader.hub import hub_cache_dir

        raise FileNotFoundError(f"model {name!r} is neither in the Hugging Face cache ({hub_cache_dir()}) nor "
                                f"in the models directory ({models_dir}); `deepinfer list` shows what is there")
    return removed


def _remove_from_hub(name: str) -> ModelEntry | None:
    """Delete a cached repository (every revision) or one cached file of it; None when not cached.
    ValueError when a path it would delete resolves outside the cache, or the repository's folder
    is damaged (huggingface_hub's scan could not read it)."""
    from deepinfer.model_executor.loader.hub import parse_hub_name

    parsed = parse_hub_name(name.replace(":", "/", 1))
    info = hf_cache_info() if parsed is not None else None
    repo = next((r for r in info.repos if r.repo_type == "model" and r.repo_id == parsed[0]), None) if info else None
    if repo is None:
        _refuse_damaged(info, parsed)
        return None
    filename = parsed[1]
    all_files = [f for r in repo.revisions for f in r.files]
    chosen = all_files if filename is None else [f for r in repo.revisions for f in r.files
                                                 if _relative(f, r) == filename]
    if not chosen:
        return None
    if len(chosen) == len(all_files):  # nothing else cached: the whole repository goes
        strategy = info.delete_revisions(*(r.commit_hash for r in repo.revisions))
        _check_inside_cache([p for paths in vars(strategy).values() if isinstance(paths, frozenset) for p in paths])
        strategy.execute()
        freed = strategy.expected_freed_size
    else:
        freed = _delete_files(info, repo, chosen)
    label = repo.repo_id if filename is None else f"{repo.repo_id}/{filename}"
    return ModelEntry(label, SOURCE_HUB, freed, repo.last_modified, str(repo.repo_path))


def _refuse_damaged(info, parsed) -> None:
    """ValueError naming the problem when the repository's folder exists but the scan skipped it."""
    from huggingface_hub.file_download import repo_folder_name

    from deepinfer.model_executor.loader.hub import hub_cache_dir

    if info is None:  # no cache, or not a Hub name
        return
    folder = repo_folder_name(repo_id=parsed[0], repo_type="model")
    path = os.path.join(hub_cache_dir(), folder)
    if not os.path.lexists(path):
        return
    mention = re.compile(re.escape(folder) + r"(?![A-Za-z0-9._-])")
    detail = next((str(w) for w in info.warnings if mention.search(str(w))), "huggingface_hub could not scan it")
    raise ValueError(f"model {parsed[0]!r} is in the Hugging Face cache but its folder is damaged "
                     f"({printable(detail)}); delete {path} yourself")


def _check_inside_cache(paths) -> None:
    """ValueError unless every path `rm` would delete resolves (through any symlink) inside the cache."""
    from deepinfer.model_executor.loader.hub import hub_cache_dir

    cache = hub_cache_dir()
    for path in paths:
        if not inside(cache, str(path)):
            raise ValueError(f"{printable(str(path))} resolves outside the Hugging Face cache ({cache}), to "
                             f"{printable(os.path.realpath(path))}: `deepinfer rm` deletes only inside it")


def _delete_files(info, repo, chosen) -> int:
    """Delete cached files `chosen` of `repo` (their snapshot entries, and each blob no other entry
    uses); the bytes freed. huggingface_hub's own strategy where the release has one."""
    _check_inside_cache([p for f in chosen for p in (f.file_path, f.blob_path)])
    if hasattr(info, "delete_files"):  # huggingface_hub >= 2
        strategy = info.delete_files(*chosen)
        strategy.execute()
        return strategy.expected_freed_size
    kept = {f.blob_path for r in repo.revisions for f in r.files if f not in chosen}
    freed = 0
    for f in chosen:
        os.remove(f.file_path)
        if f.blob_path not in kept and os.path.exists(f.blob_path):
            freed += f.size_on_disk
            os.remove(f.blob_path)
    return freed


def _remove_from_dir(name: str, models_dir: str) -> ModelEntry | None:
    """Delete a GGUF named by its path, or by its path relative to `models_dir`; None when absent.

    The entry itself goes: a symlink is removed, never the file it points to. ValueError when the
    entry (its folder resolved) is not inside `models_dir`."""
    root = os.path.realpath(models_dir)
    for candidate in (os.path.expanduser(name), os.path.join(models_dir, name)):
        path = os.path.abspath(candidate)
        if not path.endswith(".gguf") or not os.path.lexists(path) or os.path.isdir(path):
            continue
        entry = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        if os.path.commonpath([root, entry]) != root:
            raise ValueError(f"model {name!r} ({entry}) is not in the models directory ({models_dir}): "
                             f"`deepinfer rm` deletes only models it manages")
        stat = os.lstat(entry) if os.path.islink(entry) else os.stat(entry)
        os.remove(entry)
        return ModelEntry(path, SOURCE_DIR, stat.st_size, stat.st_mtime, path)
    return None
