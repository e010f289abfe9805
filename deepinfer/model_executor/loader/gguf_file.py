"""A lean GGUF header reader: scalar metadata, the tensor table, and memory-mapped tensor bytes.

`gguf.GGUFReader` turns every vocabulary string into numpy views (about 2.5 s for a 49k
vocabulary, more for 262k); a loader needs none of them (the tokenizer is built by transformers),
so this reader steps over long arrays by their lengths alone and reads the rest with `struct`.
Types, block sizes and dequantization still come from the `gguf` package.

The file is mapped read-only and shared (PROT_READ, MAP_SHARED): its pages are the page cache's,
counted once however many processes map it, and dropped under memory pressure, never swapped.
Every tensor's `data` is a read-only numpy view of that mapping, and `as_tensor` turns such a view
into a torch tensor that is a slice of the mapping's one torch tensor (so views of neighbouring
tensors share a storage), without a copy. Torch has no read-only tensors: a write into one of them
faults (SIGSEGV) instead of changing the file; the engine never writes into weights. The mapping
lives as long as any view or tensor of it does (each holds a reference to its base).

    file = magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
           | n_kv x (string key, u32 type, value)
           | n_tensors x (string name, u32 n_dims, u64 dims[n_dims] innermost-first, u32 type, u64 offset)
           | padding to general.alignment (32) | tensor data, each at data_start + offset
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_LENGTH = 4096  # longer metadata arrays (vocabulary, merges, scores) are skipped, not read
DEFAULT_ALIGNMENT = 32
_SUPPORTED_VERSIONS = (2, 3)
# value type id -> struct format, for the fixed-size types
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: GGUF name, ggml type, torch-order shape and its raw bytes (a read-only view)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (outermost first)
    data: np.ndarray  # a read-only view of the mapping, as gguf.quants.dequantize expects: values or uint8 blocks


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (long arrays left out) and tensors, in file order."""

    path: str
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def read_gguf_file(path: str) -> GGUFFile:
    """Parse the header of `path`; ValueError naming the path when it is not a readable GGUF.

    A split set (llama.cpp's `NAME-00001-of-0000N.gguf`, keys `split.no` / `split.count`) is read
    from its first part: the metadata is the first part's, the tensors every part's in order, each
    a view of its own part's mapping (`gguf_parts` names the files).

    Loading reads a file's header several times (config, weights, sizes): the parsed header is kept
    per process for the file as `os.stat` sees it (a rewritten file is parsed again); the file is
    mapped anew each time (a system call).
    """
    metadata, tensors = _read_part(path)
    parts = split_parts(path, metadata)
    for number, part in enumerate(parts[1:], start=1):
        if not os.path.isfile(part):
            raise ValueError(f"{path!r} is the first of {len(parts)} parts of a split GGUF, but part "
                             f"{number + 1}, {part!r}, is missing")
        more, part_tensors = _read_part(part)
        if (more.get("split.no"), more.get("split.count")) != (number, len(parts)):
            raise ValueError(f"{part!r} should be part {number + 1} of {len(parts)} of {path!r}'s split set, but "
                             f"its split.no is {more.get('split.no')!r} and split.count {more.get('split.count')!r}")
        tensors += part_tensors
    expected = metadata.get("split.tensors.count")
    if len(parts) > 1 and expected is not None and expected != len(tensors):
        raise ValueError(f"the split GGUF {path!r} declares {expected} tensors (split.tensors.count); its "
                         f"{len(parts)} parts hold {len(tensors)}")
    return GGUFFile(path=path, metadata=dict(metadata), tensors=tensors)


