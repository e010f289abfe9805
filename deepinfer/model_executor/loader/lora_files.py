"""Reading a LoRA adapter's files without trusting them (used by loader/lora.py).

    check_inside_dirs(path, name, dirs)   a runtime load: the adapter and each of its files, resolved
                                          (symlinks followed), lie inside one of the allowed
                                          directories (--lora-dir); refused otherwise, with the same
                                          message whether or not the path exists
    open_adapter_file(path, where, limit) the file, resolved, opened as a regular file only
                                          (loader/regular_file.py: O_NOFOLLOW, lstat + fstat), not
                                          empty (/proc files report 0 bytes) and at most `limit` bytes
    read_config(path, where)              adapter_config.json: at most MAX_CONFIG_BYTES, nested at most
                                          MAX_CONFIG_DEPTH deep, a JSON object
    read_safetensors(path, where, ...)    the 8-byte header length and the JSON header are checked
                                          against the file's size first (every tensor's dtype, shape
                                          and offsets; the tensors tile the data section), every tensor
                                          name is vetted, and only then are the tensors read, one at a
                                          time, in file order

Both readers hash the bytes they read (blake2b-256, as loader/fingerprint.py hashes a file), so the
adapter's identity is that of the bytes actually read. Error messages name the adapter, the file
and the field; they never echo a value from a file unless it is a number or a short plain name
(`shown`), and they never show where a path outside the allowed directories leads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Sequence

import torch

from deepinfer.json_bounds import json_depth
from deepinfer.model_executor.loader.regular_file import NotRegular, open_regular

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes a few KB, rank_pattern of every module included
MAX_CONFIG_DEPTH = 32  # arrays and objects inside one another (PEFT's config: 3)
MAX_HEADER_BYTES = 16 << 20  # a safetensors header (the library's own limit is 100 MB)
MAX_DIMS = 8
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_PLAIN = re.compile(r"[A-Za-z0-9_.\-]{1,120}")


def shown(value) -> str:
    """`value` for an error message, without echoing file contents: numbers, booleans, None and
    short plain names (letters, digits, `_.-`) as they are, anything else by its type only."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return repr(value)
    return f"a {type(value).__name__} value"


def check_inside_dirs(path: str, name: str, dirs: Sequence[str]) -> None:
    """ValueError unless `path` (and, for a PEFT directory, its config and weights), resolved, lie
    inside one of `dirs`. Nothing is opened: the answer is the same whether the path exists or not."""
    refused = (f"LoRA adapter {name!r}: lora_path is outside the directories this server loads adapters "
               f"from at run time (--lora-dir)")
    if not dirs:
        raise ValueError(f"{refused}; the server was started without --lora-dir, so none is allowed")
    roots = [os.path.realpath(d) for d in dirs]
    paths = [path] if path.endswith(".gguf") else [path, *adapter_file_paths(path)]
    for candidate in paths:
        real = os.path.realpath(candidate)
        if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots):
            raise ValueError(refused)


def adapter_file_paths(directory: str) -> list[str]:
    """A PEFT adapter directory's config and weights files."""
    return [os.path.join(directory, ADAPTER_CONFIG), os.path.join(directory, ADAPTER_WEIGHTS)]


def open_adapter_file(path: str, where: str, limit: int | None) -> tuple[int, int]:
    """(fd, size) of the regular file `path` resolves to, of 1 to `limit` bytes; ValueError naming
    the file otherwise. The caller closes the fd."""
    label = os.path.basename(path)
    try:
        fd, st = open_regular(os.path.realpath(path))  # O_NOFOLLOW: a link swapped in meanwhile is refused
    except FileNotFoundError:
        raise ValueError(f"{where}: missing {label}") from None
    except NotRegular as exc:
        raise ValueError(f"{where}: {label} is {exc.what}, not a regular file") from None
    except OSError as exc:
        raise ValueError(f"{where}: cannot open {label} ({exc.strerror})") from None
    if st.st_size == 0 or (limit is not None and st.st_size > limit):
        os.close(fd)
        bound = f"at most {limit} bytes" if limit is not None else "at least 1 byte"
        raise ValueError(f"{where}: {label} holds {st.st_size} bytes; an adapter's {label} holds {bound}")
    return fd, st.st_size


