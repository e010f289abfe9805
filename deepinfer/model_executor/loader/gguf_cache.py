"""What transformers derives from a GGUF file (the config and the tokenizer), kept under the cache
directory so that a second start-up neither rebuilds the tokenizer from the file's vocabulary and
merges nor imports the config's model package (together about 1.5 s for a small model):

    <cache_dir>/gguf/<key>/
        derived.json    {"format", "fields": digest of gguf_config_dict's output, "config_class",
                         "config": repr of the config's fields and class attributes, or null,
                         "tokenizer": {"class": "module:name", "added_tokens": [...]}, or null}
        tokenizer/      the tokenizer's `save_pretrained` files

`key` is a sha256 over the file's content identity (`fingerprint.py`), the versions of transformers
and tokenizers and `FORMAT`: another file, or another transformers, has its own entry. An entry is
used only when the fields `gguf_config_dict` derives from the file now are those it was written
from, so a change to that derivation never reads a stale config.

Config: a transformers config class that is plain data (no properties, attribute map, sub-configs
or methods beyond validation: Llama, Qwen2, Qwen3, ...) is read back as an instance of a
`PreTrainedConfig` subclass with the same name, `model_type` and class attributes, its fields set
as they were after the original's `__post_init__`. It reads, compares (`to_dict`) and serializes as
the original does, but is not an instance of the original class. Any other class is rebuilt by
`AutoConfig`. Tokenizer: `from_pretrained` of the saved files by the class that built it, given
the added tokens (else transformers parses the whole tokenizer.json in Python to find them).

Each part is written only after reading it back gave the same thing (the config's fields and
`to_dict()`; the tokenizer's backend, special tokens, chat template and a probe's token ids), and a
part that did not is rebuilt at every start instead. Writes go to a temporary directory renamed
into place; a damaged, foreign or unwritable cache only costs the slow path.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from deepinfer.model_executor.loader.fingerprint import default_cache_dir

FORMAT = 1
MAX_ENTRIES = 32  # the most recently written entries kept
_SUBDIR = "gguf"
_DERIVED = "derived.json"
_TOKENIZER = "tokenizer"
_VALIDATORS = ("validate", "validate_architecture")  # the only methods a plain config class may add
_PROBE = "Hello, world!\n  ünïcödé 日本語\t1234567 <|im_start|>user\n{\"a\": [1, 2]}</s> end  "
logger = logging.getLogger("deepinfer.loader")


@dataclass(frozen=True)
class Derived:
    """A GGUF file's transformers config and tokenizer (None when the file carries none)."""

    config: Any
    tokenizer: Any


def load_derived(path: str, identity: str, fields: dict, has_tokenizer: bool) -> Derived:
    """The config built from `fields` (gguf_config_dict's output) and the tokenizer stored in the
    file at `path`: read from the cache entry of `identity` where it holds them, else built by
    transformers (and the entry written)."""
    entry = _entry_dir(identity)
    meta = _read_meta(entry, fields)
    cached = _cached_config(meta) if meta else None
    config = cached if cached is not None else _auto_config(fields)
    tokenizer = _cached_tokenizer(entry, meta) if meta and has_tokenizer else None
    stale = meta is None or (has_tokenizer and tokenizer is None and meta.get("tokenizer") is not None)
    if has_tokenizer and tokenizer is None:  # transformers picks the class by the config's own class
        tokenizer = build_gguf_tokenizer(path, config if cached is None else _auto_config(fields))
    if stale and entry is not None:
        _write_entry(entry, fields, config, tokenizer)
    return Derived(config, tokenizer)


def build_gguf_tokenizer(path: str, config: Any) -> Any:
    """The tokenizer and chat template stored in the file, built by transformers' GGUF support.

    `AutoTokenizer.from_pretrained(..., gguf_file=...)` would first rebuild the config by parsing
    the whole metadata again (seconds); the class it would pick is chosen here from our config.
    """
    directory, name = os.path.split(path)
    return _tokenizer_class(config).from_pretrained(directory, gguf_file=name)


