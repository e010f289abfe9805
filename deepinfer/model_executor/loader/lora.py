"""LoRA adapters from disk: PEFT directories (adapter_config.json + adapter_model.safetensors) and,
through `loader/gguf_lora.py` where it exists, llama.cpp's GGUF LoRA files.

    adapter_files(path)         the files whose bytes make the adapter (ValueError if missing, not a
                                regular file, empty or larger than an adapter of the base can be)
    adapter_fingerprint(files)  their content identity (loader/fingerprint.py: stat-keyed digests)
    read_adapter(path)          (config, {PEFT tensor name: tensor}) and the identity of the bytes read;
                                headers are checked before any tensor is read (loader/lora_files.py)
    max_adapter_bytes(base)     the most tensor bytes an adapter of the base within max_lora_rank holds
    adapter_modules(...)        per target module: A [r, in], B [out, r], scale (alpha / r, rsLoRA:
                                alpha / sqrt(r); `rank_pattern` / `alpha_pattern` per module)
    AdapterChecker              `AdapterResolver`: a LoRARequest checked against the base -> LoRAAdapter

PEFT names a module's weights `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`, where
<module> is the HF module name (`model.layers.3.self_attn.q_proj`). Anything else PEFT may save
(DoRA magnitudes, embedding LoRA, `modules_to_save`, trained biases) changes more than a linear
layer's output and is refused, naming the adapter. Errors name the adapter, its path (the caller's
own; a runtime load is checked against the allowed directories before it gets here) and the field,
never a value from its files but numbers and short plain names (`lora_files.shown`).
"""

from __future__ import annotations

import hashlib
import importlib
import math
import os
import re
import struct
import threading
import time
from dataclasses import dataclass

import torch

from deepinfer.contracts.lora import LoRAAdapter, LoRABase, LoRARequest
from deepinfer.model_executor.loader.fingerprint import content_identity, default_cache_dir
from deepinfer.model_executor.loader.lora_files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MAX_CONFIG_BYTES,
    MAX_HEADER_BYTES,
    adapter_file_paths,
    identity_of,
    open_adapter_file,
    read_config,
    read_safetensors,
    shown,
)

GGUF_LORA_MODULE = "deepinfer.model_executor.loader.gguf_lora"
_PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
_QUIET_NS = 2_000_000_000  # a file unchanged this long keeps its fingerprint in memory (git's racy rule)


@dataclass(frozen=True)
class ModuleLoRA:
    """One target module's adapter: delta = ((x A^T) B^T) * scale."""

    A: torch.Tensor  # [r, in]
    B: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]


def _where(name: str, path: str) -> str:
    return f"LoRA adapter {name!r} ({path})"


def adapter_files(path: str, name: str, max_bytes: int | None = None) -> list[str]:
    """The files of the adapter at `path`: a PEFT directory's config and weights, or one .gguf file;
    each a regular file (links followed) of at least one byte, the config at most MAX_CONFIG_BYTES,
    the weights at most `max_bytes` of tensors plus a header (None: no bound)."""
    where = _where(name, path)
    weights_limit = None if max_bytes is None else max_bytes + MAX_HEADER_BYTES + 8
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"{where}: no such file")
        _check_file(path, where, weights_limit)
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"{where}: no such directory (expected {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} in it)")
    files = adapter_file_paths(path)
    missing = [os.path.basename(f) for f in files if not os.path.lexists(f)]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (a PEFT adapter saved with save_pretrained "
                         f"and safe_serialization)")
    _check_file(files[0], where, MAX_CONFIG_BYTES)
    _check_file(files[1], where, weights_limit)
    return files


def _check_file(path: str, where: str, limit: int | None) -> None:
    os.close(open_adapter_file(path, where, limit)[0])


def max_adapter_bytes(base: LoRABase) -> int:
    """The most tensor bytes an adapter of `base` can hold: A [r, in] and B [out, r] of every target
    at r = max_lora_rank, in float64 (a larger weights file is refused before it is read)."""
    return sum((i + o) * base.max_lora_rank * 8 for i, o in base.targets.values())


def adapter_fingerprint(files: list[str]) -> str:
    """The content identity of the adapter's files (equal for copies, new after a rewrite)."""
    return content_identity(files, default_cache_dir())


def bytes_identity(blobs: dict[str, bytes]) -> str:
    """`content_identity`'s value for files with these basenames and bytes (what was actually read)."""
    return identity_of({name: hashlib.blake2b(data, digest_size=32).hexdigest() for name, data in blobs.items()})