def _read_exactly(fd: int, size: int, offset: int, label: str, where: str) -> bytearray:
    """`size` bytes of fd from `offset`, into one buffer; ValueError when the file ends first."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    try:
        while got < size:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise ValueError(f"{where}: {label} shrank while it was read (ended at byte {offset + got})")
            got += n
    except OSError as exc:
        raise ValueError(f"{where}: cannot read {label} ({exc.strerror})") from None
    finally:
        view.release()
    return buffer


def parse_json_object(raw: bytes, label: str, where: str) -> dict:
    """The JSON object in `raw`, nested at most MAX_CONFIG_DEPTH deep; ValueError naming `label`
    (with the line and column of a syntax error, never the text)."""
    if json_depth(raw) > MAX_CONFIG_DEPTH:
        raise ValueError(f"{where}: {label} nests arrays and objects deeper than {MAX_CONFIG_DEPTH}")
    try:
        value = json.loads(bytes(raw).decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{where}: {label} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: {label} is not valid JSON ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno})") from None
    except (ValueError, RecursionError):
        raise ValueError(f"{where}: {label} is not valid JSON") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {label} is not a JSON object")
    return value


def read_config(path: str, where: str) -> tuple[dict, str]:
    """(the adapter_config.json object, blake2b-256 hex of its bytes)."""
    fd, size = open_adapter_file(path, where, MAX_CONFIG_BYTES)
    try:
        raw = _read_exactly(fd, size, 0, ADAPTER_CONFIG, where)
    finally:
        os.close(fd)
    return parse_json_object(raw, ADAPTER_CONFIG, where), hashlib.blake2b(raw, digest_size=32).hexdigest()


def read_safetensors(path: str, where: str, max_bytes: int | None,
                     vet_name: Callable[[str], object]) -> tuple[dict[str, torch.Tensor], str]:
    """({tensor name: tensor}, blake2b-256 hex of the file) of the safetensors file at `path`, whose
    tensors hold at most `max_bytes` (None: no bound). `vet_name(name)` raises for a name the caller
    refuses; every check runs before the first tensor byte is read."""
    limit = None if max_bytes is None else max_bytes + MAX_HEADER_BYTES + 8
    fd, size = open_adapter_file(path, where, limit)
    try:
        digest = hashlib.blake2b(digest_size=32)
        entries, data_start = _read_header(fd, size, where, digest)
        for name, *_ in entries:
            vet_name(name)
        tensors = {}
        for name, dtype, shape, begin, end in entries:  # in file order: the digest covers every byte
            raw = _read_exactly(fd, end - begin, data_start + begin, ADAPTER_WEIGHTS, where)
            digest.update(raw)
            tensors[name] = torch.frombuffer(raw, dtype=dtype).reshape(shape)
    finally:
        os.close(fd)
    return tensors, digest.hexdigest()


def _read_header(fd: int, size: int, where: str, digest) -> tuple[list[tuple], int]:
    """The tensor table [(name, dtype, shape, begin, end)] sorted by offset, and where data starts;
    ValueError unless the header fits the file and the tensors tile the rest of it exactly."""
    label = ADAPTER_WEIGHTS
    if size < 8:
        raise ValueError(f"{where}: {label} holds {size} bytes, too few for a safetensors header")
    prefix = _read_exactly(fd, 8, 0, label, where)
    length = int.from_bytes(prefix, "little")
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise ValueError(f"{where}: {label} is not a readable safetensors file (its header claims {length} "
                         f"bytes; the file holds {size}, the limit is {MAX_HEADER_BYTES})")
    raw = _read_exactly(fd, length, 8, label, where)
    digest.update(prefix)
    digest.update(raw)
    header = parse_json_object(raw, f"{label}'s header (not a readable safetensors file)", where)
    entries = sorted((_entry(name, info, where) for name, info in header.items() if name != "__metadata__"),
                     key=lambda e: (e[3], e[4]))
    covered = 0
    for name, _, _, begin, end in entries:
        if begin != covered:
            raise ValueError(f"{where}: {label} is not a readable safetensors file (tensor {shown(name)} starts at "
                             f"byte {begin} of the data, expected {covered}: tensors overlap or leave a gap)")
        covered = end
    if 8 + length + covered != size:
        raise ValueError(f"{where}: {label} is not a readable safetensors file (its tensors cover {covered} bytes; "
                         f"the file holds {size - 8 - length} after the header)")
    return entries, 8 + length


def _entry(name: str, info, where: str) -> tuple:
    """(name, torch dtype, shape, begin, end) of one header entry, checked for itself."""
    bad = f"{where}: {ADAPTER_WEIGHTS} is not a readable safetensors file (tensor {shown(name)}"
    if not isinstance(info, dict):
        raise ValueError(f"{bad} has no dtype, shape and data_offsets)")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPES:
        raise ValueError(f"{bad} has dtype {shown(dtype)}; LoRA weights are {', '.join(_DTYPES)})")
    if not _ints(shape, 1) or not 1 <= len(shape) <= MAX_DIMS:
        raise ValueError(f"{bad}: its shape is not a list of 1 to {MAX_DIMS} positive integers)")
    if not _ints(offsets, 0) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise ValueError(f"{bad}: its data_offsets are not [begin, end], integers with begin <= end)")
    nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise ValueError(f"{bad} spans {offsets[1] - offsets[0]} bytes; its shape {shape} of {dtype} takes {nbytes})")
    return name, _DTYPES[dtype], tuple(shape), offsets[0], offsets[1]


def _ints(values, low: int) -> bool:
    return (isinstance(values, list) and len(values) <= MAX_DIMS + 1
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in values))


def identity_of(digests: dict[str, str]) -> str:
    """`fingerprint.content_identity`'s value for files with these basenames and blake2b-256 digests."""
    identity = hashlib.sha256()
    for name, digest in sorted(digests.items()):
        identity.update(f"{name}\0{digest}\0".encode())
    return identity.hexdigest()
