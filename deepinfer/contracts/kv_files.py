"""Where the saved KV cache lives on disk, and what every file says about itself. No torch.

One directory (`--kv-cache-dir`) may hold the saved cache of several models: each model's files
sit under a folder named by the first 16 hex digits of its cache identity (the root every key
chains from), one safetensors file per cached unit:

    <dir>/<root16>/<key>.<group>.safetensors      one paged block of a cache group
    <dir>/<root16>/<key>.snapshot.safetensors     ring rows, per-request state and partial pages
                                                  at a boundary (sliding-window and V4 models)
    <dir>/<root16>/canary                         the identity's canary: a digest of a few fixed
                                                  rows, checked at start-up (worker/cache_canary.py)

`key` is the unit's chained hash (hex), which already includes the identity root and the
request's cache salt. Each file's metadata repeats format, version, root, key and kind and
carries a checksum of its tensors, so a damaged, truncated or foreign file is never read as a hit.
Only regular files are ever read there, never through a symlink (worker/kv_dir_io.py).
"""

from __future__ import annotations

import os

KV_FILE_FORMAT = "deepinfer-kv"
KV_FILE_VERSION = "2"  # 2: the CPU attention merges 512-key chunks (rows past position 512 have other bits)
KV_FILE_SUFFIX = ".safetensors"
SNAPSHOT = "snapshot"
CANARY_RECORD = "canary"


def root_dir(directory: str, root: str) -> str:
    """The folder of one model identity's files."""
    return os.path.join(directory, root[:16])


def unit_file(directory: str, root: str, key: str, kind: str) -> str:
    """The file of one cached unit: kind is a paged group's name or SNAPSHOT."""
    return os.path.join(root_dir(directory, root), f"{key}.{kind}{KV_FILE_SUFFIX}")


def canary_file(directory: str, root: str) -> str:
    """The canary record of one model identity (not a cache unit: counted in the budget, never evicted)."""
    return os.path.join(root_dir(directory, root), CANARY_RECORD)
