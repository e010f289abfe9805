"""Quant tags: `org/name:Q4_K_M` names the file of a GGUF repository whose name carries that
quantization, or every part of a split set (`*-00001-of-00003.gguf`), as `ollama run
hf.co/org/name:Q4_K_M` and `llama-server -hf org/name:Q4_K_M` read it. A repository named without a
tag or file gets Q4_K_M when it has one (their default too), else its only model file.

A tag matches a file when it appears in the file's path as a whole token, case-insensitively:
between the path's start or one of `-` `.` `/` and its end, `.gguf`, `-` or `.` (so `Q4_K` does not
match `Q4_K_M`, nor `Q4_XS` `IQ4_XS`). Vision projectors (`mmproj*`) are never the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

DEFAULT_TAG = "Q4_K_M"
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# what a file's name says of its quantization, for listing a repository's tags
_KNOWN = re.compile(r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d_(?:K_XL|K_[SML]|K|XXS|XS|NL|[SML0-1])|TQ\d_0|MXFP4(?:_MOE)?"
                    r"|BF16|F16|F32))(?![A-Za-z0-9])", re.IGNORECASE)


def split_tag(name: str) -> tuple[str, str | None]:
    """`org/name:TAG` -> ("org/name", "TAG"); any other name -> (name, None) (`org/name:file.gguf`
    names a file, not a tag)."""
    head, sep, tail = name.rpartition(":")
    if not sep or "/" in tail or tail.lower().endswith(".gguf") or not _TAG.fullmatch(tail):
        return name, None
    return head, tail


def has_tag(path: str, tag: str) -> bool:
    pattern = rf"(?:^|[-./]){re.escape(tag)}(?:\.gguf$|[-./])"
    return re.search(pattern, path, re.IGNORECASE) is not None


def file_tags(paths: Iterable[str]) -> list[str]:
    """The quant tags the model files' names carry, sorted."""
    found = (_KNOWN.findall(path.rsplit("/", 1)[-1]) for path in _model_files(paths))
    return sorted({tags[-1].upper() for tags in found if tags})


def pick_gguf(repo_id: str, paths: Iterable[str], tag: str | None) -> list[str]:
    """The repository file(s) `tag` names: one file, or a split set's parts in order. ValueError (one
    line, listing the tags there are) when none, several or part of a set match."""
    files = _model_files(paths)
    if not files:
        raise ValueError(f"model {repo_id!r} has no GGUF files")
    groups = _models(files)
    if tag is None:
        tag = DEFAULT_TAG if any(has_tag(f, DEFAULT_TAG) for f in files) else None
        if tag is None and len(groups) != 1:
            raise ValueError(f"model {repo_id!r} holds {len(groups)} GGUF models and none is {DEFAULT_TAG}: name one "
                             f"as {repo_id}:TAG ({_tag_list(files)})")
    chosen = groups if tag is None else {k: v for k, v in groups.items() if any(has_tag(p, tag) for p in v)}
    if not chosen:
        raise ValueError(f"model {repo_id!r} has no GGUF file with quant tag {tag!r} ({_tag_list(files)})")
    if len(chosen) > 1:
        raise ValueError(f"model {repo_id!r}: quant tag {tag!r} matches {len(chosen)} files "
                         f"({', '.join(sorted(chosen))}): name one as {repo_id}/FILE.gguf")
    (parts,) = chosen.values()
    return _whole_set(repo_id, parts)


def _model_files(paths: Iterable[str]) -> list[str]:
    return sorted(p for p in paths if p.lower().endswith(".gguf") and "mmproj" not in p.rsplit("/", 1)[-1].lower())


def _models(files: list[str]) -> dict[str, list[str]]:
    """Files grouped by model: a split set's parts under one key (its name without the part number)."""
    groups: dict[str, list[str]] = {}
    for path in files:
        groups.setdefault(_SPLIT.sub(".gguf", path), []).append(path)
    return groups


def _whole_set(repo_id: str, parts: list[str]) -> list[str]:
    numbers = [_SPLIT.search(p) for p in parts]
    if len(parts) == 1 and numbers[0] is None:
        return parts
    if any(m is None for m in numbers):
        raise ValueError(f"model {repo_id!r}: {', '.join(parts)} mix a split set with a whole file")
    count = int(numbers[0][2])
    have = sorted(int(m[1]) for m in numbers)
    if have != list(range(1, count + 1)) or any(int(m[2]) != count for m in numbers):
        missing = sorted(set(range(1, count + 1)) - set(have))
        raise ValueError(f"model {repo_id!r}: the split set {parts[0]!r} has {count} parts, the repository "
                         f"{len(parts)} (missing part(s) {', '.join(map(str, missing)) or 'none'})")
    return sorted(parts, key=lambda p: int(_SPLIT.search(p)[1]))


def _tag_list(files: list[str]) -> str:
    tags = file_tags(files)
    return "tags: " + ", ".join(tags) if tags else "files: " + ", ".join(files[:8])
