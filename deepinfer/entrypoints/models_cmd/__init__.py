"""Model management commands, like `ollama pull` / `ollama list` / `ollama rm`:

    deepinfer pull org/name [--revision R]          an HF checkpoint into the Hugging Face cache
    deepinfer pull org/name/file.gguf [--models-dir DIR]    one GGUF (also org/name:file.gguf)
    deepinfer pull org/name:Q4_K_M [--models-dir DIR]       a GGUF by quant tag (a split set: all parts)
    deepinfer list [--json] [--models-dir DIR]      NAME, SOURCE, SIZE, TYPES, MODIFIED of offline models
                                                    (TYPES: a GGUF's matrix bytes per ggml type); an
                                                    entry it cannot read is skipped and named on stderr
    deepinfer rm NAME [--models-dir DIR]            a Hub-cache model or a GGUF of the models dir

Exit status: 0 done; 1 a download failed (network, the Hub's refusal, a hash mismatch, an answer
that fails its check: see `safe_names`), or `list` could read nothing but skipped entries; 2 a bad
name, a model that is not there, or one `rm` must not delete (`cli.main` reports those).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

from deepinfer.entrypoints.models_cmd.cache_scan import printable
from deepinfer.entrypoints.models_cmd.inventory import ModelEntry, default_models_dir, list_models, remove_model

_MODELS_DIR_HELP = ("directory of GGUF files (default: $DEEPINFER_MODELS_DIR, else models in "
                    "$DEEPINFER_CACHE_DIR or ~/.cache/deepinfer)")


def add_model_commands(sub) -> None:
    """Register `pull`, `list` and `rm` on the `deepinfer` subparsers `sub`."""
    pull = sub.add_parser("pull", help="download a model from the Hugging Face Hub (resumable, hash-checked)")
    pull.add_argument("name", help="org/name (an HF checkpoint; a GGUF repository: its Q4_K_M), org/name/file.gguf "
                                   "(one GGUF file) or org/name:TAG (a GGUF file or split set by quant tag)")
    pull.add_argument("--revision", default=None, help="branch, tag or commit to pull (default: main)")
    pull.add_argument("--models-dir", default=None, metavar="DIR",
                      help="put a GGUF file into DIR instead of the Hugging Face cache (default: the cache)")
    pull.set_defaults(func=cmd_pull)
    ls = sub.add_parser("list", help="models available offline: pip-shipped, Hugging Face cache, models dir")
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.add_argument("--models-dir", default=None, metavar="DIR", help=_MODELS_DIR_HELP)
    ls.set_defaults(func=cmd_list)
    rm = sub.add_parser("rm", help="delete a model from the Hugging Face cache or the models dir")
    rm.add_argument("name", help="a name `deepinfer list` shows (org/name, org/name/file.gguf or a GGUF path)")
    rm.add_argument("--models-dir", default=None, metavar="DIR", help=_MODELS_DIR_HELP)
    rm.set_defaults(func=cmd_rm)


def cmd_pull(args) -> int:
    """Pull `args.name`, list the files fetched and the total size; 1 when the download fails."""
    from deepinfer.entrypoints.models_cmd.pull import download_errors, pull

    try:
        commit, files = pull(args.name, args.revision, args.models_dir)
    except download_errors() as exc:
        print(f"deepinfer: error: pull {args.name}: {_first_line(exc)}", file=sys.stderr)
        return 1
    for f in files:
        print(f"{f.status:<10}  {format_size(f.size):>8}  {f.path}")
    where = files[0].local_path if args.models_dir else _snapshot_dir(files)
    print(f"pulled {args.name} (revision {commit[:12]}): {len(files)} file(s), "
          f"{format_size(sum(f.size for f in files))}, in {where}")
    return 0


def _snapshot_dir(files) -> str:
    first = files[0]
    return first.local_path[: len(first.local_path) - len(first.path)].rstrip("/\\")


def cmd_list(args) -> int:
    """Print the offline models as a table (or JSON with --json); each entry that cannot be read as
    one `skipped` line on stderr. 1 when entries were skipped and none could be listed, else 0."""
    inventory = list_models(args.models_dir)
    for s in inventory.skipped:
        print(f"deepinfer: list: skipped {printable(s.path)}: {printable(s.reason)}", file=sys.stderr)
    if args.json:
        print(json.dumps({"models": [entry_json(e) for e in inventory.entries],
                          "skipped": [{"path": printable(s.path), "reason": printable(s.reason)}
                                      for s in inventory.skipped]}, indent=2))
    else:
        print(format_table(inventory.entries, now=time.time()))
    return 1 if inventory.skipped and not inventory.entries else 0


def cmd_rm(args) -> int:
    """Delete one model; ValueError / FileNotFoundError (exit 2) when it may not or cannot be."""
    removed = remove_model(args.name, args.models_dir or default_models_dir())
    print(f"deleted {removed.name} ({removed.source}, {format_size(removed.size)})")
    return 0


def entry_json(entry: ModelEntry) -> dict:
    """One row of `list --json`'s "models": name, source, size (bytes), types (a GGUF's matrix bytes
    per ggml type, else {}), modified (ISO 8601, UTC), path."""
    modified = datetime.datetime.fromtimestamp(entry.modified, datetime.UTC)
    return {"name": entry.name, "source": entry.source, "size": entry.size, "types": type_mix(entry.path),
            "modified": modified.isoformat(timespec="seconds"), "path": entry.path}


def type_mix(path: str) -> dict[str, int]:
    """Bytes of a GGUF's matrices per ggml type, largest first (a split set's first part: every
    part's; any other file, or one that cannot be read: {})."""
    from deepinfer.model_executor.loader.gguf_file import read_gguf_file

    if not path.lower().endswith(".gguf"):
        return {}
    try:
        tensors = read_gguf_file(path).tensors
    except (OSError, ValueError):
        return {}
    mix: dict[str, int] = {}
    for t in tensors:
        if len(t.shape) >= 2:
            mix[t.tensor_type.name] = mix.get(t.tensor_type.name, 0) + t.data.nbytes
    return dict(sorted(mix.items(), key=lambda kv: -kv[1]))