_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: str, metadata: dict[str, Any]) -> list[str]:
    """The files of the split set whose first part is `path` (`[path]` for a whole file), by
    llama.cpp's naming; ValueError for a later part or a name that hides the others."""
    count, number = int(metadata.get("split.count") or 1), int(metadata.get("split.no") or 0)
    if count <= 1:
        return [path]
    match = _SPLIT_NAME.match(os.path.basename(path))
    if match is None:
        raise ValueError(f"{path!r} is part {number + 1} of a {count}-part split GGUF, but its name does not end "
                         f"in -{number + 1:05d}-of-{count:05d}.gguf, so its other parts cannot be found")
    folder, prefix = os.path.dirname(path), match["prefix"]
    first = os.path.join(folder, f"{prefix}-00001-of-{count:05d}.gguf")
    if number != 0:
        raise ValueError(f"{path!r} is part {number + 1} of {count} of a split GGUF: load its first part, {first!r}")
    return [os.path.join(folder, f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def gguf_parts(path: str) -> list[str]:
    """The files a GGUF's weights are in: `[path]`, or every part of a split set given its first."""
    return split_parts(path, _read_part(path)[0])


def _read_part(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """One file's metadata and tensors (views of its mapping); the parsed header cached by stat."""
    blob, stat = _map(path)
    key = (os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    header = _HEADERS.pop(key, None)
    if header is None:  # parsed and checked once per file as stat sees it (its size is in the key)
        header = _parse_header(blob, path)
        check_tensor_table(path, blob.size, header[2], header[1])
    _HEADERS[key] = header  # most recent last
    while len(_HEADERS) > _MAX_HEADERS:
        del _HEADERS[next(iter(_HEADERS))]
    metadata, entries, data_start = header
    return metadata, [_tensor_view(blob, data_start, entry, path) for entry in entries]


_HEADERS: dict[tuple, tuple] = {}  # stat key -> (metadata, tensor table, data start)
_MAX_HEADERS = 8


def _parse_header(blob: np.ndarray, path: str) -> tuple[dict, list[tuple], int]:
    if blob.size < 24 or bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path!r} does not start with the GGUF magic bytes and header counts")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(f"{path!r} is GGUF version {version}; supported versions: {_SUPPORTED_VERSIONS}")
    try:
        metadata, pos = _read_metadata(blob, 24, n_kv)
        entries, pos = _read_tensor_table(blob, pos, n_tensors, path)
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path!r} has a truncated or corrupt GGUF header: {exc}") from exc
    alignment = _alignment(metadata, path)
    return metadata, entries, -(-pos // alignment) * alignment


def map_read_only(path: str) -> np.ndarray:
    """The bytes of `path`, mapped read-only and shared: a non-writable uint8 [size] array whose base
    is the mapping's torch tensor (`as_tensor`); ValueError naming the path for an empty file."""
    return _map(path)[0]


def _map(path: str) -> tuple[np.ndarray, os.stat_result]:
    with open(path, "rb") as f:
        stat = os.fstat(f.fileno())
        if stat.st_size == 0:
            raise ValueError(f"{path!r} is empty, not a GGUF file")
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # PROT_READ, MAP_SHARED
    blob = readonly_tensor(mapping).numpy()  # [size]; base: the tensor, whose storage holds the mapping
    blob.flags.writeable = False  # and so every view of it
    return blob, stat


def readonly_tensor(buffer: Any) -> torch.Tensor:
    """A uint8 torch tensor over a read-only buffer (a read-only mapping), without a copy.

    `torch.frombuffer` (like `torch.from_numpy` of a non-writable array) warns that the tensor is
    writable while its memory is not: torch has no read-only tensors. The warning is silenced here,
    the one place such a tensor is made; the pages themselves refuse writes (SIGSEGV), so a weight
    can never change the file or another process's view of it.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """`array` as a torch tensor of the same dtype and shape, sharing its memory: a slice of the
    mapping's tensor for a C-contiguous view of a mapped file, else `torch.from_numpy` (a writable
    array: a decoded or cut copy). Any other read-only array is copied."""
    root = array.base
    while isinstance(root, np.ndarray):
        root = root.base
    dtype = _TORCH_DTYPES.get(array.dtype.str)
    mapped = isinstance(root, torch.Tensor) and root.dim() == 1 and root.dtype == torch.uint8  # map_read_only's
    start = array.ctypes.data - root.data_ptr() if mapped else -1
    if start < 0 or dtype is None or not array.flags.c_contiguous or start % array.itemsize:
        # not a view of a mapping, or one no tensor view can hold (strides, an unaligned value type):
        # the array itself when it is writable (a decoded or cut copy), else a copy
        return torch.from_numpy(array if array.flags.writeable else np.array(array, order="C"))
    flat = root[start:start + array.nbytes]  # uint8 [bytes]: a view of the mapping
    return flat.view(dtype).view(array.shape)


_TORCH_DTYPES = {"|u1": torch.uint8, "|i1": torch.int8, "<f4": torch.float32, "<f2": torch.float16,
                 "<i2": torch.int16, "<i4": torch.int32, "<f8": torch.float64, "<i8": torch.int64}


def _read_string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    start = pos + 8
    return bytes(blob[start : start + length]).decode("utf-8"), start + length


def _read_metadata(blob: np.ndarray, pos: int, n_kv: int) -> tuple[dict[str, Any], int]:
    metadata = {}
    for _ in range(n_kv):
        key, pos = _read_string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        value, pos = _read_value(blob, pos + 4, value_type, key)
        if value is not _SKIPPED:
            metadata[key] = value
    return metadata, pos


_SKIPPED = object()


def _read_value(blob: np.ndarray, pos: int, value_type: int, key: str) -> tuple[Any, int]:
    """One value and the position after it; long arrays come back as `_SKIPPED`."""
    if value_type in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(blob, pos)
    if value_type != _ARRAY:
        raise ValueError(f"GGUF metadata {key!r} has unknown value type {value_type}")
    item_type, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item_type in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[item_type]
        end = pos + count * struct.calcsize(fmt)
        if count > MAX_ARRAY_LENGTH:
            return _SKIPPED, end
        return list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)), end
    if count > MAX_ARRAY_LENGTH:
        return _SKIPPED, _skip_items(blob, pos, item_type, count, key)
    values = []
    for _ in range(count):  # strings (or nested arrays)
        value, pos = _read_value(blob, pos, item_type, key)
        values.append(value)
    return values, pos


def _skip_items(blob: np.ndarray, pos: int, item_type: int, count: int, key: str) -> int:
    """The position after `count` array items of `item_type`, read no further than their lengths
    (a 49k vocabulary in ~20 ms, where decoding every string took ~200 ms)."""
    if item_type != _STRING:
        for _ in range(count):
            _, pos = _read_value(blob, pos, item_type, key)
        return pos
    unpack = struct.Struct("<Q").unpack_from
    for _ in range(count):
        pos += 8 + unpack(blob, pos)[0]
    return pos


def _alignment(metadata: dict, path: str) -> int:
    """general.alignment: a positive integer (the spec asks for a multiple of 8), default 32."""
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"{path!r}: general.alignment must be a positive integer, got {alignment!r}")
    return alignment


def _read_tensor_table(blob: np.ndarray, pos: int, n_tensors: int, path: str) -> tuple[list[tuple], int]:
    entries = []
    for _ in range(n_tensors):
        name, pos = _read_string(blob, pos)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"{path!r}: tensor {name!r} has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        pos += 4 + 8 * n_dims
        tensor_type, offset = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        entries.append((name, tuple(reversed(dims)), tensor_type, offset))
    return entries, pos


def _span(entry: tuple, path: str) -> tuple[Any, int, int]:
    """(ggml type, row bytes, bytes) of a tensor table entry; ValueError for an unknown type or a row
    that is not whole blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name, shape, type_id, _ = entry
    try:
        tensor_type = GGMLQuantizationType(type_id)
    except ValueError:
        from importlib.metadata import version

        newest = max(t.value for t in GGMLQuantizationType)
        raise ValueError(f"{path!r}: tensor {name!r} has ggml type {type_id}, which the installed gguf package "
                         f"({version('gguf')}) does not know (its types end at {newest}): a file from a newer "
                         f"llama.cpp? `pip install -U gguf` may read it") from None
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    if shape[-1] % block_size:
        raise ValueError(f"{path!r}: tensor {name!r} ({tensor_type.name}) has rows of {shape[-1]} values, not a "
                         f"multiple of the type's {block_size}-value blocks")
    row_bytes = shape[-1] // block_size * type_size
    return tensor_type, row_bytes, math.prod(shape[:-1]) * row_bytes  # Python ints: a hostile shape cannot overflow


def check_tensor_table(path: str, file_size: int, data_start: int, entries: list[tuple]) -> None:
    """Every tensor's bytes inside the file and apart from the others, before any is mapped or read;
    ValueError (one line naming the file, the tensor and both sizes) otherwise. A file shorter than
    its table says is a partial download or a cut copy: the line says how to fetch it again."""
    spans = []
    for entry in entries:
        tensor_type, _, num_bytes = _span(entry, path)
        spans.append((data_start + entry[3], num_bytes, entry[0], tensor_type.name, entry[1]))
    spans.sort()
    for (start, size, name, kind, shape), (nxt, _, other, _, _) in zip(spans, spans[1:], strict=False):
        if start + size > nxt:
            raise ValueError(f"{path!r}: tensor {name!r} ({kind} {list(shape)}: {size:,} bytes at {start:,}) runs "
                             f"into tensor {other!r} at byte {nxt:,}: its bytes do not match its type and shape")
    end = max((start + size for start, size, *_ in spans), default=data_start)
    if end > file_size:
        start, size, name, kind, shape = max(spans, key=lambda s: s[0] + s[1])
        raise ValueError(f"{path!r} is {file_size:,} bytes but its tensor table needs {end:,} (tensor {name!r}, "
                         f"{kind} {list(shape)}, ends at byte {end:,}): a partial download or a cut copy; "
                         f"{_fetch_again(path)}")


def _fetch_again(path: str) -> str:
    """How to get the file whole: the `deepinfer pull` of a Hugging Face cache path, else a new copy."""
    match = re.search(r"models--([^/]+?)--([^/]+)/snapshots/[0-9a-f]{40}/(.+\.gguf)$", path.replace(os.sep, "/"))
    if match is None:
        return "download or copy it again"
    return f"fetch it again with `deepinfer pull {match[1]}/{match[2]}/{match[3]}`"


def _tensor_view(blob: np.ndarray, data_start: int, entry: tuple, path: str) -> GGUFTensor:
    """The tensor's bytes as the array `gguf.quants.dequantize` takes ([..., bytes per row] for blocks)
    (`check_tensor_table` has checked they lie inside the file)."""
    from gguf import GGMLQuantizationType

    name, shape, _, offset = entry
    tensor_type, row_bytes, num_bytes = _span(entry, path)
    start = data_start + offset
    raw = blob[start : start + num_bytes]
    if tensor_type == GGMLQuantizationType.F32:
        return GGUFTensor(name, tensor_type, shape, raw.view(np.float32).reshape(shape))
    if tensor_type == GGMLQuantizationType.F16:
        return GGUFTensor(name, tensor_type, shape, raw.view(np.float16).reshape(shape))
    return GGUFTensor(name, tensor_type, shape, raw.reshape(*shape[:-1], row_bytes))