def _tokenizer_class(config: Any) -> Any:
    try:
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: let AutoTokenizer choose, at its cost
        from transformers import AutoTokenizer

        return AutoTokenizer
    try:
        return TOKENIZER_MAPPING.get(type(config), None) or TokenizersBackend
    except KeyError:
        return TokenizersBackend


def _auto_config(fields: dict) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(**fields)


# ---- the entry ----------------------------------------------------------------------------------

def _entry_dir(identity: str) -> str | None:
    """The entry's directory for the file of content `identity` (None without a cache directory)."""
    root = default_cache_dir()
    if root is None:
        return None
    import tokenizers
    import transformers

    key = f"{identity}\0{transformers.__version__}\0{tokenizers.__version__}\0{FORMAT}"
    return os.path.join(root, _SUBDIR, hashlib.sha256(key.encode()).hexdigest()[:32])


def _fields_digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=repr).encode()).hexdigest()


def _read_meta(entry: str | None, fields: dict) -> dict | None:
    """The entry's record when it exists, is well formed and was written from these `fields`."""
    if entry is None:
        return None
    try:
        with open(os.path.join(entry, _DERIVED), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("fields") != _fields_digest(fields):
        return None
    return meta


def _write_entry(entry: str, fields: dict, config: Any, tokenizer: Any) -> None:
    """Write the entry: the parts that read back unchanged (module docstring); errors are ignored."""
    parent = os.path.dirname(entry)
    temp = None
    try:
        os.makedirs(parent, exist_ok=True)
        temp = tempfile.mkdtemp(prefix=".partial-", dir=parent)
        meta = {"format": FORMAT, "fields": _fields_digest(fields), "config_class": type(config).__name__,
                "config": _config_record(config),
                "tokenizer": _save_tokenizer(tokenizer, os.path.join(temp, _TOKENIZER))}
        with open(os.path.join(temp, _DERIVED), "w", encoding="utf-8") as f:
            json.dump(meta, f)
        shutil.rmtree(entry, ignore_errors=True)  # a damaged or outdated entry
        os.rename(temp, entry)
        temp = None
        _prune(parent)
    except OSError as exc:
        logger.debug("GGUF cache entry %s not written: %s", entry, exc)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def _prune(parent: str) -> None:
    """Keep the MAX_ENTRIES most recently written entries."""
    entries = [os.path.join(parent, name) for name in os.listdir(parent) if not name.startswith(".")]
    entries.sort(key=os.path.getmtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        shutil.rmtree(old, ignore_errors=True)


# ---- config -------------------------------------------------------------------------------------

def _config_record(config: Any) -> str | None:
    """repr of the config's instance fields and class attributes, when its class is plain data and
    the config read back from it has the same fields and `to_dict()`; else None."""
    cls = type(config)
    attrs = _class_attributes(cls)
    if attrs is None:
        return None
    record = repr({"fields": vars(config), "class": attrs})
    try:
        copy = _config_from(cls.__name__, record)
        same = vars(copy) == vars(config) and copy.to_dict() == config.to_dict()
    except Exception:  # any failure to read it back only means the config is not cached
        return None
    return record if same else None


def _class_attributes(cls: type) -> dict | None:
    """The public class attributes a plain config class adds to PreTrainedConfig, or None when it adds
    properties, methods other than validators, an attribute map or sub-configs."""
    from transformers.configuration_utils import PreTrainedConfig

    if cls is PreTrainedConfig or not issubclass(cls, PreTrainedConfig) or cls.attribute_map:
        return None
    attrs: dict = {}
    for klass in reversed(cls.__mro__[:cls.__mro__.index(PreTrainedConfig)]):
        for name, value in vars(klass).items():
            if name.startswith("__") or name in _VALIDATORS:
                continue
            if callable(value) or isinstance(value, property | classmethod | staticmethod) or "sub_configs" in name:
                return None
            attrs[name] = value
    return attrs


def _cached_config(meta: dict) -> Any:
    record, name = meta.get("config"), meta.get("config_class")
    if not isinstance(record, str) or not isinstance(name, str):
        return None
    try:
        return _config_from(name, record)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _config_from(name: str, record: str) -> Any:
    """The config a `_config_record` describes: an instance of a PreTrainedConfig subclass called
    `name` with the record's class attributes, its fields set without running `__init__`."""
    data = ast.literal_eval(record)  # literals only: nothing in the cache is executed
    if not (isinstance(data, dict) and isinstance(data.get("fields"), dict) and isinstance(data.get("class"), dict)):
        raise ValueError("not a config record")
    cls = _config_class(name, repr(data["class"]))
    config = cls.__new__(cls)
    config.__dict__.update(data["fields"])
    return config


@functools.cache
def _config_class(name: str, class_record: str) -> type:
    from transformers.configuration_utils import PreTrainedConfig

    attrs = ast.literal_eval(class_record)
    return type(name, (PreTrainedConfig,), {**attrs, "__module__": __name__, "__qualname__": name})


# ---- tokenizer ----------------------------------------------------------------------------------

def _save_tokenizer(tokenizer: Any, directory: str) -> dict | None:
    """Save `tokenizer` into `directory`; what `_read_tokenizer` needs to read it back ({"class":
    "module:name", "added_tokens": ...}) when it reads back alike, else None."""
    if tokenizer is None:
        return None
    cls = type(tokenizer)
    if not cls.__module__.startswith("transformers."):
        return None
    tokenizer.save_pretrained(directory)
    record = {"class": f"{cls.__module__}:{cls.__qualname__}",
              "added_tokens": json.loads(tokenizer.backend_tokenizer.to_str()).get("added_tokens", [])}
    try:
        same = _same_tokenizer(tokenizer, _read_tokenizer(directory, record))
    except Exception:  # any failure to read it back only means the tokenizer is not cached
        return None
    return record if same else None


def _read_tokenizer(directory: str, record: dict) -> Any:
    """The tokenizer saved in `directory`, by its class. The added tokens are passed as they stand in
    tokenizer.json, which transformers would otherwise parse whole in Python for them."""
    module, _, name = record["class"].partition(":")
    if not module.startswith("transformers."):
        raise ValueError(f"tokenizer class {record['class']!r} is not transformers'")
    added = {int(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in record["added_tokens"]}
    cls = getattr(importlib.import_module(module), name)
    return cls.from_pretrained(directory, added_tokens_decoder=added)


def _same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers encode, decode and render chats alike (what the engine asks of one)."""
    if _settings(a) != _settings(b):
        return False
    ids = a(_PROBE)["input_ids"]
    if ids != b(_PROBE)["input_ids"] or a.decode(ids) != b.decode(ids):
        return False
    if a.chat_template is None:
        return True
    chat = [{"role": "user", "content": _PROBE}]
    return (a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def _settings(tokenizer: Any) -> tuple:
    """What a tokenizer is made of: its backend, special and added tokens, chat template and limits."""
    added = {i: repr(t) for i, t in tokenizer.added_tokens_decoder.items()}
    return (tokenizer.backend_tokenizer.to_str(), tokenizer.special_tokens_map, tokenizer.all_special_ids, added,
            tokenizer.chat_template, tokenizer.model_max_length, tokenizer.padding_side, tokenizer.truncation_side)


def _cached_tokenizer(entry: str, meta: dict) -> Any:
    """The saved tokenizer (None when the entry has none, or it fails to load)."""
    record = meta.get("tokenizer")
    if not isinstance(record, dict):
        return None
    try:
        return _read_tokenizer(os.path.join(entry, _TOKENIZER), record)
    except Exception as exc:  # a damaged entry: build it again
        logger.debug("GGUF cache entry %s: tokenizer not read back: %s", entry, exc)
        return None