def format_types(mix: dict[str, int]) -> str:
    """"Q3_K 58%, IQ4_XS 31%, Q6_K 11%": the three largest shares, then "+N" more types."""
    total = sum(mix.values())
    if not total:
        return "-"
    shown = [f"{kind} {round(100 * size / total)}%" for kind, size in list(mix.items())[:3]]
    return ", ".join(shown) + (f", +{len(mix) - 3}" if len(mix) > 3 else "")


def format_table(entries: list[ModelEntry], now: float) -> str:
    """Left-aligned columns NAME, SOURCE, SIZE, TYPES, MODIFIED (a models-dir path shortened with ~;
    control characters in a name escaped)."""
    home = os.path.expanduser("~")
    rows = [("NAME", "SOURCE", "SIZE", "TYPES", "MODIFIED")]
    for e in entries:
        name = "~" + e.name[len(home):] if e.source == "models-dir" and e.name.startswith(home + os.sep) else e.name
        rows.append((printable(name), e.source, format_size(e.size), format_types(type_mix(e.path)),
                     format_age(now - e.modified)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ("    ".join([*(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)), r[4]]) for r in rows)
    return "\n".join(lines)


def format_size(num_bytes: int) -> str:
    """Decimal units as `ollama list` prints them: 812 B, 4.2 kB, 98 MB, 1.3 GB."""
    value = float(num_bytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    return f"{int(value)} {unit}" if unit == "B" or value >= 10 else f"{value:.1f} {unit}"


def format_age(seconds: float) -> str:
    """How long ago, in the largest whole unit: "just now", "5 minutes ago", "3 days ago"."""
    seconds = max(0.0, seconds)
    for unit, span in (("year", 365 * 86400), ("month", 30 * 86400), ("week", 7 * 86400), ("day", 86400),
                       ("hour", 3600), ("minute", 60)):
        if seconds >= span:
            count = int(seconds // span)
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "just now"


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