def read_adapter(path: str, name: str, base_config: dict | None = None,
                 max_bytes: int | None = None) -> tuple[dict, dict[str, torch.Tensor], str]:
    """(adapter config, {PEFT tensor name: tensor}, identity of the bytes read) of the adapter at `path`;
    `base_config`: the base's head counts (a GGUF adapter's q/k rows need them); `max_bytes`: the most
    tensor bytes accepted (`max_adapter_bytes`), checked before a tensor is read."""
    files = adapter_files(path, name, max_bytes)
    if path.endswith(".gguf"):
        config, tensors = _read_gguf(path, name, base_config)
        return config, tensors, adapter_fingerprint(files)
    where = _where(name, path)
    config, config_digest = read_config(files[0], where)
    tensors, weights_digest = read_safetensors(files[1], where, max_bytes, lambda key: _module_of(key, where))
    return config, tensors, identity_of({ADAPTER_CONFIG: config_digest, ADAPTER_WEIGHTS: weights_digest})


def _read_gguf(path: str, name: str, base_config: dict | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """`gguf_lora.read_gguf_lora(path, base_config)`: (a config like PEFT's, {PEFT tensor name: tensor})."""
    try:
        module = importlib.import_module(GGUF_LORA_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != GGUF_LORA_MODULE:
            raise
        raise ValueError(f"{_where(name, path)}: GGUF LoRA adapters are not supported by this build "
                         f"(no {GGUF_LORA_MODULE})") from None
    try:
        return module.read_gguf_lora(path, base_config=base_config or None)
    except (OSError, KeyError, ValueError, struct.error, OverflowError) as exc:
        raise ValueError(f"{_where(name, path)}: not a readable GGUF LoRA file ({exc})") from None


# ---- from PEFT tensors to target modules -----------------------------------------------------------

def check_config(config: dict, where: str) -> None:
    """Refuse what a PEFT config asks for beyond plain LoRA on linear layers, naming the field."""
    peft_type = config.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise ValueError(f"{where}: peft_type {shown(peft_type)} is not supported (only LORA)")
    for field, allowed in (("use_dora", (False, None)), ("bias", ("none", None)), ("modules_to_save", (None,)),
                           ("fan_in_fan_out", (False, None))):
        value = config.get(field)
        if value not in allowed and value != []:
            raise ValueError(f"{where}: {field}={shown(value)} is not supported (plain LoRA on linear layers only)")
    alpha = config.get("lora_alpha")
    if not _positive_number(alpha):
        raise ValueError(f"{where}: lora_alpha must be a positive number, got {shown(alpha)}")
    for field in ("alpha_pattern", "rank_pattern"):
        _check_patterns(config.get(field), field, where)


def _positive_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_patterns(patterns, field: str, where: str) -> None:
    """PEFT's per-module overrides: {regular expression: positive number}."""
    if patterns is None:
        return
    if not isinstance(patterns, dict):
        raise ValueError(f"{where}: {field} must be an object of {{module pattern: number}}, got {shown(patterns)}")
    for key, value in patterns.items():
        if not _positive_number(value):
            raise ValueError(f"{where}: {field}[{shown(key)}] must be a positive number, got {shown(value)}")
        try:
            re.compile(rf"(.*\.)?{key}$")
        except (re.error, RecursionError, OverflowError):
            raise ValueError(f"{where}: {field} key {shown(key)} is not a valid regular expression") from None


def adapter_modules(config: dict, tensors: dict[str, torch.Tensor], name: str, path: str) -> dict[str, ModuleLoRA]:
    """Per HF module name, its A, B and scale; ValueError naming the adapter and the tensor or
    field that is wrong."""
    where = _where(name, path)
    check_config(config, where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, part = _module_of(key, where)
        pairs.setdefault(module, {})[part] = tensor
    if not pairs:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    return {module: _module_lora(module, parts, config, where) for module, parts in sorted(pairs.items())}


def _module_of(key: str, where: str) -> tuple[str, str]:
    for suffix, part in ((_A, "A"), (_B, "B")):
        if key.endswith(suffix):
            return key.removeprefix(_PEFT_PREFIX).removesuffix(suffix), part
    raise ValueError(f"{where}: tensor {shown(key)} is not a LoRA A or B weight of a linear layer (DoRA, embedding "
                     f"LoRA, trained biases and modules_to_save are not supported)")


def _module_lora(module: str, parts: dict[str, torch.Tensor], config: dict, where: str) -> ModuleLoRA:
    if set(parts) != {"A", "B"}:
        raise ValueError(f"{where}: module {module!r} has lora_{'A' if 'A' in parts else 'B'} but not "
                         f"lora_{'B' if 'A' in parts else 'A'}")
    A, B = parts["A"], parts["B"]
    if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1] or A.shape[0] < 1:
        raise ValueError(f"{where}: module {module!r} has lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}; "
                         f"expected [r, in] and [out, r]")
    rank = A.shape[0]
    alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return ModuleLoRA(A.float(), B.float(), float(scale))


def _pattern_value(patterns, module: str, default):
    """PEFT's per-module override: the first pattern key that matches the end of the module name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


# ---- admission: the resolver -----------------------------------------------------------------------

class AdapterChecker:
    """The engine's `AdapterResolver` over one base model (`LoRABase`): each LoRARequest is checked
    once per content (fingerprint): files readable, ranks within max_lora_rank, every target a module
    the base has. Thread-safe (the server checks adapters off the engine thread)."""

    def __init__(self, base: LoRABase):
        self.base = base
        self.max_bytes = max_adapter_bytes(base)  # a larger weights file is refused unread
        self._lock = threading.Lock()
        self._checked: dict[str, int] = {}  # fingerprint -> largest rank
        self._by_stat: dict[tuple, str] = {}  # the files' stats -> fingerprint (no digest file read per request)

    def resolve(self, request: LoRARequest) -> LoRAAdapter:
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        name, path = request.lora_name, os.path.expanduser(request.lora_path)
        try:
            fingerprint = self._fingerprint(adapter_files(path, name, self.max_bytes))
            with self._lock:
                rank = self._checked.get(fingerprint)
            if rank is None:
                rank = self._check(name, path)
                with self._lock:
                    self._checked[fingerprint] = rank
        except OSError as exc:  # a file that went away or failed to read between the checks and the read
            raise ValueError(f"{_where(name, path)}: its files cannot be read ({exc.strerror})") from None
        key = hashlib.sha256(f"{fingerprint}\0{self.base.numerics_tag}\0{self.base.max_lora_rank}".encode())
        return LoRAAdapter(name, request.lora_int_id, path, fingerprint, key.hexdigest(), rank)

    def _fingerprint(self, files: list[str]) -> str:
        """The files' content identity, remembered by their (device, inode, size, mtime, ctime) once
        they have been quiet for a while; any rewrite changes ctime, so it is hashed again."""
        stats = tuple((os.path.realpath(f), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                      for f in files for st in [os.stat(f)])
        with self._lock:
            known = self._by_stat.get(stats)
        if known is not None:
            return known
        fingerprint = adapter_fingerprint(files)
        if all(max(s[4], s[5]) < time.time_ns() - _QUIET_NS for s in stats):
            with self._lock:
                self._by_stat[stats] = fingerprint
        return fingerprint

    def _check(self, name: str, path: str) -> int:
        config, tensors, _ = read_adapter(path, name, self.base.base_config, self.max_bytes)
        check_target_names(config, self.base, _where(name, path))
        modules = adapter_modules(config, tensors, name, path)
        check_modules(modules, self.base, name, path)
        return max(m.rank for m in modules.values())


def check_target_names(config: dict, base: LoRABase, where: str) -> None:
    """A config's `target_modules` list names only projections the base offers (a regex string is
    checked through the saved tensors instead)."""
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        return
    supported = sorted({t.rsplit(".", 1)[-1] for t in base.targets})
    lacking = [shown(t) for t in targets if str(t).rsplit(".", 1)[-1] not in supported]
    if lacking:
        raise ValueError(f"{where}: target_modules [{', '.join(lacking)}] are modules the base model lacks or LoRA "
                         f"does not cover (supported: {', '.join(supported)})")


def check_modules(modules: dict[str, ModuleLoRA], base: LoRABase, name: str, path: str) -> None:
    """Every module is one the base offers, with its shapes, of rank at most max_lora_rank."""
    where = _where(name, path)
    unknown = sorted(set(modules) - set(base.targets))
    if unknown:
        leaves = sorted({m.rsplit(".", 1)[-1] for m in unknown})
        supported = sorted({t.rsplit(".", 1)[-1] for t in base.targets})
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise ValueError(f"{where}: targets modules the base model lacks or LoRA does not cover: {unknown[0]!r}{more} "
                         f"(target_modules {', '.join(leaves)}; supported: {', '.join(supported)})")
    for module, lora in modules.items():
        in_features, out_features = base.targets[module]
        if lora.A.shape[1] != in_features or lora.B.shape[0] != out_features:
            raise ValueError(f"{where}: module {module!r} has lora_A {tuple(lora.A.shape)} and lora_B "
                             f"{tuple(lora.B.shape)}, but the base layer has {in_features} inputs and "
                             f"{out_features} outputs (an adapter for another base model?)")
    big = max(modules.items(), key=lambda kv: kv[1].rank)
    if big[1].rank > base.max_lora_rank:
        raise ValueError(f"{where}: rank {big[1].rank} (module {big[0]!r}) exceeds max_lora_rank="
                         f"{base.max_lora_rank}; raise --max-lora-rank")
